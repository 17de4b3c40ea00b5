"""The on-disk store: one facade, :class:`Store`, over a storage backend.

Modules: ``store_layout`` (names, entries, the bounded manifest parse),
``store_backend`` (the backend protocol and the local-directory backend: root
fd, atomic publish, verification), ``store_faults`` (faults counted, warned once,
never raised), ``store_locks`` (bounded per-key compile locks that name their
holder). This module decides: what a broken entry becomes (quarantine, or only a
report on a read-only dir), when last-used is refreshed, how a fault degrades.

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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from . import fs_security as fs
from . import store_backend as backend_mod
from .fs_security import fcntl  # noqa: F401
from .fs_security import flock as _flock  # noqa: F401
from .logs import log, warn_once
from .stats import record
from .store_backend import KILL_STAGES, LocalDir, StorageBackend  # noqa: F401  (re-exported)
from .store_faults import _UNWRITABLE, report, write_blocker  # noqa: F401
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


class Store:
    """Entries of one kind (``graphs`` or ``programs``) under a cache root.

    Return conventions (callers rely on them; none raises for a storage fault):
    :meth:`load` -> Entry or None (miss, broken entry set aside, or fault);
    :meth:`save` / :meth:`replace` -> the entry path, or None when nothing was
    published; :meth:`remove` -> whether it removed the entry. Only
    :class:`~torchair_cached_backend.fs_security.CacheSecurityError` (a foreign
    owner, a symlink, a group/other-writable root) is raised: that cache dir must
    not be used at all.
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
        report(self.root, exc, doing, writing=writing, lock=lock)

    def _write_blocker(self) -> OSError | None:
        return write_blocker(self.root, self.dir)

    def writable(self) -> bool:
        """Whether this store may write (checked without writing anything)."""
        return self._write_blocker() is None

    def prepare(self, *, quiet: bool = False) -> bool:
        """Create the store's directories and CACHEDIR.TAG before a write.

        False when the cache dir cannot be written; the fault is counted and
        warned about unless ``quiet`` (a later write will report it)."""
        if self._ready and backend_mod.root_fd(self.root, create=False) is not None:
            return True
        blocker = self._write_blocker()
        if blocker is not None:
            if not quiet:
                self._fault(blocker, "write to the cache")
            return False
        try:
            kfd = self.backend.kind_fd(self.kind, create=True)
            if kfd is not None:
                os.close(kfd)
            self.backend.ensure_tag()
        except fs.CacheSecurityError:
            raise
        except OSError as exc:
            self._fault(exc, f"create the cache dir {self.dir}")
            return False
        self._ready = True
        return True

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
        fds = self.backend.entry_fd(self.kind, key)
        if fds is None:
            return None
        kfd, entry_fd = fds
        try:
            _flock(entry_fd, fcntl.LOCK_SH if fcntl else 0)  # prune skips entries being read
            st = os.fstat(entry_fd)
            try:
                manifest, files = self.backend.verify_at(entry_fd, key)
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

    # -- write ----------------------------------------------------------
    def save(self, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str | None:
        """Atomically publish an entry; if another process published ``key`` first, keep theirs.

        Returns the entry's path, or None when nothing was published: the cache
        dir cannot be written (read-only, full, no permission, I/O error; logged
        once, counted in ``stats().storage_faults``, never raised), or a broken
        entry of another writer is in the way. The caller then serves its result
        uncached. A cache dir that vanished (a cleanup job) is recreated once."""
        return self._publish(key, files, manifest, replace=False)

    def _publish(self, key: str, files: dict[str, bytes], manifest: dict[str, Any], *, replace: bool) -> str | None:
        final = self.entry_path(key)
        for name in files:
            if not valid_name(name):
                raise ValueError(f"invalid blob name {name!r}: a plain file name without '/' or a leading '.'")
        for attempt in (1, 2):
            if not self.prepare():
                return None
            try:
                if not self.backend.publish(self.kind, key, files, manifest, replace=replace):
                    return None
                from . import layers

                layers.published(self, key, files, manifest, replace=replace)  # the remote, if any
                from . import store_ledger as ledger  # the write side: never imported by a warm load

                ledger.add(self.backend, sum(map(len, files.values())) + 4096)  # blobs, manifest and dirs, roughly
                return final
            except fs.CacheSecurityError:
                raise
            except FileNotFoundError as exc:
                if attempt == 1:
                    self._ready = False  # the cache dir vanished under us: recreate it and try again
                    backend_mod.forget_root(self.root)
                    continue
                self._fault(exc, f"store the cache entry {self.kind}/{key[:12]}")
            except OSError as exc:
                self._fault(exc, f"store the cache entry {self.kind}/{key[:12]}")
            return None
        return None

    def replace(self, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str | None:
        """Publish an entry, replacing an existing one (programs grow as frames compile).

        The new entry is written completely (fsync'd) before the old one is swapped
        out (an atomic exchange where the filesystem has it), so a full disk or a
        crash leaves the old entry in place. Returns the path, or None when
        nothing was published (a storage fault, as :meth:`save`)."""
        final = self.entry_path(key)
        if self._holds(key, files, manifest):
            return final  # already published as is: no write (a warm start re-captures the same program)
        return self._publish(key, files, manifest, replace=True)

    def _holds(self, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> bool:
        """Whether the published entry ``key`` already has exactly these blobs and manifest fields."""
        import json

        try:
            existing = self.read_manifest(key)
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

    def quarantine(self, key: str, reason: str, *, identity: tuple[int, int] | None = None) -> None:
        """Move a broken entry aside (kept for inspection) and log why, once.

        ``identity`` names the directory found broken: an entry a writer has
        since swapped in is left alone. On a read-only cache dir nothing is
        moved; the entry is reported and skipped."""
        if self._write_blocker() is not None:
            warn_once(
                f"broken:{self.entry_path(key)}",
                "npu_cached: cache entry %s/%s is broken (%s); the cache dir %s is read-only, so it is skipped "
                "(not moved) and the graph is served uncached. Rebuild the cache where it is written.",
                self.kind, key[:12], reason, self.root,
            )
            return
        try:
            dst = self.backend.move_to_quarantine(self.kind, key, identity)
        except fs.CacheSecurityError:
            raise
        except OSError as exc:
            self._fault(exc, f"move the broken cache entry {self.kind}/{key[:12]} to quarantine/ ({reason})")
            return
        if dst is None:
            return  # gone, or another writer swapped in a new entry meanwhile
        record(quarantined=1)
        self._drop_lock_file(key)
        log.warning("cache entry %s/%s is broken (%s); moved to %s and rebuilding", self.kind, key[:12], reason, dst)

    # -- locks ----------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, key: str, timeout: float | None = None) -> Iterator[None]:
        """Cross-process lock per key: one process compiles, the others wait and load.

        An flock: it dies with its process, so a lock left by a killed process
        never blocks. Waiting is bounded by ``timeout`` (default: option
        ``lock_timeout`` / ``$TORCHAIR_CACHE_LOCK_TIMEOUT``, else 600 s); the waiter
        names the holder after 2 s, and on timeout the block runs without the
        lock. It degrades to no lock (warned once, counted) where the lock file
        cannot be created: a read-only dir gets no lock file at all. With a remote
        the remote's lease lock is held inside it (``layers.fleet_lock``)."""
        wait = default_lock_timeout() if timeout is None else timeout
        held = self._acquire(key, wait)
        try:
            from . import layers

            with layers.fleet_lock(self, key, wait):  # one node of a fleet compiles (a remote, if any)
                yield
        finally:
            if held is not None:
                with contextlib.suppress(OSError):
                    held.release()

    def _acquire(self, key: str, timeout: float) -> locks.KeyLock | None:
        if not self.prepare(quiet=True):
            return None  # read-only: the save that follows reports it
        from . import store_locks as locks  # compiling only: never imported by a warm load

        path = self._lock_path(key)
        t0 = time.monotonic()
        try:
            dfd = self.backend.locks_fd(create=True)
            assert dfd is not None
            try:
                held = locks.acquire(dfd, self._lock_name(key), timeout=timeout, what=f"{self.kind}/{key[:12]} in {self.root}")
            finally:
                os.close(dfd)
        except fs.CacheSecurityError:
            raise
        except OSError as exc:
            self._fault(
                exc,
                f"create the lock file {path} (compiles of one graph are not coordinated across processes meanwhile)",
                lock=True,
            )
            return None
        waited = time.monotonic() - t0
        if held is not None and waited > _WAIT_LOG_S:
            log.info("npu_cached: waited %.2fs for %s/%s (another process held its lock)", waited, self.kind, key[:12])
        return held

    @contextlib.contextmanager
    def _try_key_lock(self, key: str) -> Iterator[locks.KeyLock | bool]:
        """Hold the key's compile lock if nobody does: a KeyLock (or True when there is
        no lock file: nobody can hold it); False when it is held. Never blocks."""
        if self._write_blocker() is not None:
            yield True
            return
        try:
            dfd = self.backend.locks_fd(create=False)
        except (OSError, fs.CacheSecurityError):
            dfd = None
        if dfd is None:
            yield True
            return
        from . import store_locks as locks

        try:
            held = locks.try_acquire(dfd, self._lock_name(key))
            try:
                yield held
            finally:
                if isinstance(held, locks.KeyLock):
                    held.release()
        finally:
            os.close(dfd)

    def _drop_lock_file(self, key: str) -> None:
        """Delete the key's lock file if nobody holds it (its entry is gone)."""
        with contextlib.suppress(OSError), self._try_key_lock(key) as held:
            if hasattr(held, "unlink"):  # a KeyLock
                held.unlink()

    # -- remove ---------------------------------------------------------
    def remove(self, key: str) -> bool:
        """Unpublish then delete an entry (and its idle lock file); False if absent
        or it cannot be removed (a fault)."""
        self.entry_path(key)
        if self.backend.identity(self.kind, key) is None:
            return False
        blocker = self._write_blocker()
        if blocker is not None:
            self._fault(blocker, f"remove the cache entry {self.kind}/{key[:12]}")
            return False
        fds = self.backend.entry_fd(self.kind, key)  # refuses a symlink / foreign entry
        if fds is not None:
            for fd in fds:
                os.close(fd)
        try:
            removed = self.backend.remove(self.kind, key)
        except OSError as exc:
            self._fault(exc, f"remove the cache entry {self.kind}/{key[:12]}")
            return False
        if removed:
            self._drop_lock_file(key)
        return removed

    def remove_if_idle(self, key: str) -> bool:
        """Remove ``key`` unless it is being read (a reader's shared flock on the
        entry) or compiled (its lock is held). For pruning: never blocks."""
        fds = self.backend.entry_fd(self.kind, key)
        if fds is None:
            return False
        kfd, fd = fds
        try:
            if not _flock(fd, (fcntl.LOCK_EX | fcntl.LOCK_NB) if fcntl else 0):
                return False
            st = os.fstat(fd)
            with self._try_key_lock(key) as held:
                if held is False:
                    return False
                try:
                    removed = self.backend.unpublish(self.kind, key, (st.st_dev, st.st_ino))
                except OSError as exc:
                    self._fault(exc, f"remove the cache entry {self.kind}/{key[:12]}")
                    return False
                if removed and hasattr(held, "unlink"):  # a KeyLock
                    held.unlink()
                return removed
        finally:
            os.close(fd)
            os.close(kfd)

    def keys(self) -> list[str]:
        try:
            return self.backend.keys(self.kind)
        except fs.CacheSecurityError:
            raise
        except OSError as exc:
            self._fault(exc, f"list the cache dir {self.dir}")
            return []

    def sweep(self, max_age_s: float = 3600.0) -> int:
        """Delete leftovers of writers that died (``.tmp-*`` / ``.trash-*`` dirs
        older than ``max_age_s``). Never an entry. Returns how many."""
        try:
            return self.backend.sweep(self.kind, max_age_s)
        except (OSError, fs.CacheSecurityError):
            return 0
