"""GE's and torchair's run-time caches inside an entry: sealed after GE writes them,
verified before GE reads them.

GE (``ge_cache=True``: its compiled model, an ``.om`` it executes) and torchair (its
static kernels) write a directory of their own into a published entry at the graph's
first run (``<entry>/files/<cache>/``) and read it back by path in later processes.
Those bytes are executed, so they follow the entry's rule: only verified bytes run.

* **Seal** (:meth:`RuntimeCache.seal`): after the first run that wrote the directory
  returns, every file's relative path, size and sha256 go into
  ``<entry>/files/<cache>.seal.json`` (bound to the entry's key and the cache's name,
  with a digest of its own), written to a temporary name, fsync'd and renamed: a crash
  leaves the old seal or none, never one that lies.
* **Verify** (:func:`prepare`): before GE is pointed at the directory, every file is
  checked against the seal through directory fds that never follow a link. A missing,
  changed, extra, symlinked or foreign-owned file, a seal that fails its own checks, or
  no seal at all (GE died mid-write, an older version wrote it) sets the directory aside
  into ``<root>/quarantine/`` (reported once, counted in ``stats().runtime_caches_set_aside``;
  never deleted) and GE rebuilds it into a fresh one, sealed after its first run. The
  graph's entry itself stays in use.
* **Writers** hold an exclusive ``flock`` on the directory from its creation until it is
  sealed; another process that finds it so locked leaves it alone and points its GE at a
  private temporary directory instead, so no GE ever reads another's half-written model.
  Verifying takes the entry's ``files/`` directory's shared lock (processes that start
  together verify in parallel); setting aside, creating and sealing its exclusive one.

A process that verified the directory re-checks it (``stat`` only, no hashing) after the
first run and at exit: when GE added or rewrote files it is sealed again. Sealed caches
travel with their seal (``bundle.py``, ``remote.py``), verified again on arrival.

This module is the life of a cache in a process (prepare, first run, seal); the seal's
format and bytes are ``runtime_seal.py``, checking a directory against it
``runtime_verify.py``, locks and setting aside ``runtime_lock.py``, carrying caches in
bounded memory ``runtime_carry.py``, their state for the CLI ``runtime_status.py``. Their
public names are re-exported here.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from . import fs_security as fs
from .logs import log
from .runtime_lock import _LOCK_EX, _LOCK_SH, _drop_leftovers, _layout, _locked, _open_files_dir, set_aside
from .runtime_seal import (
    MAX_DEPTH,
    MAX_FILES,
    MAX_SEAL_BYTES,
    SEAL_FORMAT,
    SEAL_SUFFIX,
    SEAL_VERSION,
    SUBDIRS,
    SealMismatch,
    _read_seal,
    _read_seal_quiet,
    _write_seal,
    encode_seal,
    parse_seal,
    plain_name,
    seal_name,
    valid_rel,
)
from .runtime_verify import _digest_file, _lexists, _scan, _snapshot, check

__all__ = [
    "MAX_DEPTH", "MAX_FILES", "MAX_SEAL_BYTES", "SEAL_FORMAT", "SEAL_SUFFIX", "SEAL_VERSION", "SUBDIRS", "RuntimeCache",
    "SealMismatch", "check", "collect", "encode_seal", "install", "parse_seal", "plain_name", "prepare", "seal_name",
    "set_aside", "valid_rel",
]


# ---------------------------------------------------------------- a cache in this process
_ACTIVE: list[RuntimeCache] = []
_ACTIVE_LOCK = threading.Lock()


class RuntimeCache:
    """One run-time cache directory of one entry, as this process handed it to GE.

    ``writer``: this process created it (or rebuilt it) and holds its exclusive flock until
    the first run returns and it is sealed. Otherwise it was verified, and ``snapshot``
    (rel -> size, mtime, inode) tells whether GE changed it since."""

    __slots__ = ("files_dir", "subdir", "path", "key", "writer", "snapshot", "_lock_fd", "_sealed_once")

    def __init__(self, files_dir: str, subdir: str, key: str, *, writer: bool, lock_fd: int | None,
                 snapshot: dict[str, tuple[int, int, int]]) -> None:
        self.files_dir = files_dir
        self.subdir = subdir
        self.path = os.path.join(files_dir, subdir)
        self.key = key
        self.writer = writer
        self.snapshot = snapshot
        self._lock_fd = lock_fd
        self._sealed_once = False

    def after_run(self) -> None:
        """After a run that GE may have written in: seal (writer) or re-seal what changed. Never raises."""
        try:
            if self.writer or self._changed():
                self.seal()
        except Exception as exc:  # noqa: BLE001 - the user's call never fails over a seal
            log.warning("npu_cached: could not seal the run-time cache %s (%s); it is rebuilt at the next start",
                        self.path, exc)
        finally:
            self._release()

    def _changed(self) -> bool:
        try:
            fd = fs.open_dir(self.path, root=self.files_dir)
        except (OSError, fs.CacheSecurityError):
            return False  # gone (set aside by another process): nothing of ours to seal
        try:
            return _snapshot(_scan(fd)) != self.snapshot
        except SealMismatch:
            return False  # a symlink or a foreign file appeared: left unsealed, set aside at the next start
        finally:
            os.close(fd)

    def seal(self) -> bool:
        """Seal the directory as it is now (atomically); False when it cannot be sealed."""
        files_fd = _open_files_dir(self.files_dir)
        try:
            fs.flock(files_fd, _LOCK_EX)
            try:
                fd = fs.open_dir(self.subdir, dir_fd=files_fd, root=self.files_dir)
            except FileNotFoundError:
                return False
            try:
                if self._lock_fd is not None:
                    a, b = os.fstat(fd), os.fstat(self._lock_fd)
                    if (a.st_ino, a.st_dev) != (b.st_ino, b.st_dev):
                        return False  # not the directory we created
                try:
                    found = _scan(fd)
                    files = {rel: (st.st_size, _digest_file(fd, rel, st)) for rel, st in found.items()}
                except SealMismatch as exc:
                    log.warning("npu_cached: the run-time cache %s is left unsealed (%s): it is set aside and "
                                "rebuilt at the next start", self.path, exc)
                    return False
            finally:
                os.close(fd)
            raw = encode_seal(self.key, self.subdir, files)
            if _read_seal_quiet(files_fd, self.subdir) == raw:
                self.snapshot = _snapshot(found)
                return True
            _write_seal(files_dir_fd=files_fd, subdir=self.subdir, raw=raw)
            self.snapshot = _snapshot(found)
        finally:
            os.close(files_fd)
        self._sealed_once = True
        _published(self, raw, files)
        return True

    def _release(self) -> None:
        self.writer = False
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # releases the writer's flock


def prepare(files_dir: str, subdir: str) -> RuntimeCache | None:
    """Make ``files_dir/subdir`` safe to hand to GE: verified against its seal, or (set
    aside and) created fresh with this process as its writer. None: GE must use a private
    directory (another process is writing it, or it could not be set aside or created)."""
    _, _, key = _layout(files_dir)
    try:
        files_fd = _open_files_dir(files_dir)
    except (OSError, fs.CacheSecurityError) as exc:
        log.warning("npu_cached: cannot open %s (%s); GE caches into a private temporary directory", files_dir, exc)
        return None
    try:
        # verifying needs only a shared lock (processes starting together verify in parallel); setting
        # aside or creating takes the exclusive one and decides again from what is there then
        fs.flock(files_fd, _LOCK_SH)
        cache = _verify_shared(files_dir, files_fd, subdir, key)
        if cache is _UNDECIDED:
            fs.flock(files_fd, _LOCK_EX)
            cache = _prepare_locked(files_dir, files_fd, subdir, key)
    finally:
        os.close(files_fd)  # releases the lock
    if cache is not None:
        with _ACTIVE_LOCK:
            if not _ACTIVE:
                import atexit

                atexit.register(_at_exit)
            _ACTIVE.append(cache)
    return cache


_UNDECIDED: Any = object()


def _verify_shared(files_dir: str, files_fd: int, subdir: str, key: str) -> RuntimeCache | None | Any:
    """Under the files dir's shared lock: the verified cache, None (a writer holds it), or
    :data:`_UNDECIDED` (missing, odd, unsealed or not matching: decided under the exclusive lock)."""
    try:
        fd = fs.open_dir(subdir, dir_fd=files_fd, root=files_dir)
    except (OSError, fs.CacheSecurityError):
        return _UNDECIDED
    try:
        if not _locked(fd, _LOCK_SH, files_dir, subdir):  # a writer holds it exclusively until it seals
            return None
        try:
            raw = _read_seal(files_fd, subdir)
            if raw is None:
                return _UNDECIDED
            snapshot = check(fd, parse_seal(raw, key, subdir))
        except (SealMismatch, OSError):
            return _UNDECIDED
        return RuntimeCache(files_dir, subdir, key, writer=False, lock_fd=None, snapshot=snapshot)
    finally:
        os.close(fd)


def _prepare_locked(files_dir: str, files_fd: int, subdir: str, key: str) -> RuntimeCache | None:
    _drop_leftovers(files_fd, subdir)
    try:
        fd = fs.open_dir(subdir, dir_fd=files_fd, root=files_dir)
    except FileNotFoundError:
        fd = None
    except (OSError, fs.CacheSecurityError) as exc:  # a symlink, a file, another user's directory
        return _rebuild(files_dir, files_fd, subdir, key, f"{subdir} is not a directory of ours ({exc})")
    if fd is None:
        if _read_seal_quiet(files_fd, subdir) is not None or _lexists(files_fd, seal_name(subdir)):
            return _rebuild(files_dir, files_fd, subdir, key, "its directory is missing")
        return _create(files_dir, files_fd, subdir, key)
    keep_fd = False
    try:
        if not _locked(fd, _LOCK_EX, files_dir, subdir):
            return None
        try:
            raw = _read_seal(files_fd, subdir)
            if raw is None:
                if not os.listdir(fd):  # an empty directory: nothing to trust or distrust, write it
                    keep_fd = True  # holding its exclusive lock: this process is its writer
                    return RuntimeCache(files_dir, subdir, key, writer=True, lock_fd=fd, snapshot={})
                raise SealMismatch("it has no seal (GE stopped mid-write, or an older version wrote it)")
            snapshot = check(fd, parse_seal(raw, key, subdir))
        except SealMismatch as exc:
            os.close(fd)
            fd = None
            return _rebuild(files_dir, files_fd, subdir, key, str(exc))
        return RuntimeCache(files_dir, subdir, key, writer=False, lock_fd=None, snapshot=snapshot)
    finally:
        if fd is not None and not keep_fd:
            os.close(fd)


def _rebuild(files_dir: str, files_fd: int, subdir: str, key: str, reason: str) -> RuntimeCache | None:
    if not set_aside(files_dir, subdir, reason, files_fd):
        return None
    return _create(files_dir, files_fd, subdir, key)


def _create(files_dir: str, files_fd: int, subdir: str, key: str) -> RuntimeCache | None:
    fetched = _from_remote(files_dir, files_fd, subdir, key)
    if fetched is not None:
        return fetched
    try:
        os.mkdir(subdir, fs.DIR_MODE, dir_fd=files_fd)
        fd = fs.open_dir(subdir, dir_fd=files_fd, root=files_dir)
    except (OSError, fs.CacheSecurityError) as exc:
        log.warning("npu_cached: cannot create %s (%s); GE caches into a private temporary directory",
                    os.path.join(files_dir, subdir), exc)
        return None
    fs.flock(fd, _LOCK_EX)  # nobody else can hold it: it was just made, under the files dir's exclusive lock
    return RuntimeCache(files_dir, subdir, key, writer=True, lock_fd=fd, snapshot={})


def _from_remote(files_dir: str, files_fd: int, subdir: str, key: str) -> RuntimeCache | None:
    """Before GE rebuilds a missing (or set aside) cache: the sealed one another node of the
    fleet published, streamed in and checked against its seal as it arrives, then verified
    again as installed."""
    root, kind, _ = _layout(files_dir)
    try:
        from . import layers
        from .runtime_carry import install_locked

        lay = layers.layers_of(root)
        remote = lay.remote() if lay is not None else None
        if remote is None:
            return None
        found = remote.get_runtime(kind, key, (subdir,))
        if subdir not in found or not install_locked(files_dir, files_fd, subdir, *found[subdir]):
            return None
        fd = fs.open_dir(subdir, dir_fd=files_fd, root=files_dir)
        try:
            raw = _read_seal(files_fd, subdir)
            snapshot = check(fd, parse_seal(raw or b"", key, subdir))
        finally:
            os.close(fd)
    except Exception as exc:  # noqa: BLE001 - the remote never fails a call: GE builds its own
        from .runtime_carry import NoRoom

        (log.warning if isinstance(exc, NoRoom) else log.debug)(
            "npu_cached: the run-time cache %s of %s/%s was not taken from the remote: %s", subdir, kind, key[:12],
            exc if isinstance(exc, NoRoom) else repr(exc))
        return None
    log.info("npu_cached: the run-time cache %s of %s/%s was fetched from the remote cache", subdir, kind, key[:12])
    return RuntimeCache(files_dir, subdir, key, writer=False, lock_fd=None, snapshot=snapshot)


def _at_exit() -> None:
    """GE may add files after the first run: seal what changed (stat only when nothing did)."""
    _EXITING.set()
    with _ACTIVE_LOCK:
        caches = list(_ACTIVE)
    for cache in caches:
        if cache.writer:
            continue  # its first run never returned: never sealed, set aside at the next start
        try:
            if cache._changed():
                cache.seal()
        except Exception as exc:  # noqa: BLE001
            log.debug("npu_cached: re-seal of %s at exit failed: %r", cache.path, exc)
    _join_uploads_at_exit()


#: seconds a process's exit waits, in all, for uploads of sealed caches still running
UPLOAD_WAIT_ENV = "TORCHAIR_CACHE_UPLOAD_WAIT"
_UPLOAD_WAIT_DEFAULT = 120.0


def _upload_wait() -> float:
    raw = os.environ.get(UPLOAD_WAIT_ENV, "")
    try:
        return max(0.0, float(raw)) if raw else _UPLOAD_WAIT_DEFAULT
    except ValueError:
        log.warning("npu_cached: %s=%r is not a number of seconds; waiting %.0f s", UPLOAD_WAIT_ENV, raw,
                    _UPLOAD_WAIT_DEFAULT)
        return _UPLOAD_WAIT_DEFAULT


def _join_uploads_at_exit() -> None:
    """The exit waits for running uploads, but not forever (a slow link must not hang a
    shutdown): an upload still running after the bound is abandoned, and since its record
    is written last, another node never sees it; it publishes the cache itself."""
    bound = _upload_wait()
    if wait_for_uploads(bound):
        return
    with _ACTIVE_LOCK:
        left = [t.name for t in _UPLOADS if t.is_alive()]
    log.warning("npu_cached: exiting before %d upload(s) of run-time caches to the remote finished (%s): other "
                "nodes build them themselves; set %s (seconds, now %.0f) to wait longer", len(left),
                ", ".join(left), UPLOAD_WAIT_ENV, bound)


# ---------------------------------------------------------------- travel (bundles, the remote): runtime_carry.py
def collect(files_dir: str) -> tuple[dict[str, tuple[bytes, Any]], list[str]]:
    """The sealed run-time caches of an entry that verify: {cache: (seal bytes, fill)} (``fill``
    streams its files into a :class:`runtime_carry.Staging`: nothing is held in memory), and
    notes naming those left out. :func:`runtime_carry.sealed_caches` gives the files too."""
    from .runtime_carry import sealed_caches

    found, notes = sealed_caches(files_dir)
    return {subdir: (s.seal_raw, s.copy_into) for subdir, s in found.items()}, notes


def install(files_dir: str, subdir: str, seal_raw: bytes, files: Any) -> bool:
    """Install a carried run-time cache into an entry that has none: ``files`` is a fill
    (:func:`collect`, ``RedisRemote.get_runtime``) or small ``{path: bytes}``; streamed into a
    temporary directory, checked against the seal, renamed into place, then the seal written.
    False if the entry has one already (kept) or on a refusal or fault (logged: GE builds its own)."""
    from . import runtime_carry

    fill = runtime_carry.bytes_fill(files) if isinstance(files, dict) else files
    return runtime_carry.install(files_dir, subdir, seal_raw, fill)


#: uploads of sealed caches still running (the exit waits for them, bounded: ``_join_uploads_at_exit``)
_UPLOADS: list[threading.Thread] = []
_EXITING = threading.Event()


def _published(cache: RuntimeCache, seal_raw: bytes, files: dict[str, tuple[int, str]]) -> None:
    """A newly sealed cache goes to the remote too, when the entry's root has one: streamed from
    disk, each file checked against the seal just written as it is sent (one that changed since
    aborts the upload, never served). GE's compiled models are often GBs, so the upload runs in
    a thread of its own (the first call returns without waiting for it); the process's exit
    waits for it up to ``TORCHAIR_CACHE_UPLOAD_WAIT`` seconds (an upload cut short is never
    served: its record is never written)."""
    root, kind, key = _layout(cache.files_dir)
    try:
        from . import layers

        lay = layers.layers_of(root)
        remote = lay.remote() if lay is not None else None
    except Exception as exc:  # noqa: BLE001 - the remote never fails a call
        log.debug("npu_cached: no remote for the run-time cache %s: %r", cache.path, exc)
        return
    if remote is None:
        return
    from .runtime_carry import Sealed

    sealed = Sealed(cache.files_dir, cache.subdir, key, seal_raw, files)

    def upload() -> None:
        try:
            remote.put_runtime(kind, key, sealed)
        except Exception as exc:  # noqa: BLE001 - the remote never fails a call
            log.debug("npu_cached: publishing the run-time cache %s to the remote failed: %r", cache.path, exc)

    if _EXITING.is_set():  # re-sealed at exit: no thread may start now
        upload()
        return
    # a daemon: the exit waits for it in ``_at_exit``, bounded by TORCHAIR_CACHE_UPLOAD_WAIT
    thread = threading.Thread(target=upload, name=f"tcb-publish-{cache.subdir}-{key[:8]}", daemon=True)
    with _ACTIVE_LOCK:
        _UPLOADS[:] = [t for t in _UPLOADS if t.is_alive()]
        _UPLOADS.append(thread)
    thread.start()


def wait_for_uploads(timeout: float | None = None) -> bool:
    """Wait (``timeout`` seconds in all) for this process's uploads of sealed caches; False if
    some still run then."""
    with _ACTIVE_LOCK:
        threads = list(_UPLOADS)
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)
