"""The ``npu_cached`` Dynamo backend: key -> store -> load, or compile and store.

It owns the caching decision only; compiling and loading belong to the inner
compilers (``compilers/``), bytes on disk to the store (``store.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from . import graph_load
from . import key as keys
from .compile_mode import COMPILE_MODES, apply_mode  # noqa: F401  (re-exported)
from .compilers import get_compiler
from .compilers.base import Artifact, InnerCompiler  # noqa: F401  (Artifact: re-exported)
from .graph_load import CachedGraph, graph_store, load_graph  # noqa: F401  (re-exported: the load side of a graph)
from .logs import log, warn_once
from .options import BackendOptions, parse_options
from .stats import record, record_uncached
from .store import Store

GRAPH_CODE = "graph_code.py"  # readable copy of the FX graph beside each entry


def _needs_autograd(example_inputs: list[Any]) -> bool:
    import torch

    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    )


def _identity(factors: dict[str, Any]) -> str:
    """The key without the environment: finds entries built under other versions."""
    return keys.digest({k: v for k, v in factors.items() if k != "environment"})


def compile_graph(gm: Any, example_inputs: list[Any], options: BackendOptions) -> CachedGraph:
    """Serve one Dynamo graph from the cache, or compile and cache it."""
    import torch

    compiler = get_compiler(options.resolved_compiler())
    if options.reject_rng:
        from .rng import reject_rng_ops

        reject_rng_ops(gm)
    training = _needs_autograd(example_inputs)
    compile_fn: Callable[..., Any] = compiler.compile
    if training:
        blocker = _training_blocker(gm, compiler)
        if blocker is not None:
            return _compile_uncached(gm, example_inputs, compiler, options, blocker)
        compile_fn = compiler.compile_training  # type: ignore[attr-defined]

    key, factors = keys.compute_key(gm, example_inputs, compiler, options, torch.is_grad_enabled(), training=training)
    store = graph_store(options)
    fn = graph_load.load_graph(store, key, compiler, options)  # one seam with the bypass loader's loads
    if fn is None:
        with store.lock(key, timeout=options.lock_timeout):
            fn = graph_load.load_graph(store, key, compiler, options)  # another process may have finished it
            if fn is None:
                fn = _compile_and_store(store, key, factors, gm, example_inputs, compiler, options, compile_fn)
    return _announce(fn, options, gm)


def _training_blocker(gm: Any, compiler: InnerCompiler) -> str | None:
    """Why a graph that needs autograd cannot go through the cache, or None."""
    if getattr(compiler, "compile_training", None) is None:
        return f"the {compiler.name} inner compiler caches inference graphs only"
    if hasattr(gm, "saved_tensors_hooks_pack_0"):
        return "saved-tensor hooks are traced into the graph"
    import torch._dynamo.compiled_autograd as ca

    if getattr(ca, "in_compiled_autograd_region", False) or getattr(ca, "compiled_autograd_enabled", False):
        return "compiled autograd is active"
    return None


def _compile_uncached(
    gm: Any, example_inputs: list[Any], compiler: InnerCompiler, options: BackendOptions, reason: str
) -> CachedGraph:
    warn_once(
        f"autograd:{reason}",
        "npu_cached: a graph needs autograd (grad mode is on and an input requires grad) and %s, so it is "
        "compiled uncached.", reason,
    )
    t0 = time.perf_counter()
    fn = compiler.compile(gm, example_inputs, options).fn
    record(uncached=1, compile_seconds=time.perf_counter() - t0)
    record_uncached(reason)
    return _announce(CachedGraph(fn, "", compiler.name, cached=False, reason=f"it needs autograd and {reason}"),
                     options, gm)


def _announce(graph: CachedGraph, options: BackendOptions, gm: Any) -> CachedGraph:
    """Attach what the bypass capture needs and make sure it is listening."""
    graph.options = options
    graph.input_dims = _input_dims(gm)
    from .bypass.capture_hook import ensure_installed

    ensure_installed()
    return graph


def _input_dims(gm: Any) -> dict[str, list[int | None]]:
    import torch

    dims: dict[str, list[int | None]] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        value = node.meta.get("example_value")
        name = source.name if isinstance(getattr(source, "name", None), str) else (source.name() if source is not None else "")
        if isinstance(value, torch.Tensor) and name.startswith("L['") and name.endswith("']"):
            dims[name[3:-2]] = [d if isinstance(d, int) else None for d in value.shape]
    return dims


def _compile_and_store(
    store: Store,
    key: str,
    factors: dict[str, Any],
    gm: Any,
    example_inputs: list[Any],
    compiler: InnerCompiler,
    options: BackendOptions,
    compile_fn: Callable[..., Any] | None = None,
) -> CachedGraph:
    identity = _identity(factors)
    log.info("npu_cached: compiling graph %s (%d nodes) with %s", key[:12], len(gm.graph.nodes), compiler.name)
    t0 = time.perf_counter()
    result = (compile_fn or compiler.compile)(gm, example_inputs, options)
    dt = time.perf_counter() - t0
    record(misses=1, compile_seconds=dt)
    if result.artifact is None:
        record_uncached(result.reason)
        warn_once(f"uncached:{result.reason}", "npu_cached: graph %s compiled but not cached: %s", key[:12], result.reason)
        log.info("npu_cached miss %s (%s) compiled in %.3fs, not cacheable", key[:12], compiler.name, dt)
        return CachedGraph(result.fn, key, compiler.name, cached=False, reason=f"{compiler.name}: {result.reason}")
    files = dict(result.artifact.files)
    files.setdefault(GRAPH_CODE, gm.code.encode())
    manifest = {
        "identity": identity,
        "compiler": compiler.name,
        "factors": factors,
        "versions": factors["environment"],
        "meta": result.artifact.meta,
        "compile_seconds": round(dt, 3),
    }
    if store.save(key, files, manifest) is None:  # a storage fault (logged once by the store): serve it uncached
        log.info("npu_cached miss %s (%s) compiled in %.3fs, not stored", key[:12], compiler.name, dt)
        return CachedGraph(result.fn, key, compiler.name, cached=False, reason="it could not be stored (a storage fault)")
    log.info("npu_cached miss %s (%s) compiled in %.3fs and stored", key[:12], compiler.name, dt)
    if options.max_size is not None:
        _bound_size(store, options.max_size, key)
    return CachedGraph(result.fn, key, compiler.name, cached=True)


def _bound_size(store: Store, max_size: int, just_stored: str) -> None:
    """Apply the ``max_size`` option after a store: least recently used entries go first."""
    from .prune import bound

    try:
        bound(store, max_size, just_stored)  # a ledger: a full scan only when over max_size, or now and then
    except Exception as exc:  # bounding the cache must never fail the user's call
        warn_once(f"prune:{store.root}", "npu_cached: could not bound the cache %s to max_size: %s", store.root, exc)


def npu_cached(gm: Any, example_inputs: list[Any], *, options: dict[str, Any] | None = None, mode: str | None = None) -> Any:
    """The ``npu_cached`` backend: ``torch.compile(m, backend="npu_cached", options={...})``;
    ``mode`` as in ``torch.compile`` (see :func:`apply_mode`)."""
    return compile_graph(gm, example_inputs, apply_mode(parse_options(options), mode))


def make_backend(**options: Any) -> Callable[..., Any]:
    """A backend callable with options bound (validated now, not at first call)."""
    parsed = parse_options(options)
    from .bypass.capture_hook import ensure_installed

    ensure_installed()  # before Dynamo transforms the first frame

    def npu_cached_bound(gm: Any, example_inputs: list[Any], **kwargs: Any) -> Any:
        return compile_graph(gm, example_inputs, parsed)

    npu_cached_bound.options = parsed  # type: ignore[attr-defined]
    # the compiles of load() / cache_compile / prebuild, which tried (or fill) the cache themselves:
    # Dynamo traces them, the backend route does not replay them again (bypass/frame_install.py)
    npu_cached_bound.replay_route = False  # type: ignore[attr-defined]
    return npu_cached_bound


__all__ = ["npu_cached", "make_backend", "compile_graph", "CachedGraph"]
