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

from .key import canonical_json, decomposition_factors
from .logs import log, warn_once
from .options import CACHE_HOME_ENV, DEFAULT_CACHE_DIR, parse_options
from .torchair_config import backend_config, config_snapshot, is_aclgraph_mode

_KWARGS = ("custom_decompositions", "compiler", "fullgraph")


def _root_dir(cache_dir: str | os.PathLike[str] | None) -> str:
    root = os.fspath(cache_dir) if cache_dir is not None else os.environ.get(CACHE_HOME_ENV) or DEFAULT_CACHE_DIR
    return os.path.abspath(root)  # relative -> ${work_dir}/${cache_dir}


def _owner_name(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    if owner is not None:
        return type(owner).__name__
    return func.__qualname__.split(".<locals>")[0].replace(".", "_")


def _rank_dir(global_rank: int | None, tp_rank: int | None, pp_rank: int | None) -> str | None:
    world = None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # as torchair: single card, no rank dir
            world = dist.get_world_size()
            if global_rank is None:
                global_rank = dist.get_rank()
    except Exception:
        pass
    parts = []
    if world is not None or global_rank is not None:
        parts.append(f"world{world if world is not None else 1}global_rank{global_rank or 0}")
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
        "config": config_snapshot(config),
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
    return a is b or canonical_json(config_snapshot(a)) == canonical_json(config_snapshot(b))


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
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fn is None:
            self._fn = self._first_call_target()
        out = self._fn(*args, **kwargs)
        if self._compiled:
            self._check_recompile()
        return out

    def _first_call_target(self) -> Callable[..., Any]:
        from .bypass.loader import CacheMiss, build_replay

        try:
            return build_replay(self._func, self._options)
        except CacheMiss as miss:
            log.info("cache_compile: %s; compiling", miss)
        import torch

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

    def _check_recompile(self) -> None:
        """The cache holds one compiled graph per function; a recompile invalidates it.

        Runs after every call of a compiled function, so it returns at once unless
        Dynamo transformed a frame since the last check."""
        from .bypass import capture
        from .bypass.capture import builders_for
        from .bypass.program import program_store

        if capture.generation == self._seen_generation:
            return
        self._seen_generation = capture.generation

        code = getattr(self._func, "__code__", None) or self._func.__func__.__code__  # type: ignore[attr-defined]
        for builder in builders_for(code):
            if builder.cache_dir == self._options.cache_dir and len(builder.variants) > 1 and not builder.disabled:
                builder.disabled = True
                program_store(builder.cache_dir).remove(builder.key)
                message = (
                    f"cache_compile: skip cache as {builder.identity['qualname']} recompiled (new input shapes or "
                    f"types); the cache at {self.cache_path} is invalidated. Use dynamic=True, or call with the "
                    "shapes it was cached for."
                )
                warn_once(f"recompiled:{builder.key}", "%s", message)
                warnings.warn(message, stacklevel=3)  # as torchair: visible without logging configured


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
    (``"auto" | "torchair" | "inductor" | "eager"``) and ``fullgraph`` (default False:
    graph breaks are cached and replayed; True makes them an error, as in torchair).
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
    backend_options = {
        "cache_dir": path,
        "compiler": compiler,
        "config": config,
        "ge_cache": ge_cache,
        "custom_decompositions": decompositions,
        "global_rank": global_rank,
        "tp_rank": tp_rank,
        "pp_rank": pp_rank,
        "dynamic": dynamic,
        "reject_rng": True,
    }
    parse_options(backend_options)  # fail now, not at the first call
    fullgraph = kwargs.get("fullgraph", False)
    if not isinstance(fullgraph, bool):
        raise TypeError(f"cache_compile(fullgraph=...) must be a bool, got {fullgraph!r}")
    return CacheCompiledFunction(func, path, backend_options, dynamic, fullgraph)
