"""The on-disk store: one directory per entry, a JSON manifest plus blobs.

Writes go to a temporary directory that is renamed into place, so a reader
sees a whole entry or none, and a crash mid-write loses nothing that was
already cached. Every load verifies every blob's sha256 through directory fds
opened once: no level of an entry may be a symlink, a path is never taken from
a manifest (blob names are plain names checked by us), and a reader racing a
writer that swaps the entry retries instead of blaming the new entry. A broken
entry is moved to ``quarantine/`` (never deleted, never run) and reported once.

Storage faults never fail a caller. A read that hits an OS error is a miss; a
write that cannot happen (read-only or full filesystem, no permission, I/O
error, a vanished dir, a lock file that cannot be created) publishes nothing
and returns None. Each cause is logged once with its fix and counted in
``stats().storage_faults``. A read-only cache dir serves its entries without a
single write: no lock files, no last-used updates, no quarantine moves.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import Any

from . import fs_security as fs
from .logs import log, warn_once
from .stats import record

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

MANIFEST = "manifest.json"
FILES_DIR = "files"
TAG = "CACHEDIR.TAG"
LOCKS_DIR = "locks"
QUARANTINE_DIR = "quarantine"
KINDS = ("graphs", "programs")
_TAG_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This directory is a torchair_cached_backend compile cache.\n"
    "# See https://bford.info/cachedir/ and `python -m torchair_cached_backend --help`.\n"
)
#: last_used is rewritten at most this often, so hits stay read-only in steady state
_TOUCH_INTERVAL_S = 3600.0
#: a reader that finds an entry swapped under it (a concurrent replace) reads again this often
_READ_ATTEMPTS = 5
#: a lock wait longer than this is logged (another process was compiling the graph)
_WAIT_LOG_S = 0.05

#: roots a write failed on for good (read-only filesystem, no permission): never tried again
_UNWRITABLE: dict[str, OSError] = {}

#: test-only fault injection: SIGKILL this process at a stage of save() (tests/test_concurrency.py)
_KILL_AT = os.environ.get("TORCHAIR_CACHE_TEST_KILL_AT") or None
KILL_STAGES = ("between_blobs", "after_manifest", "before_rename", "after_rename")


class BrokenEntry(Exception):
    """An entry failed verification; the message says which check.

    ``identity`` is the (st_dev, st_ino) of the entry directory that was read,
    so a caller can tell a broken entry from one a writer replaced meanwhile."""

    identity: tuple[int, int] | None = None


def valid_name(name: object) -> bool:
    """Whether ``name`` can be one path component of an entry: no separator, not
    absolute, not ``.``/``..``, not hidden (temporary and trash dirs are)."""
    return (
        isinstance(name, str)
        and bool(name)
        and not name.startswith(".")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


class Entry:
    """A verified entry: its manifest and blobs (a plain class: this is the warm path)."""

    __slots__ = ("key", "path", "manifest", "files")

    def __init__(self, key: str, path: str, manifest: dict[str, Any], files: dict[str, bytes]) -> None:
        self.key = key
        self.path = path
        self.manifest = manifest
        self.files = files

    @property
    def files_dir(self) -> str:
        return os.path.join(self.path, FILES_DIR)

    def path_of(self, name: str) -> str:
        """The on-disk path of blob ``name``, checked against its sha256 by this load.

        Only names in the entry's checksummed file list are accepted: nothing else
        may be opened, exec'd or dlopened (a path taken from ``meta`` could point
        anywhere, e.g. an absolute ``.so`` outside the cache)."""
        if name not in self.files:
            raise BrokenEntry(
                f"cache entry {self.key[:12]} has no checksummed file {name!r}; refusing to load it"
            )
        return os.path.join(self.path, FILES_DIR, name)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _parse_manifest(raw: bytes) -> dict[str, Any]:
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise BrokenEntry(f"manifest.json is not valid JSON ({exc}); truncated?") from None
    if not isinstance(manifest, dict):
        raise BrokenEntry("manifest.json does not hold a JSON object")
    return manifest


def _flock(fd: int, operation: int) -> bool:
    """flock ``fd``; False only when a non-blocking request finds it held. A
    filesystem without flock counts as unlocked (never blocks, never fails)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, operation)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def _advice(exc: OSError, root: str) -> str:
    """What a storage fault means for the user, and the fix."""
    code = exc.errno
    if code == errno.EROFS:
        return (
            f"the cache dir {root} is on a read-only filesystem: cached entries are still served, but nothing new "
            "is cached (graphs compile and run uncached). Point cache_dir / TORCHAIR_CACHE_HOME at a writable dir, "
            "or fill the cache at image build time (`torchair-cache prebuild`, `pack`, `unpack`)"
        )
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return (
            f"the filesystem of the cache dir {root} is full ({exc.strerror}): graphs compile and run uncached. "
            f"Free space, bound the cache (option max_size, or `torchair-cache prune {root} --max-size 2GB`), "
            "or point cache_dir at a larger disk"
        )
    if code in (errno.EACCES, errno.EPERM):
        return (
            f"no permission to write the cache dir {root} ({exc.strerror}): cached entries are still served, but "
            "nothing new is cached. Make it writable by this user (chmod u+rwx) or point cache_dir at a dir you can write"
        )
    if code == errno.EIO:
        return (
            f"I/O error in the cache dir {root} ({exc}): the cache is skipped and the graph is served uncached. "
            f"Check the disk (dmesg); `torchair-cache validate {root}` re-checks every entry"
        )
    if code == errno.ENOENT:
        return (
            f"the cache dir {root} vanished while in use (removed by a cleanup job?) and could not be recreated: "
            "the graph is served uncached"
        )
    return f"{type(exc).__name__}: {exc}; the graph is served uncached"


