"""Process-wide hit/miss counters, so a user (or a test) can see what the cache did."""

from __future__ import annotations

import threading


class CacheStats:
    """Counts and seconds since process start (or the last :func:`reset_stats`).

    hits / misses: graph entries loaded / compiled; uncached: graphs compiled
    without the cache (autograd, not cacheable); quarantined: broken entries set
    aside; bypass_loads: functions warm-started by the guard-bypass loader;
    fallbacks: warm starts (or calls of a replayed function) that had to trace
    with Dynamo instead, with ``fallback_reasons`` counting each reason;
    storage_faults: cache reads/writes that failed (read-only or full disk, ...)
    and were served uncached instead of failing the call; base_hits / remote_hits:
    entries a local miss found in the read-only base / the remote (``layers.py``),
    remote_published, remote_bytes_in / _out, and remote_faults (a remote that was
    down, slow, full, refused auth, or an entry refused as corrupt, partial or unsigned).
    runtime_caches_set_aside: GE / torchair run-time caches inside entries that did not match their
    seal (or had none) and were moved to quarantine/ for GE to rebuild (``runtime_cache.py``).
    uncached_reasons: why graphs were compiled but not cached, counted by reason (e.g. a training
    graph whose outputs alias its inputs).
    (A plain class: it is imported with the package, on the warm path.)
    """

    __slots__ = (
        "hits", "misses", "uncached", "quarantined", "load_seconds", "compile_seconds", "bypass_loads",
        "fallbacks", "storage_faults", "fallback_reasons",
        "uncached_reasons",
        "base_hits", "remote_hits", "remote_published", "remote_faults", "remote_bytes_in", "remote_bytes_out",
        "runtime_caches_set_aside",
    )

    def __init__(self, **values: object) -> None:
        for name in self.__slots__:
            default: object = 0.0 if name.endswith("seconds") else 0
            if name in ("fallback_reasons", "uncached_reasons"):
                default = {}
            setattr(self, name, values.pop(name, default))
        if values:
            raise TypeError(f"unknown CacheStats fields {sorted(values)}")

    def as_dict(self) -> dict[str, object]:
        return {name: (dict(v) if isinstance(v := getattr(self, name), dict) else v) for name in self.__slots__}

    def __repr__(self) -> str:
        return "CacheStats(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheStats) and self.as_dict() == other.as_dict()


_lock = threading.Lock()
_stats = CacheStats()


def record(**deltas: float) -> None:
    with _lock:
        for name, delta in deltas.items():
            setattr(_stats, name, getattr(_stats, name) + delta)


def record_fallback(reason: str) -> None:
    """Count a warm start (or replayed call) that traced with Dynamo, by reason."""
    with _lock:
        _stats.fallbacks += 1
        reasons = _stats.fallback_reasons
        reasons[reason] = reasons.get(reason, 0) + 1


def record_uncached(reason: str) -> None:
    """Count, by reason, a graph compiled without being cached (the ``uncached`` or ``misses``
    counter counts the compile itself)."""
    with _lock:
        reasons = _stats.uncached_reasons
        reasons[reason] = reasons.get(reason, 0) + 1


def stats() -> CacheStats:
    """A snapshot of the counters."""
    with _lock:
        return CacheStats(**_stats.as_dict())


def reset_stats() -> None:
    global _stats
    with _lock:
        _stats = CacheStats()
