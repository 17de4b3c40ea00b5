"""``cache_compile``: a drop-in for ``torchair.inference.cache_compile``, as a thin
shim over the ``npu_cached`` backend (compile and cache graphs) and the
guard-bypass loader (warm start without Dynamo).

Layout, as the reference describes: ``${cache_dir}/${model_info}/[world{N}global_rank{r}[_tp_rank{t}][_pp_rank{p}]/]${func}``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .key import canonical_json, decomposition_factors
from .logs import log, warn_once
from .options import CACHE_HOME_ENV, DEFAULT_CACHE_DIR, parse_options
from .torchair_config import backend_config, is_aclgraph_mode, normalized_config_snapshot

_KWARGS = ("custom_decompositions", "compiler", "fullgraph", "guards")


def _root_dir(cache_dir: str | os.PathLike[str] | None) -> str:
    root = os.fspath(cache_dir) if cache_dir is not None else os.environ.get(CACHE_HOME_ENV) or DEFAULT_CACHE_DIR
    return os.path.abspath(root)  # relative -> ${work_dir}/${cache_dir}


def _owner_name(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    if owner is not None:
        return type(owner).__name__
    return func.__qualname__.split(".<locals>")[0].replace(".", "_")


def _rank_dir(global_rank: int | None, tp_rank: int | None, pp_rank: int | None) -> str | None:
    """torchair's rank directory: ``world{W}global_rank{R}`` only inside an initialized
    process group of more than one rank (``global_rank`` alone adds nothing), then
    ``tp_rank{t}`` and ``pp_rank{p}`` when given; None when there is no part."""
    parts = []
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rank = dist.get_rank() if global_rank is None else global_rank
            parts.append(f"world{dist.get_world_size()}global_rank{rank}")
    except Exception:
        pass
    if tp_rank is not None:
        parts.append(f"tp_rank{tp_rank}")
    if pp_rank is not None:
        parts.append(f"pp_rank{pp_rank}")
    return "_".join(parts) if parts else None


def model_info(func: Any, *, config: Any, dynamic: bool, ge_cache: bool, compiler: str, decompositions: Any) -> str:
    """``<Owner>_<dynamic|static>[_aclgraphcache][_gecache]_<md5>``: the md5 covers the
    owner module's structure and every option, so differently-configured
    compilations of one model never share a directory."""
    owner = getattr(func, "__self__", None)
    if owner is None:
        described = f"{func.__module__}.{func.__qualname__}"
    elif type(owner).__repr__ is object.__repr__:  # "<... object at 0x...>" differs in every process
        described = f"{type(owner).__module__}.{type(owner).__qualname__}"
    else:  # an nn.Module prints its structure, as torchair hashes it
        described = str(owner)
    options = {
        "config": normalized_config_snapshot(config),  # None == CompilerConfig(), as in torchair
        "dynamic": dynamic,
        "ge_cache": ge_cache,
        "compiler": compiler,
        "decompositions": decomposition_factors(decompositions),
    }
    md5 = hashlib.md5((described + canonical_json(options)).encode(), usedforsecurity=False).hexdigest()
    tags = ["dynamic" if dynamic else "static"]
    if is_aclgraph_mode(config):
        tags.append("aclgraphcache")
    if ge_cache:
        tags.append("gecache")
    return "_".join([_owner_name(func), *tags, md5])


def _configs_equal(a: Any, b: Any) -> bool:
    """Equal option by option; ``None`` equals a default ``CompilerConfig()``."""
    return a is b or canonical_json(normalized_config_snapshot(a)) == canonical_json(normalized_config_snapshot(b))


class CacheCompiledFunction:
    """What :func:`cache_compile` returns: warm-starts from the cache on the first
    call, else compiles (caching as it goes); the same arguments as ``func``."""

    def __init__(
        self,
        func: Callable[..., Any],
        cache_path: str,
        backend_options: dict[str, Any],
        dynamic: bool,
        fullgraph: bool = False,
    ) -> None:
        self._fullgraph = fullgraph
        self._func = func
        self.cache_path = cache_path
        self._backend_options = backend_options
        self._options = parse_options(backend_options)
        self._dynamic = dynamic
        self._fn: Callable[..., Any] | None = None
        self._compiled = False
        self._seen_generation = -1
        self._variants_seen = 0
        self._grad_logged = False
        self._grad_warned = False
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # As torchair's cache_compile: every call runs under torch.no_grad().
        if not torch.is_grad_enabled():
            return self._call(args, kwargs)
        if not self._grad_warned:
            self._explain_no_grad(args, kwargs)
        torch._C._set_grad_enabled(False)
        try:
            return self._call(args, kwargs)
        finally:
            torch._C._set_grad_enabled(True)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._fn is None:
            self._fn = self._first_call_target()
        out = self._fn(*args, **kwargs)
        if self._compiled:
            self._note_recompile()
        return out

    def _explain_no_grad(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Say clearly, once, that gradients do not flow through the cached function: a
        warning when a caller passes inputs that require grad, else one INFO line."""
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
        message = (
            f"cache_compile runs {getattr(self._func, '__qualname__', self._func)} under torch.no_grad(), as "
            "torchair's cache_compile does: its outputs never require grad and nothing is recorded for backward. "
            "For training, call the function directly or use torch.compile without the cache."
        )
        if inputs:
            self._grad_warned = True
            warn_once(f"no_grad:{id(self)}", "%s (%d input(s) require grad)", message, len(inputs))
            warnings.warn(message, stacklevel=4)
        elif not self._grad_logged:
            self._grad_logged = True
            log.info("%s", message)

    def _torch_compile(self) -> Callable[..., Any]:
        from .backend import make_backend

        self._compiled = True
        # torchair compiles with fullgraph=True, so a graph break is an error there. By default the
        # capture replays resume functions too, so a graph break is served (as several graphs)
        # instead of failing; fullgraph=True (as vllm-ascend passes it) restores the strict form.
        return torch.compile(
            self._func,
            backend=make_backend(**self._backend_options),
            dynamic=self._dynamic,
            fullgraph=self._fullgraph,
        )

    def _first_call_target(self) -> Callable[..., Any]:
        from .bypass.loader import CacheMiss, _reason_kind, build_replay
        from .stats import record_fallback

        try:
            return build_replay(self._func, self._options, fallback=self._torch_compile)
        except CacheMiss as miss:
            record_fallback(_reason_kind(str(miss)))
            log.info("cache_compile: %s; compiling", miss)
        return self._torch_compile()

    def _note_recompile(self) -> None:
        """torchair invalidates its single cached graph when Dynamo recompiles; our
        program keeps one variant per recompile, each selected by its own guards, so
        a recompile only adds a variant. Say so once, where torchair would warn.

        Runs after every call of a compiled function, so it returns at once unless
        Dynamo transformed a frame since the last check."""
        from .bypass import capture

        if capture.generation == self._seen_generation:
            return
        self._seen_generation = capture.generation
        code = getattr(self._func, "__code__", None) or self._func.__func__.__code__  # type: ignore[attr-defined]
        for builder in capture.builders_for(code):
            if builder.cache_dir != self._options.cache_dir:
                continue
            count = builder.variant_count()
            if count > 1 and count > self._variants_seen:
                log.info(
                    "cache_compile: %s recompiled (new input shapes, types or state); the cache at %s now holds "
                    "%d variants, each replayed only when its guards hold (torchair would drop its cache here)",
                    builder.identity["qualname"], self.cache_path, count,
                )
            self._variants_seen = max(self._variants_seen, count)


