"""The write side of :class:`~torchair_cached_backend.store.Store`: publish, replace,
quarantine, the per-key compile locks, remove and sweep.

``Store``'s write methods call these (each takes the store); internal steps go
through the store's methods, so a test that patches ``Store._acquire`` or
``Store.sweep`` sees every use. A warm load only reads (a broken entry it finds is
quarantined through here), so a hit never imports this module.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from . import fs_security as fs
from . import store_backend as backend_mod
from .fs_security import fcntl
from .fs_security import flock as _flock
from .logs import log, warn_once
from .stats import record
from .store import _WAIT_LOG_S, DEFAULT_LOCK_TIMEOUT_S, LOCK_TIMEOUT_ENV, Store
from .store_layout import BrokenEntry, sha256, valid_name

if TYPE_CHECKING:
    from . import store_locks as locks


def default_lock_timeout() -> float:
    """``$TORCHAIR_CACHE_LOCK_TIMEOUT`` seconds if set and valid, else 600."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV)
    if raw:
        try:
            value = float(raw)
            if value >= 0 and value == value and value != float("inf"):
                return value
        except ValueError:
            pass
        warn_once(f"lock-env:{raw}", "npu_cached: ignoring %s=%r (expected seconds >= 0)", LOCK_TIMEOUT_ENV, raw)
    return DEFAULT_LOCK_TIMEOUT_S


def prepare(store: Store, *, quiet: bool = False) -> bool:
    """Create the store's directories and CACHEDIR.TAG before a write.

    False when the cache dir cannot be written; the fault is counted and
    warned about unless ``quiet`` (a later write will report it)."""
    if store._ready and backend_mod.root_fd(store.root, create=False) is not None:
        return True
    blocker = store._write_blocker()
    if blocker is not None:
        if not quiet:
            store._fault(blocker, "write to the cache")
        return False
    try:
        kfd = store.backend.kind_fd(store.kind, create=True)
        if kfd is not None:
            os.close(kfd)
        store.backend.ensure_tag()
    except fs.CacheSecurityError:
        raise
    except OSError as exc:
        store._fault(exc, f"create the cache dir {store.dir}")
        return False
    store._ready = True
    return True