class Store:
    """Entries of one kind (``graphs`` or ``programs``) under a cache root.

    Return conventions (callers rely on them; none raises for a storage fault):
    :meth:`load` -> Entry or None (miss, broken entry set aside, or fault);
    :meth:`save` / :meth:`replace` -> the entry path, or None when nothing was
    published; :meth:`remove` -> whether it removed the entry. Only
    :class:`~torchair_cached_backend.fs_security.CacheSecurityError` (a foreign
    owner, a symlink) is raised: that cache dir must not be used at all.
    """

    def __init__(self, root: str, kind: str) -> None:
        self.root = os.path.abspath(root)
        self.kind = kind
        self.dir = os.path.join(self.root, kind)
        self._ready = False

    def __repr__(self) -> str:
        return f"Store({self.root!r}, {self.kind!r})"

    # -- layout ---------------------------------------------------------
    def entry_path(self, key: str) -> str:
        if not valid_name(key):
            raise ValueError(f"invalid cache key {key!r}")
        return os.path.join(self.dir, key)

    # -- storage faults -------------------------------------------------
    def _fault(self, exc: OSError, doing: str, *, writing: bool = True, lock: bool = False) -> None:
        """Count a storage fault and warn once per cause and filesystem (a lock that
        cannot be created is its own cause: it costs coordination, not caching)."""
        record(storage_faults=1)
        if writing and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            _UNWRITABLE.setdefault(self.root, exc)
        try:
            device = os.stat(_nearest_existing(self.dir)).st_dev
        except OSError:
            device = -1
        cause = f"storage:{exc.errno}:{'lock' if lock else ''}:{device}"
        warn_once(cause, "npu_cached: could not %s: %s.", doing, _advice(exc, self.root))

    def _write_blocker(self) -> OSError | None:
        """Why this store cannot be written, found without writing (a read-only
        filesystem, no write permission), or None."""
        known = _UNWRITABLE.get(self.root)
        if known is not None:
            return known
        probe = _nearest_existing(self.dir)
        try:
            if os.statvfs(probe).f_flag & getattr(os, "ST_RDONLY", 1):
                return OSError(errno.EROFS, os.strerror(errno.EROFS), probe)
            if not os.access(probe, os.W_OK | os.X_OK):
                return PermissionError(errno.EACCES, os.strerror(errno.EACCES), probe)
        except OSError:
            return None
        return None

    def writable(self) -> bool:
        """Whether this store may write (checked without writing anything)."""
        return self._write_blocker() is None

    def prepare(self, *, quiet: bool = False) -> bool:
        """Create the store's directories and CACHEDIR.TAG before a write.

        False when the cache dir cannot be written; the fault is counted and
        warned about unless ``quiet`` (a later write will report it)."""
        if self._ready:
            return True
        blocker = self._write_blocker()
        if blocker is not None:
            if not quiet:
                self._fault(blocker, "write to the cache")
            return False
        try:
            fs.ensure_dir(self.dir, root=self.root)
            tag = os.path.join(self.root, TAG)
            if not os.path.lexists(tag):
                with contextlib.suppress(FileExistsError):
                    fs.write_private(tag, _TAG_TEXT.encode())
        except fs.CacheSecurityError:
            raise
        except OSError as exc:
            self._fault(exc, f"create the cache dir {self.dir}")
            return False
        self._ready = True
        return True

    # -- read -----------------------------------------------------------
    def exists(self, key: str) -> bool:
        return os.path.isfile(os.path.join(self.entry_path(key), MANIFEST))

    def _open_entry(self, key: str) -> int | None:
        """An fd of the entry directory (root, kind dir and entry checked: real
        directories we own), or None if there is no such entry."""
        self.entry_path(key)  # validates the key
        fds: list[int] = []
        try:
            for name in (self.root, self.kind, key):
                try:
                    fds.append(fs.open_dir(name, dir_fd=fds[-1] if fds else None, root=self.root))
                except FileNotFoundError:
                    return None
            return fds.pop()
        finally:
            for fd in fds:
                os.close(fd)

    def _read(self, key: str, *, touch: bool) -> Entry | None:
        """Read and verify ``key`` through directory fds. Raises BrokenEntry (with
        the entry's identity), CacheSecurityError, or OSError (a storage fault)."""
        entry_fd = self._open_entry(key)
        if entry_fd is None:
            return None
        try:
            _flock(entry_fd, fcntl.LOCK_SH if fcntl else 0)  # prune skips entries being read
            st = os.fstat(entry_fd)
            try:
                manifest, files = self._verify_at(entry_fd, key)
            except BrokenEntry as exc:
                exc.identity = (st.st_dev, st.st_ino)
                raise
            if touch:
                self._touch(entry_fd, manifest)
            return Entry(key=key, path=os.path.join(self.dir, key), manifest=manifest, files=files)
        finally:
            os.close(entry_fd)  # releases the shared flock

    def _verify_at(self, entry_fd: int, key: str) -> tuple[dict[str, Any], dict[str, bytes]]:
        try:
            manifest = _parse_manifest(fs.read_at(entry_fd, MANIFEST, root=self.root))
        except FileNotFoundError:
            raise BrokenEntry("manifest.json is missing") from None
        if manifest.get("key") != key:
            raise BrokenEntry(f"manifest key {manifest.get('key')!r} does not match its directory {key!r}")
        infos = manifest.get("files", {})
        if not isinstance(infos, dict):
            raise BrokenEntry("manifest 'files' is not a mapping")
        files: dict[str, bytes] = {}
        if not infos:
            return manifest, files
        try:
            files_fd = fs.open_dir(FILES_DIR, dir_fd=entry_fd, root=self.root)
        except FileNotFoundError:
            raise BrokenEntry("files/ is missing") from None
        try:
            for name, info in infos.items():
                if not valid_name(name):
                    raise BrokenEntry(f"manifest names blob {name!r}, which is not a plain file name (tampered?)")
                try:
                    size, digest = int(info["size"]), str(info["sha256"])
                except (KeyError, TypeError, ValueError):
                    raise BrokenEntry(f"manifest record of blob {name!r} is malformed") from None
                try:
                    data = fs.read_at(files_fd, name, root=self.root)
                except FileNotFoundError:
                    raise BrokenEntry(f"blob {name!r} is missing") from None
                if len(data) != size:
                    raise BrokenEntry(f"blob {name!r} is {len(data)} bytes, manifest says {size} (truncated?)")
                if _sha256(data) != digest:
                    raise BrokenEntry(f"blob {name!r} fails its sha256 checksum (corrupted)")
                files[name] = data
        finally:
            os.close(files_fd)
        return manifest, files

    def _same_dir(self, key: str, identity: tuple[int, int] | None) -> bool:
        """Whether the entry at ``key`` is still the directory we read."""
        if identity is None:
            return True
        try:
            st = os.lstat(self.entry_path(key))
        except FileNotFoundError:
            return False
        except OSError:
            return True
        return (st.st_dev, st.st_ino) == identity

    def load(self, key: str) -> Entry | None:
        """The verified entry, or None: a miss, a broken entry (moved to
        ``quarantine/``; on a read-only dir only reported), or a storage fault
        (counted and warned once). Raises only CacheSecurityError."""
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
        """Like :meth:`load` but read-only: raises BrokenEntry instead of setting
        the entry aside, and never updates last-used (``validate``, ``pack``)."""
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
        entry_fd = self._open_entry(key)
        if entry_fd is None:
            return None
        try:
            try:
                return _parse_manifest(fs.read_at(entry_fd, MANIFEST, root=self.root))
            except FileNotFoundError:
                raise BrokenEntry("manifest.json is missing") from None
        finally:
            os.close(entry_fd)

    def _touch(self, entry_fd: int, manifest: dict[str, Any]) -> None:
        """Record last use (for LRU pruning), at most hourly and never on a
        read-only cache dir. Written through the entry's fd, so it can never land
        in an entry a writer swapped in meanwhile."""
        now = time.time()
        try:
            last = float(manifest.get("last_used", 0))
        except (TypeError, ValueError):
            last = 0.0
        if now - last < _TOUCH_INTERVAL_S or self._write_blocker() is not None:
            return
        manifest["last_used"] = now
        tmp = f".{MANIFEST}.{uuid.uuid4().hex[:8]}"
        with contextlib.suppress(OSError):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), fs.FILE_MODE,
                         dir_fd=entry_fd)
            try:
                os.write(fd, json.dumps(manifest, indent=1, default=str).encode())
            finally:
                os.close(fd)
            os.replace(tmp, MANIFEST, src_dir_fd=entry_fd, dst_dir_fd=entry_fd)

    # -- write ----------------------------------------------------------
    def save(self, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str | None:
        """Atomically publish an entry; if another process published ``key`` first, keep theirs.

        Returns the entry's path, or None when nothing was published: the cache
        dir cannot be written (read-only, full, no permission, I/O error; logged
        once, counted in ``stats().storage_faults``, never raised), or a broken
        entry of another writer is in the way. The caller then serves its result
        uncached. A cache dir that vanished (a cleanup job) is recreated once."""
        final = self.entry_path(key)
        for name in files:
            if not valid_name(name):
                raise ValueError(f"invalid blob name {name!r}: a plain file name without '/' or a leading '.'")
        for attempt in (1, 2):
            if not self.prepare():
                return None
            try:
                return self._publish(key, final, files, manifest)
            except fs.CacheSecurityError:
                raise
            except FileNotFoundError as exc:
                if attempt == 1:
                    self._ready = False  # the cache dir vanished under us: recreate it and try again
                    continue
                self._fault(exc, f"store the cache entry {self.kind}/{key[:12]}")
            except OSError as exc:
                self._fault(exc, f"store the cache entry {self.kind}/{key[:12]}")
            return None
        return None

    def _publish(self, key: str, final: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str | None:
        tmp = os.path.join(self.dir, f".tmp-{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(tmp, fs.DIR_MODE)
        try:
            os.mkdir(os.path.join(tmp, FILES_DIR), fs.DIR_MODE)
            infos = {}
            for i, (name, data) in enumerate(files.items()):
                if _KILL_AT and i == 1:
                    _kill_point("between_blobs")
                fs.write_private(os.path.join(tmp, FILES_DIR, name), data)
                infos[name] = {"size": len(data), "sha256": _sha256(data)}
            now = time.time()
            full = dict(manifest, key=key, kind=self.kind, files=infos, created=now, last_used=now)
            fs.write_private(os.path.join(tmp, MANIFEST), json.dumps(full, indent=1, default=str).encode())
            if _KILL_AT:
                _kill_point("after_manifest")
            if os.path.lexists(final):
                return final if self.exists(key) else None
            if _KILL_AT:
                _kill_point("before_rename")
            try:
                os.rename(tmp, final)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):  # another writer won the race: keep theirs
                    return final if self.exists(key) else None
                raise
            if _KILL_AT:
                _kill_point("after_rename")
            _fsync_dir(self.dir)
            return final
        finally:
            if os.path.lexists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)

    def replace(self, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str | None:
        """Publish an entry, replacing an existing one (programs grow as frames compile).

        The old entry is renamed away before the new one is renamed in, so a
        reader sees the old entry, no entry, or the new one, never a mix (and a
        reader caught mid-swap reads again). Returns the path, or None when
        nothing was published (a storage fault, as :meth:`save`)."""
        final = self.entry_path(key)
        if self._holds(key, files, manifest):
            return final  # already published as is: no write (a warm start re-captures the same program)
        if not self.prepare():
            return None
        if os.path.lexists(final) and not self.remove(key) and os.path.lexists(final):
            return None
        path = self.save(key, files, manifest)
        if path is None and self.exists(key):  # lost a race with another writer: theirs is as good as ours
            return final
        return path

    def _holds(self, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> bool:
        """Whether the published entry ``key`` already has exactly these blobs and manifest fields."""
        try:
            existing = self.read_manifest(key)
        except (BrokenEntry, OSError):
            return False
        if existing is None:
            return False
        stored = existing.get("files")
        if not isinstance(stored, dict) or set(stored) != set(files):
            return False
        if any(stored[name].get("sha256") != _sha256(data) for name, data in files.items()):
            return False
        wanted = json.loads(json.dumps(manifest, default=str))
        return all(existing.get(k) == v for k, v in wanted.items())

    def quarantine(self, key: str, reason: str, *, identity: tuple[int, int] | None = None) -> None:
        """Move a broken entry aside (kept for inspection) and log why, once.

        ``identity`` names the directory found broken: an entry a writer has
        since swapped in is left alone. On a read-only cache dir nothing is
        moved; the entry is reported and skipped."""
        src = self.entry_path(key)
        if self._write_blocker() is not None:
            warn_once(
                f"broken:{src}",
                "npu_cached: cache entry %s/%s is broken (%s); the cache dir %s is read-only, so it is skipped "
                "(not moved) and the graph is served uncached. Rebuild the cache where it is written.",
                self.kind, key[:12], reason, self.root,
            )
            return
        if not self._same_dir(key, identity):
            return
        dst = ""
        try:
            qdir = fs.ensure_dir(os.path.join(self.root, QUARANTINE_DIR), root=self.root)
            dst = os.path.join(qdir, f"{self.kind}-{key[:32]}-{int(time.time())}-{uuid.uuid4().hex[:6]}")
            os.rename(src, dst)
        except FileNotFoundError:
            return  # another process moved it already
        except fs.CacheSecurityError:
            raise
        except OSError as exc:
            self._fault(exc, f"move the broken cache entry {self.kind}/{key[:12]} to quarantine/ ({reason})")
            return
        record(quarantined=1)
        log.warning("cache entry %s/%s is broken (%s); moved to %s and rebuilding", self.kind, key[:12], reason, dst)

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float = 3600.0) -> Iterator[None]:
        """Cross-process lock per key: one process compiles, the others wait and load.

        An flock: it dies with its process, so a lock left by a killed process
        never blocks. It degrades to no lock (warned once, counted) where the
        lock file cannot be created: a read-only dir gets no lock file at all."""
        held = self._acquire(key, timeout)
        try:
            yield
        finally:
            if held is not None:
                with contextlib.suppress(OSError):
                    held.release()

    def _lock_path(self, key: str) -> str:
        return os.path.join(self.root, LOCKS_DIR, f"{self.kind}-{key[:32]}.lock")

    def _acquire(self, key: str, timeout: float) -> Any:
        if not self.prepare(quiet=True):
            return None  # read-only: the save that follows reports it
        from filelock import FileLock, Timeout

        path = self._lock_path(key)
        t0 = time.monotonic()
        try:
            fs.ensure_dir(os.path.dirname(path), root=self.root)
            held = FileLock(path, timeout=timeout, mode=fs.FILE_MODE)
            held.acquire()
        except fs.CacheSecurityError:
            raise
        except Timeout:
            warn_once(f"lock-timeout:{path}", "npu_cached: gave up waiting %.0fs for %s; compiling without it", timeout, path)
            return None
        except OSError as exc:
            self._fault(
                exc,
                f"create the lock file {path} (compiles of one graph are not coordinated across processes meanwhile)",
                lock=True,
            )
            return None
        waited = time.monotonic() - t0
        if waited > _WAIT_LOG_S:
            log.info("npu_cached: waited %.2fs for %s/%s (another process held its lock)", waited, self.kind, key[:12])
        return held

    def remove(self, key: str) -> bool:
        """Unpublish then delete an entry; False if absent or it cannot be removed (a fault)."""
        path = self.entry_path(key)
        if not os.path.lexists(path):
            return False
        fs.check_dir(path, root=self.root)
        blocker = self._write_blocker()
        if blocker is not None:
            self._fault(blocker, f"remove the cache entry {self.kind}/{key[:12]}")
            return False
        return self._unpublish(path)

    def _unpublish(self, path: str) -> bool:
        trash = os.path.join(self.dir, f".trash-{os.path.basename(path)[:16]}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, trash)  # atomic unpublish first, then delete
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._fault(exc, f"remove the cache entry {self.kind}/{os.path.basename(path)[:12]}")
            return False
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def remove_if_idle(self, key: str) -> bool:
        """Remove ``key`` unless it is being read (a reader's shared flock on the
        entry) or compiled (its lock is held). For pruning: never blocks."""
        try:
            fd = fs.open_dir(self.entry_path(key), root=self.root)
        except FileNotFoundError:
            return False
        try:
            if not _flock(fd, (fcntl.LOCK_EX | fcntl.LOCK_NB) if fcntl else 0):
                return False
            if not self._same_dir(key, (os.fstat(fd).st_dev, os.fstat(fd).st_ino)):
                return False
            with self._try_key_lock(key) as free:
                if not free:
                    return False
                return self._unpublish(self.entry_path(key))
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _try_key_lock(self, key: str) -> Iterator[bool]:
        """Hold the key's compile lock if nobody does (no lock dir: nobody can)."""
        path = self._lock_path(key)
        if not os.path.isdir(os.path.dirname(path)) or self._write_blocker() is not None:
            yield True
            return
        from filelock import FileLock, Timeout

        held = FileLock(path, timeout=0, mode=fs.FILE_MODE)
        try:
            held.acquire()
        except Timeout:
            yield False
            return
        except OSError:
            yield True
            return
        try:
            yield True
        finally:
            with contextlib.suppress(OSError):
                held.release()

    def keys(self) -> list[str]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._fault(exc, f"list the cache dir {self.dir}")
            return []
        return sorted(n for n in names if valid_name(n))

    def sweep(self, max_age_s: float = 3600.0) -> int:
        """Delete leftovers of writers that died (``.tmp-*`` / ``.trash-*`` dirs
        older than ``max_age_s``). Never an entry. Returns how many."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return 0
        now = time.time()
        removed = 0
        for name in names:
            if not name.startswith((".tmp-", ".trash-")):
                continue
            path = os.path.join(self.dir, name)
            try:
                if now - os.lstat(path).st_mtime < max_age_s:
                    continue
            except OSError:
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        return removed


def _nearest_existing(path: str) -> str:
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _kill_point(stage: str) -> None:
    """Test-only: ``TORCHAIR_CACHE_TEST_KILL_AT=<stage>`` SIGKILLs the process at
    that stage of a save, to prove a crash never leaves a partial entry."""
    if _KILL_AT == stage:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
