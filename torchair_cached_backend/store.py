"""The on-disk store: one facade, :class:`Store`, over a storage backend.

Modules: ``store_layout`` (names, entries, the bounded manifest parse),
``store_backend`` (the backend protocol and the local-directory backend: root
fd, atomic publish, verification), ``store_faults`` (faults counted, warned once,
never raised), ``store_locks`` (bounded per-key compile locks that name their
holder), ``store_write`` / ``store_backend_write`` (the write sides: publish, replace,
quarantine, locks, remove, sweep; imported by the first write, so a warm load, which
only reads, never imports them). This module decides: what a broken entry becomes
(quarantine, or only a report on a read-only dir), when last-used is refreshed, how a
fault degrades.

Writes go to a temporary directory that is renamed into place, so a reader
sees a whole entry or none, and a crash mid-write loses nothing that was
already cached. Every load verifies every blob's sha256 through directory fds
from the root down (no level may be a symlink); the verified bytes are what
callers load. A broken entry is moved to ``quarantine/`` (never deleted, never
run) and reported once. Storage faults never fail a caller; a read-only cache
dir serves its entries without a single write.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any

from . import fs_security as fs
from . import store_backend as backend_mod
from .fs_security import fcntl  # noqa: F401
from .fs_security import flock as _flock  # noqa: F401
from .store_backend import KILL_STAGES, LocalDir  # noqa: F401  (re-exported)
from .store_layout import (  # noqa: F401  (the public names callers import from here)
    FILES_DIR,
    KINDS,
    LOCKS_DIR,
    MANIFEST,
    QUARANTINE_DIR,
    TAG,
    BrokenEntry,
    Entry,
    loads_bounded,
    parse_manifest,
    sha256,
    valid_name,
)

if TYPE_CHECKING:
    from . import store_locks as locks

#: last_used is rewritten at most this often, so hits stay read-only in steady state
_TOUCH_INTERVAL_S = 3600.0
#: a reader that finds an entry swapped under it (a concurrent replace) reads again this often
_READ_ATTEMPTS = 5
#: a lock wait longer than this is logged (another process was compiling the graph)
_WAIT_LOG_S = 0.05
LOCK_TIMEOUT_ENV = "TORCHAIR_CACHE_LOCK_TIMEOUT"
#: default bound of a lock wait: longer than a big graph's compile (GE compiles of LLM graphs take
#: minutes), short enough that a stopped holder costs a start minutes, not an hour
DEFAULT_LOCK_TIMEOUT_S = 600.0


def _writes() -> Any:
    """The write side of :class:`Store` (``store_write``)."""
    from . import store_write

    return store_write


class Store:
    """Entries of one kind (``graphs`` or ``programs``) under a cache root.

    Return conventions (callers rely on them; none raises for a storage fault):
    :meth:`load` -> Entry or None (miss, broken entry set aside, or fault);
    :meth:`save` / :meth:`replace` -> the entry path, or None when nothing was
    published; :meth:`remove` -> whether it removed the entry. Only
    :class:`~torchair_cached_backend.fs_security.CacheSecurityError` (a root or kind
    dir of another user, a symlink, a group/other-writable root) is raised: that cache
    dir must not be used at all. The same refusal inside one entry makes it a broken
    entry (:meth:`_planted`).
    """

    def __init__(self, root: str, kind: str, backend: LocalDir | None = None) -> None:
        self.root = os.path.abspath(root)
        self.kind = kind
        self.dir = os.path.join(self.root, kind)
        self.backend = backend if backend is not None else LocalDir(self.root)
        self._ready = False

    def __repr__(self) -> str:
        return f"Store({self.root!r}, {self.kind!r})"

    # -- layout ---------------------------------------------------------
    def entry_path(self, key: str) -> str:
        if not valid_name(key):
            raise ValueError(f"invalid cache key {key!r}")
        return os.path.join(self.dir, key)

    def _lock_name(self, key: str) -> str:
        return f"{self.kind}-{key[:32]}.lock"

    def _lock_path(self, key: str) -> str:
        return os.path.join(self.root, LOCKS_DIR, self._lock_name(key))

    # -- storage faults -------------------------------------------------
    def _fault(self, exc: OSError, doing: str, *, writing: bool = True, lock: bool = False) -> None:
        from .store_faults import report

        report(self.root, exc, doing, writing=writing, lock=lock)

    def _write_blocker(self) -> OSError | None:
        from .store_faults import write_blocker

        return write_blocker(self.root, self.dir)

    def writable(self) -> bool:
        """Whether this store may write (checked without writing anything)."""
        return self._write_blocker() is None

    # -- read -----------------------------------------------------------
    def exists(self, key: str) -> bool:
        self.entry_path(key)
        try:
            kfd = self.backend.kind_fd(self.kind)
        except OSError:  # CacheSecurityError included
            return False
        if kfd is None:
            return False
        try:
            return backend_mod._exists_at(kfd, key)
        finally:
            os.close(kfd)

    def _read(self, key: str, *, touch: bool) -> Entry | None:
        """Read and verify ``key`` through directory fds. Raises BrokenEntry (with
        the entry's identity), CacheSecurityError, or OSError (a storage fault)."""
        self.entry_path(key)  # validates the key
        try:
            fds = self.backend.entry_fd(self.kind, key)
        except fs.CacheSecurityError as exc:
            raise self._planted(exc) from None
        if fds is None:
            return None
        kfd, entry_fd = fds
        try:
            _flock(entry_fd, fcntl.LOCK_SH if fcntl else 0)  # prune skips entries being read
            st = os.fstat(entry_fd)
            try:
                manifest, files = self.backend.verify_at(entry_fd, key)
            except fs.CacheSecurityError as exc:
                planted = self._planted(exc)
                planted.identity = (st.st_dev, st.st_ino)
                raise planted from None
            except BrokenEntry as exc:
                exc.identity = (st.st_dev, st.st_ino)
                raise
            if touch:
                self._touch(entry_fd, manifest)
            for hook in backend_mod.AFTER_VERIFY:
                hook(self, key)
            return Entry(key=key, path=os.path.join(self.dir, key), manifest=manifest, files=files)
        finally:
            os.close(entry_fd)  # releases the shared flock
            os.close(kfd)

    def _planted(self, exc: fs.CacheSecurityError) -> BrokenEntry:
        """A refusal inside one entry (a symlink, a FIFO or a directory where a file belongs, an entry
        or file of another user) as a broken entry: never run, reported, set aside and rebuilt, so
        the user's call is served. A refusal of the root or of the kind dir (the cache dir itself is
        unsafe: another user's, writable by others, a symlink) is raised again from here: that
        cache dir must not be used at all, and the error names the fix."""
        kfd = self.backend.kind_fd(self.kind)  # raises the root's or the kind dir's own refusal
        if kfd is not None:
            os.close(kfd)
        return BrokenEntry(f"{exc} - never read, planted or foreign")

    def _same_dir(self, key: str, identity: tuple[int, int] | None) -> bool:
        """Whether the entry at ``key`` is still the directory we read."""
        if identity is None:
            return True
        try:
            return self.backend.identity(self.kind, key) == identity
        except (OSError, fs.CacheSecurityError):
            return True

    def load(self, key: str) -> Entry | None:
        """The verified entry, or None: a miss, a broken entry (moved to
        ``quarantine/``; on a read-only dir only reported), or a storage fault
        (counted and warned once). Raises only CacheSecurityError. A local miss
        asks the root's other layers (a read-only base, a remote: ``layers.py``)."""
        entry = self.load_local(key)
        if entry is None:
            from . import layers

            entry = layers.fill(self, key)
        return entry

    def load_local(self, key: str) -> Entry | None:
        """:meth:`load` from this root only."""
        for _ in range(_READ_ATTEMPTS):
            try:
                return self._read(key, touch=True)
            except fs.CacheSecurityError:
                raise
            except BrokenEntry as exc:
                if not self._same_dir(key, exc.identity):
                    time.sleep(0.002)  # a writer replaced or removed it while we read: read again
                    continue
                self.quarantine(key, str(exc), identity=exc.identity)
                return None
            except OSError as exc:
                self._fault(exc, f"read the cache entry {self.kind}/{key[:12]} in {self.root}", writing=False)
                return None
        return None

    def read_verified(self, key: str) -> Entry | None:
        """Like :meth:`load` but read-only: raises BrokenEntry (its ``identity`` names
        the directory read) instead of setting the entry aside, and never updates
        last-used (``validate``, ``pack``). None: no entry (or it kept changing)."""
        for _ in range(_READ_ATTEMPTS):
            try:
                return self._read(key, touch=False)
            except BrokenEntry as exc:
                if not self._same_dir(key, exc.identity):
                    continue
                raise
        return None

    def read_manifest(self, key: str) -> dict[str, Any] | None:
        """The entry's manifest (not its blobs), or None if there is no entry.
        Raises BrokenEntry for an unreadable manifest, OSError for a fault."""
        self.entry_path(key)
        return self.backend.read_manifest(self.kind, key)

    def _touch(self, entry_fd: int, manifest: dict[str, Any]) -> None:
        """Record last use (for LRU pruning), at most hourly and never on a
        read-only cache dir. Written through the entry's fd (a new file, its length
        checked, then renamed over the old), so it can never truncate a good
        manifest nor land in an entry a writer swapped in meanwhile."""
        now = time.time()
        last = manifest.get("last_used", 0)
        if now - last < _TOUCH_INTERVAL_S or self._write_blocker() is not None:
            return
        try:
            self.backend.rewrite_manifest(entry_fd, dict(manifest, last_used=now))
        except OSError as exc:
            self._fault(exc, f"refresh last-used of the cache entry {self.kind}/{str(manifest.get('key'))[:12]}")
            return
        manifest["last_used"] = now

    def keys(self) -> list[str]:
        try:
            return self.backend.keys(self.kind)
        except fs.CacheSecurityError:
            raise
        except OSError as exc:
            self._fault(exc, f"list the cache dir {self.dir}")
            return []

    # -- write, locks, remove (``store_write``: imported by the first write, never by a warm load) --
    def prepare(self, *, quiet: bool = False) -> bool:
        """Create the store's directories and CACHEDIR.TAG before a write (False: not writable)."""
        return _writes().prepare(self, quiet=quiet)

    def save(self, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str | None:
        """Atomically publish an entry; if another process published ``key`` first, keep theirs
        (``store_write.save``). The entry's path, or None when nothing was published."""
        return _writes().save(self, key, files, manifest)

    def _publish(self, key: str, files: dict[str, bytes], manifest: dict[str, Any], *, replace: bool) -> str | None:
        return _writes().publish(self, key, files, manifest, replace=replace)

    def replace(self, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str | None:
        """Publish an entry, replacing an existing one once the new one is durable
        (``store_write.replace``). The path, or None when nothing was published."""
        return _writes().replace(self, key, files, manifest)

    def _holds(self, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> bool:
        return _writes().holds(self, key, files, manifest)

    def quarantine(self, key: str, reason: str, *, identity: tuple[int, int] | None = None) -> None:
        """Move a broken entry aside (kept for inspection) and log why, once (``store_write.quarantine``)."""
        _writes().quarantine(self, key, reason, identity=identity)

    def lock(self, key: str, timeout: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Cross-process lock per key: one process compiles, the others wait and load
        (``store_write.lock``)."""
        return _writes().lock(self, key, timeout)

    def _acquire(self, key: str, timeout: float) -> locks.KeyLock | None:
        return _writes().acquire(self, key, timeout)

    def _try_key_lock(self, key: str) -> contextlib.AbstractContextManager[locks.KeyLock | bool]:
        return _writes().try_key_lock(self, key)

    def _drop_lock_file(self, key: str) -> None:
        _writes().drop_lock_file(self, key)

    def remove(self, key: str) -> bool:
        """Unpublish then delete an entry (and its idle lock file); False if absent or it cannot be removed."""
        return _writes().remove(self, key)

    def remove_if_idle(self, key: str) -> bool:
        """Remove ``key`` unless it is being read or compiled (``store_write.remove_if_idle``)."""
        return _writes().remove_if_idle(self, key)

    def sweep(self, max_age_s: float = 3600.0) -> int:
        """Delete leftovers of writers that died (``store_write.sweep``). Never an entry. Returns how many."""
        return _writes().sweep(self, max_age_s)


#: names callers import from here that live on the write side or with the faults: imported on first use
_LAZY = {"default_lock_timeout": "store_write", "_UNWRITABLE": "store_faults", "report": "store_faults",
         "write_blocker": "store_faults", "StorageBackend": "store_protocol"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
