"""Process-wide hit/miss counters, so a user (or a test) can see what the cache did."""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass
class CacheStats:
    """Counts and seconds since process start (or the last :func:`reset_stats`)."""

    hits: int = 0
    misses: int = 0
    uncached: int = 0  # graphs compiled without the cache (autograd, unsupported)
    quarantined: int = 0  # broken entries set aside
    load_seconds: float = 0.0
    compile_seconds: float = 0.0
    bypass_loads: int = 0  # functions warm-started by the guard-bypass loader


_lock = threading.Lock()
_stats = CacheStats()


def record(**deltas: float) -> None:
    with _lock:
        for name, delta in deltas.items():
            setattr(_stats, name, getattr(_stats, name) + delta)


def stats() -> CacheStats:
    """A snapshot of the counters."""
    with _lock:
        return dataclasses.replace(_stats)


def reset_stats() -> None:
    global _stats
    with _lock:
        _stats = CacheStats()
