"""Loading one stored graph: the read side of the backend, what a warm load imports.

``backend`` (key -> store -> load, or compile and store) uses these on every graph
too; the bypass loader imports only this module, never the compile side. Also the
callable both sides hand out, :class:`CachedGraph` (the capture recognizes it in a frame's
globals; the DDP split graph wraps it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .compilers import Artifact
from .logs import log
from .stats import record
from .store import Store

if TYPE_CHECKING:
    from .compilers.base import InnerCompiler
    from .options import BackendOptions


class CachedGraph:
    """The callable Dynamo installs as ``__compiled_fn_*``; carries its cache key
    so the bypass capture can find which stored graph a frame calls."""

    __slots__ = ("fn", "key", "compiler", "cached", "reason", "options", "input_dims", "__weakref__")

    def __init__(self, fn: Callable[..., Any], key: str, compiler: str, cached: bool, reason: str | None = None) -> None:
        self.fn = fn
        self.key = key
        self.compiler = compiler
        self.cached = cached
        self.reason = reason  # why it is not cached (the capture says so when it refuses the frame)
        self.options: BackendOptions | None = None
        #: frame-local name -> dims (int static, None symbolic), for the bypass input check
        self.input_dims: dict[str, list[int | None]] = {}

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def graph_store(options: BackendOptions) -> Store:
    """Where graphs live: ``graph_dir`` when set (shared, e.g. by the ranks of one
    job: entries are content-addressed by key), else the cache dir itself."""
    return Store(options.graph_dir or options.cache_dir, "graphs")


def load_graph(store: Store, key: str, compiler: InnerCompiler, options: BackendOptions) -> CachedGraph | None:
    """The stored graph ``key`` loaded by ``compiler``, or None (missing or set aside as broken)."""
    t0 = time.perf_counter()
    entry = store.load(key)
    if entry is None:
        return None
    artifact = Artifact(files=entry.files, meta=entry.manifest.get("meta", {}), root=entry.files_dir)
    try:
        fn = compiler.load(artifact, options)
    except Exception as exc:  # an entry we cannot load is never run: set aside, rebuild
        store.quarantine(key, f"{compiler.name} could not load it: {type(exc).__name__}: {exc}")
        return None
    dt = time.perf_counter() - t0
    record(hits=1, load_seconds=dt)
    log.info("npu_cached hit %s (%s) loaded in %.3fs", key[:12], compiler.name, dt)
    return CachedGraph(fn, key, compiler.name, cached=True)
