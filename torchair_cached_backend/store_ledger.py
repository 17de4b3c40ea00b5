"""The size ledger of a cache root: ``max_size`` without a scan per graph.

``<root>/locks/size-ledger.json`` holds the bytes the root held at the last full
scan plus what was published since (``{"total", "saves", "at"}``), updated under
an flock by every publish once a ledger exists (only caches with ``max_size``
have one). It may drift (removals by hand, quarantine moves, unpacks, nested
roots): it is re-counted by a full scan when it says the cache is over
``max_size``, after 256 publishes, or after an hour.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from typing import Any

from . import fs_security as fs
from . import store_locks as locks
from .store_layout import loads_bounded

LEDGER = "size-ledger.json"
_RESCAN_SAVES = 256
_RESCAN_S = 3600.0


def _read(dfd: int) -> dict | None:
    try:
        fd = os.open(LEDGER, fs.FILE_READ_FLAGS, dir_fd=dfd)
    except OSError:
        return None
    try:
        value = loads_bounded(os.read(fd, 4096))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    ok = isinstance(value, dict) and all(
        isinstance(value.get(k), (int, float)) and not isinstance(value.get(k), bool) for k in ("total", "saves", "at"))
    return value if ok else None


def _write(dfd: int, ledger: dict) -> None:
    tmp = f".{LEDGER}.{uuid.uuid4().hex[:8]}"
    try:
        fs.write_at(dfd, tmp, json.dumps(ledger).encode())
        os.replace(tmp, LEDGER, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)


@contextlib.contextmanager
def _locked(backend: Any, *, create: bool):
    try:
        dfd = backend.locks_fd(create=create)
    except (OSError, fs.CacheSecurityError):
        dfd = None
    if dfd is None:
        yield None
        return
    try:
        held = None
        with contextlib.suppress(OSError):
            held = locks.acquire(dfd, LEDGER + ".lock", timeout=10.0, what=f"the size ledger of {backend.root}")
        try:
            yield dfd
        finally:
            if held is not None:
                held.release()
    finally:
        os.close(dfd)


def add(backend: Any, nbytes: int) -> None:
    """Count a publish of ``nbytes`` (no-op where there is no ledger)."""
    try:
        dfd = backend.locks_fd(create=False)
    except (OSError, fs.CacheSecurityError):
        return
    if dfd is None:
        return
    try:
        os.stat(LEDGER, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return  # no max_size on this cache: nothing to count
    finally:
        os.close(dfd)
    with _locked(backend, create=False) as dfd:
        if dfd is None:
            return
        ledger = _read(dfd)
        if ledger is not None:
            _write(dfd, dict(ledger, total=int(ledger["total"]) + nbytes, saves=int(ledger["saves"]) + 1))


def total_if_fresh(backend: Any) -> int | None:
    """The ledger's total, or None when there is none or it is due for a re-count."""
    with _locked(backend, create=False) as dfd:
        ledger = None if dfd is None else _read(dfd)
    if ledger is None or ledger["saves"] >= _RESCAN_SAVES or time.time() - ledger["at"] >= _RESCAN_S:
        return None
    return int(ledger["total"])


def reset(backend: Any, total: int) -> None:
    """Record a full count."""
    with _locked(backend, create=True) as dfd:
        if dfd is not None:
            _write(dfd, {"total": int(total), "saves": 0, "at": time.time()})