def save(store: Store, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str | None:
    """Atomically publish an entry; if another process published ``key`` first, keep theirs.

    Returns the entry's path, or None when nothing was published: the cache
    dir cannot be written (read-only, full, no permission, I/O error; logged
    once, counted in ``stats().storage_faults``, never raised), or a broken
    entry of another writer is in the way. The caller then serves its result
    uncached. A cache dir that vanished (a cleanup job) is recreated once."""
    return store._publish(key, files, manifest, replace=False)


def publish(store: Store, key: str, files: dict[str, bytes], manifest: dict[str, Any], *, replace: bool) -> str | None:
    final = store.entry_path(key)
    for name in files:
        if not valid_name(name):
            raise ValueError(f"invalid blob name {name!r}: a plain file name without '/' or a leading '.'")
    for attempt in (1, 2):
        if not store.prepare():
            return None
        try:
            if not store.backend.publish(store.kind, key, files, manifest, replace=replace):
                return None
            from . import layers

            layers.published(store, key, files, manifest, replace=replace)  # the remote, if any
            from . import store_ledger as ledger  # the write side: never imported by a warm load

            ledger.add(store.backend, sum(map(len, files.values())) + 4096)  # blobs, manifest and dirs, roughly
            return final
        except fs.CacheSecurityError:
            raise
        except FileNotFoundError as exc:
            if attempt == 1:
                store._ready = False  # the cache dir vanished under us: recreate it and try again
                backend_mod.forget_root(store.root)
                continue
            store._fault(exc, f"store the cache entry {store.kind}/{key[:12]}")
        except OSError as exc:
            store._fault(exc, f"store the cache entry {store.kind}/{key[:12]}")
        return None
    return None


def replace(store: Store, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str | None:
    """Publish an entry, replacing an existing one (programs grow as frames compile).

    The new entry is written completely (fsync'd) before the old one is swapped
    out (an atomic exchange where the filesystem has it), so a full disk or a
    crash leaves the old entry in place. Returns the path, or None when
    nothing was published (a storage fault, as :meth:`save`)."""
    final = store.entry_path(key)
    if store._holds(key, files, manifest):
        return final  # already published as is: no write (a warm start re-captures the same program)
    return store._publish(key, files, manifest, replace=True)


def holds(store: Store, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> bool:
    """Whether the published entry ``key`` already has exactly these blobs and manifest fields."""
    import json

    try:
        existing = store.read_manifest(key)
    except (BrokenEntry, OSError):
        return False
    if existing is None:
        return False
    stored = existing.get("files")
    if not isinstance(stored, dict) or set(stored) != set(files):
        return False
    if any(stored[name].get("sha256") != sha256(data) for name, data in files.items()):
        return False
    wanted = json.loads(json.dumps(manifest, default=str))
    return all(existing.get(k) == v for k, v in wanted.items())


def quarantine(store: Store, key: str, reason: str, *, identity: tuple[int, int] | None = None) -> None:
    """Move a broken entry aside (kept for inspection) and log why, once.

    ``identity`` names the directory found broken: an entry a writer has
    since swapped in is left alone. On a read-only cache dir nothing is
    moved; the entry is reported and skipped."""
    if store._write_blocker() is not None:
        warn_once(
            f"broken:{store.entry_path(key)}",
            "npu_cached: cache entry %s/%s is broken (%s); the cache dir %s is read-only, so it is skipped "
            "(not moved) and the graph is served uncached. Rebuild the cache where it is written.",
            store.kind, key[:12], reason, store.root,
        )
        return
    try:
        dst = store.backend.move_to_quarantine(store.kind, key, identity)
    except fs.CacheSecurityError:
        raise
    except OSError as exc:
        store._fault(exc, f"move the broken cache entry {store.kind}/{key[:12]} to quarantine/ ({reason})")
        return
    if dst is None:
        return  # gone, or another writer swapped in a new entry meanwhile
    record(quarantined=1)
    store._drop_lock_file(key)
    log.warning("cache entry %s/%s is broken (%s); moved to %s and rebuilding", store.kind, key[:12], reason, dst)


@contextlib.contextmanager
def lock(store: Store, key: str, timeout: float | None = None) -> Iterator[None]:
    """Cross-process lock per key: one process compiles, the others wait and load.

    An flock: it dies with its process, so a lock left by a killed process
    never blocks. Waiting is bounded by ``timeout`` (default: option
    ``lock_timeout`` / ``$TORCHAIR_CACHE_LOCK_TIMEOUT``, else 600 s); the waiter
    names the holder after 2 s, and on timeout the block runs without the
    lock. It degrades to no lock (warned once, counted) where the lock file
    cannot be created: a read-only dir gets no lock file at all. With a remote
    the remote's lease lock is held inside it (``layers.fleet_lock``)."""
    wait = default_lock_timeout() if timeout is None else timeout
    held = store._acquire(key, wait)
    try:
        from . import layers

        with layers.fleet_lock(store, key, wait):  # one node of a fleet compiles (a remote, if any)
            yield
    finally:
        if held is not None:
            with contextlib.suppress(OSError):
                held.release()


def acquire(store: Store, key: str, timeout: float) -> locks.KeyLock | None:
    if not store.prepare(quiet=True):
        return None  # read-only: the save that follows reports it
    from . import store_locks as locks  # compiling only: never imported by a warm load

    path = store._lock_path(key)
    t0 = time.monotonic()
    try:
        dfd = store.backend.locks_fd(create=True)
        assert dfd is not None
        try:
            held = locks.acquire(dfd, store._lock_name(key), timeout=timeout, what=f"{store.kind}/{key[:12]} in {store.root}")
        except fs.CacheSecurityError as exc:  # the lock file itself planted (a FIFO, a file of another user)
            record(storage_faults=1)
            warn_once(f"planted-lock:{path}", "npu_cached: %s; %s/%s is compiled without the cross-process lock "
                      "meanwhile (remove %s)", exc, store.kind, key[:12], path)
            return None
        finally:
            os.close(dfd)
    except fs.CacheSecurityError:
        raise
    except OSError as exc:
        store._fault(
            exc,
            f"create the lock file {path} (compiles of one graph are not coordinated across processes meanwhile)",
            lock=True,
        )
        return None
    waited = time.monotonic() - t0
    if held is not None and waited > _WAIT_LOG_S:
        log.info("npu_cached: waited %.2fs for %s/%s (another process held its lock)", waited, store.kind, key[:12])
    return held


@contextlib.contextmanager
def try_key_lock(store: Store, key: str) -> Iterator[locks.KeyLock | bool]:
    """Hold the key's compile lock if nobody does: a KeyLock (or True when there is
    no lock file: nobody can hold it); False when it is held. Never blocks."""
    if store._write_blocker() is not None:
        yield True
        return
    try:
        dfd = store.backend.locks_fd(create=False)
    except (OSError, fs.CacheSecurityError):
        dfd = None
    if dfd is None:
        yield True
        return
    from . import store_locks as locks

    try:
        held = locks.try_acquire(dfd, store._lock_name(key))
        try:
            yield held
        finally:
            if isinstance(held, locks.KeyLock):
                held.release()
    finally:
        os.close(dfd)


def drop_lock_file(store: Store, key: str) -> None:
    """Delete the key's lock file if nobody holds it (its entry is gone)."""
    with contextlib.suppress(OSError), store._try_key_lock(key) as held:
        if hasattr(held, "unlink"):  # a KeyLock
            held.unlink()


def remove(store: Store, key: str) -> bool:
    """Unpublish then delete an entry (and its idle lock file); False if absent
    or it cannot be removed (a fault)."""
    store.entry_path(key)
    if store.backend.identity(store.kind, key) is None:
        return False
    blocker = store._write_blocker()
    if blocker is not None:
        store._fault(blocker, f"remove the cache entry {store.kind}/{key[:12]}")
        return False
    fds = store.backend.entry_fd(store.kind, key)  # refuses a symlink / foreign entry
    if fds is not None:
        for fd in fds:
            os.close(fd)
    try:
        removed = store.backend.remove(store.kind, key)
    except OSError as exc:
        store._fault(exc, f"remove the cache entry {store.kind}/{key[:12]}")
        return False
    if removed:
        store._drop_lock_file(key)
    return removed


def remove_if_idle(store: Store, key: str) -> bool:
    """Remove ``key`` unless it is being read (a reader's shared flock on the
    entry) or compiled (its lock is held). For pruning: never blocks."""
    fds = store.backend.entry_fd(store.kind, key)
    if fds is None:
        return False
    kfd, fd = fds
    try:
        if not _flock(fd, (fcntl.LOCK_EX | fcntl.LOCK_NB) if fcntl else 0):
            return False
        st = os.fstat(fd)
        with store._try_key_lock(key) as held:
            if held is False:
                return False
            try:
                removed = store.backend.unpublish(store.kind, key, (st.st_dev, st.st_ino))
            except OSError as exc:
                store._fault(exc, f"remove the cache entry {store.kind}/{key[:12]}")
                return False
            if removed and hasattr(held, "unlink"):  # a KeyLock
                held.unlink()
            return removed
    finally:
        os.close(fd)
        os.close(kfd)


def sweep(store: Store, max_age_s: float = 3600.0) -> int:
    """Delete leftovers of writers that died (``.tmp-*`` / ``.trash-*`` dirs
    older than ``max_age_s``). Never an entry. Returns how many."""
    try:
        return store.backend.sweep(store.kind, max_age_s)
    except (OSError, fs.CacheSecurityError):
        return 0