def cache_compile(
    func: Callable[..., Any],
    *,
    config: Any = None,
    backend: Any = None,
    dynamic: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    global_rank: int | None = None,
    tp_rank: int | None = None,
    pp_rank: int | None = None,
    ge_cache: bool = False,
    **kwargs: Any,
) -> Callable[..., Any]:
    """Cache the compilation of ``func`` (an nn.Module method, ``model.forward``, a
    function, or a closure): same signature and behaviour as torchair's.

    ``kwargs`` takes ``custom_decompositions``, ``compiler``
    (``"auto" | "torchair" | "inductor" | "eager"``), ``fullgraph`` (default False:
    graph breaks are cached and replayed; True makes them an error, as in torchair) and
    ``guards`` (``"load"`` default, ``"call"``, or ``"none"`` for torchair's unchecked replay).
    Every call runs under ``torch.no_grad()``, as torchair's does.
    """
    unknown = sorted(set(kwargs) - set(_KWARGS))
    if unknown:
        raise TypeError(f"cache_compile() got unexpected keyword arguments {unknown}; supported: {list(_KWARGS)}")
    if not callable(func) or not isinstance(func, (types.FunctionType, types.MethodType)):
        raise TypeError(
            f"cache_compile expects a Python function or bound method (e.g. self.inner_forward), got {type(func).__name__}"
        )
    if backend is not None:
        inner = backend_config(backend)
        if config is not None and inner is not None and not _configs_equal(config, inner):
            raise ValueError(
                "config in current backend is different from the config passed to cache_compile; pass only one "
                "of them, or the same CompilerConfig to both"
            )
        if config is None:
            config = inner
    if not isinstance(dynamic, bool):
        raise TypeError(f"cache_compile(dynamic=...) must be a bool, got {dynamic!r}")
    compiler = kwargs.get("compiler", "auto")
    decompositions = kwargs.get("custom_decompositions")
    if ge_cache and is_aclgraph_mode(config):
        warn_once("ge_cache-aclgraph", "cache_compile: ge_cache=True has no effect in aclgraph modes "
                  "(reduce-overhead/npugraph_ex); it applies to GE max-autotune only")
        ge_cache = False
    info = model_info(func, config=config, dynamic=dynamic, ge_cache=ge_cache, compiler=compiler, decompositions=decompositions)
    parts = [_root_dir(cache_dir), info]
    rank_dir = _rank_dir(global_rank, tp_rank, pp_rank)
    if rank_dir:
        parts.append(rank_dir)
    parts.append(func.__name__)
    path = os.path.join(*parts)
    # Graphs are content-addressed by key, so the ranks of a job share one graph store per model
    # (``${model_info}/graphs``: each distinct graph compiles once, the other ranks wait on its lock
    # and load it); programs stay in torchair's per-rank layout. A GE cache or aclgraph static
    # kernels are written beside a graph at run time by its rank, so those graphs stay per rank.
    shared_graphs = rank_dir is not None and not ge_cache and not is_aclgraph_mode(config)
    backend_options = {
        "cache_dir": path,
        "graph_dir": os.path.join(parts[0], info) if shared_graphs else None,
        "compiler": compiler,
        "config": config,
        "ge_cache": ge_cache,
        "custom_decompositions": decompositions,
        "global_rank": global_rank,
        "tp_rank": tp_rank,
        "pp_rank": pp_rank,
        "dynamic": dynamic,
        "reject_rng": True,
        "guards": kwargs.get("guards", "load"),
    }
    parse_options(backend_options)  # fail now, not at the first call
    fullgraph = kwargs.get("fullgraph", False)
    if not isinstance(fullgraph, bool):
        raise TypeError(f"cache_compile(fullgraph=...) must be a bool, got {fullgraph!r}")
    return CacheCompiledFunction(func, path, backend_options, dynamic, fullgraph)
