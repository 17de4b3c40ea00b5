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
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import threading
import time
import uuid
from typing import Any

from . import fs_security as fs
from .logs import log
from .stats import record
from .store_layout import QUARANTINE_DIR, loads_bounded

#: the run-time cache directories the project points GE / torchair at inside an entry's files
SUBDIRS = ("ge_cache", "fw.ge_cache", "bw.ge_cache", "static_kernels")
SEAL_SUFFIX = ".seal.json"
SEAL_FORMAT = "tcb-runtime-cache-seal"
SEAL_VERSION = 1
#: bounds on what a seal may describe (a seal is untrusted input until checked)
MAX_DEPTH = 8
MAX_FILES = 100_000
MAX_SEAL_BYTES = 64 << 20
_CHUNK = 1 << 20


class SealMismatch(Exception):
    """A run-time cache that does not match its seal (or has none); the message says which check."""


def seal_name(subdir: str) -> str:
    return subdir + SEAL_SUFFIX


def plain_name(name: Any) -> bool:
    """One path component GE may write: not empty, ``.`` or ``..``, no separator or NUL
    (hidden names allowed: GE's own index and lock files may be)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def valid_rel(rel: Any) -> bool:
    """A relative path inside a run-time cache: 1..MAX_DEPTH plain names joined by ``/``."""
    if not isinstance(rel, str):
        return False
    parts = rel.split("/")
    return 0 < len(parts) <= MAX_DEPTH and all(plain_name(p) for p in parts)


# ---------------------------------------------------------------- seal bytes
def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def encode_seal(key: str, subdir: str, files: dict[str, tuple[int, str]]) -> bytes:
    """The seal of ``files`` (rel -> (size, sha256)) of run-time cache ``subdir`` of entry ``key``."""
    body: dict[str, Any] = {
        "format": SEAL_FORMAT, "version": SEAL_VERSION, "key": key, "cache": subdir,
        "files": {rel: {"size": size, "sha256": digest} for rel, (size, digest) in sorted(files.items())},
    }
    body["digest"] = hashlib.sha256(_canonical(body)).hexdigest()
    return _canonical(body)


def parse_seal(raw: bytes, key: str, subdir: str) -> dict[str, tuple[int, str]]:
    """rel -> (size, sha256) of a seal, after its bounds, schema, binding and digest checks."""
    if len(raw) > MAX_SEAL_BYTES:
        raise SealMismatch(f"its seal is {len(raw)} bytes, over {MAX_SEAL_BYTES}")
    try:
        body = loads_bounded(raw)
    except ValueError as exc:
        raise SealMismatch(f"its seal is not valid JSON ({exc}); truncated?") from None
    if not isinstance(body, dict) or body.get("format") != SEAL_FORMAT or body.get("version") != SEAL_VERSION:
        raise SealMismatch("its seal has another format")
    digest = body.pop("digest", None)
    if not isinstance(digest, str) or hashlib.sha256(_canonical(body)).hexdigest() != digest:
        raise SealMismatch("its seal fails its own digest (corrupted or altered)")
    if body.get("key") != key or body.get("cache") != subdir:
        raise SealMismatch(f"its seal belongs to {str(body.get('key'))[:12]}/{body.get('cache')}, not {key[:12]}/{subdir}")
    files = body.get("files")
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise SealMismatch("its seal's file list is malformed")
    out: dict[str, tuple[int, str]] = {}
    for rel, info in files.items():
        ok = (valid_rel(rel) and isinstance(info, dict) and type(info.get("size")) is int and info["size"] >= 0
              and isinstance(info.get("sha256"), str) and len(info["sha256"]) == 64)
        if not ok:
            raise SealMismatch(f"its seal's record of {str(rel)[:80]!r} is malformed")
        out[rel] = (info["size"], info["sha256"])
    return out


# ---------------------------------------------------------------- walking a directory by fds
def _scan(dir_fd: int, prefix: str = "", depth: int = 1, out: dict[str, os.stat_result] | None = None,
          ) -> dict[str, os.stat_result]:
    """rel -> lstat of every regular file below ``dir_fd`` (never following a link).
    SealMismatch for a symlink, a special file, a foreign owner, an odd name, too deep or too many."""
    out = {} if out is None else out
    uid = os.geteuid()
    for name in sorted(os.listdir(dir_fd)):
        rel = prefix + name
        if not plain_name(name):
            raise SealMismatch(f"{rel!r} is not a plain file name")
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise SealMismatch(f"{rel!r} is a symlink")
        if st.st_uid != uid:
            raise SealMismatch(f"{rel!r} is owned by uid {st.st_uid}, not {uid}")
        if stat.S_ISDIR(st.st_mode):
            if depth >= MAX_DEPTH:
                raise SealMismatch(f"{rel!r} nests deeper than {MAX_DEPTH}")
            sub = os.open(name, fs.DIR_OPEN_FLAGS, dir_fd=dir_fd)
            try:
                _scan(sub, rel + "/", depth + 1, out)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            out[rel] = st
            if len(out) > MAX_FILES:
                raise SealMismatch(f"more than {MAX_FILES} files")
        else:
            raise SealMismatch(f"{rel!r} is not a regular file")
    return out


def _open_rel(dir_fd: int, rel: str) -> int:
    """fd of file ``rel`` below ``dir_fd``, no level followed through a link."""
    parts = rel.split("/")
    fd = dir_fd
    try:
        for part in parts[:-1]:
            nxt = os.open(part, fs.DIR_OPEN_FLAGS, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = nxt
        return os.open(parts[-1], os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


def _digest_file(dir_fd: int, rel: str, expect: os.stat_result) -> str:
    """sha256 of file ``rel``; it must still be the file scanned."""
    fd = _open_rel(dir_fd, rel)
    with open(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if (st.st_ino, st.st_dev) != (expect.st_ino, expect.st_dev) or not stat.S_ISREG(st.st_mode):
            raise SealMismatch(f"{rel!r} was replaced while it was checked")
        return hashlib.file_digest(f, "sha256").hexdigest()


def _snapshot(found: dict[str, os.stat_result]) -> dict[str, tuple[int, int, int]]:
    return {rel: (st.st_size, st.st_mtime_ns, st.st_ino) for rel, st in found.items()}


def check(dir_fd: int, sealed: dict[str, tuple[int, str]]) -> dict[str, tuple[int, int, int]]:
    """Check the directory ``dir_fd`` against ``sealed``: the same files, sizes and sha256s
    (hashed in pieces, nothing kept). Returns its stat snapshot; SealMismatch otherwise."""
    found = _scan(dir_fd)
    missing = sorted(set(sealed) - set(found))
    if missing:
        raise SealMismatch(f"{missing[0]!r} is missing ({len(missing)} file(s) the seal lists)")
    extra = sorted(set(found) - set(sealed))
    if extra:
        raise SealMismatch(f"{extra[0]!r} is not in its seal ({len(extra)} unlisted file(s))")
    for rel, (size, _) in sealed.items():
        if found[rel].st_size != size:
            raise SealMismatch(f"{rel!r} is {found[rel].st_size} bytes, its seal says {size}")
    for rel, (_, digest) in sealed.items():
        if _digest_file(dir_fd, rel, found[rel]) != digest:
            raise SealMismatch(f"{rel!r} fails its sha256 (changed since it was sealed)")
    return _snapshot(found)


def _read_seal(files_fd: int, subdir: str) -> bytes | None:
    try:
        fd = os.open(seal_name(subdir), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                     dir_fd=files_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SealMismatch("its seal is a symlink") from None
        raise
    with open(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise SealMismatch("its seal is not a regular file of ours")
        return f.read(MAX_SEAL_BYTES + 1)


# ---------------------------------------------------------------- where an entry's caches live
def _layout(files_dir: str) -> tuple[str, str, str]:
    """(store root, kind, key) of ``<root>/<kind>/<key>/files``."""
    entry = os.path.dirname(os.path.abspath(files_dir))
    kind_dir = os.path.dirname(entry)
    return os.path.dirname(kind_dir), os.path.basename(kind_dir), os.path.basename(entry)


def _open_files_dir(files_dir: str) -> int:
    return fs.open_dir(os.path.abspath(files_dir), root=files_dir)


def set_aside(files_dir: str, subdir: str, reason: str, files_fd: int | None = None) -> bool:
    """Move run-time cache ``subdir`` (and its seal) of the entry into ``<root>/quarantine/``,
    reported once and counted; False when it cannot be moved (then it must not be used)."""
    root, kind, key = _layout(files_dir)
    own = files_fd is None
    try:
        if own:
            files_fd = _open_files_dir(files_dir)
        assert files_fd is not None
        rfd = os.open(root, fs.DIR_OPEN_FLAGS)
        try:
            try:
                os.mkdir(QUARANTINE_DIR, fs.DIR_MODE, dir_fd=rfd)
            except FileExistsError:
                pass
            qfd = fs.open_dir(QUARANTINE_DIR, dir_fd=rfd, root=root)
        finally:
            os.close(rfd)
        try:
            dst = f"{kind}-{key[:32]}-{subdir}-{int(time.time())}-{uuid.uuid4().hex[:6]}"
            os.mkdir(dst, fs.DIR_MODE, dir_fd=qfd)
            dfd = fs.open_dir(dst, dir_fd=qfd, root=root)
            try:
                for name in (subdir, seal_name(subdir)):
                    try:
                        os.rename(name, name, src_dir_fd=files_fd, dst_dir_fd=dfd)
                    except FileNotFoundError:
                        pass
            finally:
                os.close(dfd)
        finally:
            os.close(qfd)
    except (OSError, fs.CacheSecurityError) as exc:
        log.warning("npu_cached: the run-time cache %s of cache entry %s/%s is not trusted (%s) and cannot be set "
                    "aside (%s); GE caches into a private temporary directory", subdir, kind, key[:12], reason, exc)
        return False
    finally:
        if own and files_fd is not None:
            os.close(files_fd)
    record(runtime_caches_set_aside=1)
    log.warning("npu_cached: the run-time cache %s of cache entry %s/%s is not trusted (%s); moved to %s and GE "
                "rebuilds it", subdir, kind, key[:12], reason, os.path.join(root, QUARANTINE_DIR, dst))
    return True


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
        _published(self)
        return True

    def _release(self) -> None:
        self.writer = False
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # releases the writer's flock


_LOCK_SH = 1 if fs.fcntl is None else fs.fcntl.LOCK_SH
_LOCK_EX = 2 if fs.fcntl is None else fs.fcntl.LOCK_EX
_LOCK_NB = 4 if fs.fcntl is None else fs.fcntl.LOCK_NB


def _read_seal_quiet(files_fd: int, subdir: str) -> bytes | None:
    try:
        return _read_seal(files_fd, subdir)
    except (OSError, SealMismatch):
        return None


def _write_seal(*, files_dir_fd: int, subdir: str, raw: bytes) -> None:
    """Temp file (0600, fsync'd) renamed over the seal, then the directory fsync'd."""
    tmp = f".{seal_name(subdir)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fs.write_at(files_dir_fd, tmp, raw)
    try:
        os.rename(tmp, seal_name(subdir), src_dir_fd=files_dir_fd, dst_dir_fd=files_dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=files_dir_fd)
        except OSError:
            pass
        raise
    os.fsync(files_dir_fd)


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


def _locked(fd: int, mode: int, files_dir: str, subdir: str) -> bool:
    """Take ``mode`` on the cache directory without waiting; False (logged) while another
    process writes it: GE then caches into a private temporary directory."""
    if fs.flock(fd, mode | _LOCK_NB):
        return True
    log.info("npu_cached: the run-time cache %s is being written by another process; GE caches into a "
             "private temporary directory", os.path.join(files_dir, subdir))
    return False


def _drop_leftovers(files_fd: int, subdir: str) -> None:
    """Temporary files of a seal or an install that died midway (both run under the files dir's
    exclusive lock, which the caller holds now: any left is a dead writer's, never published)."""
    import shutil

    for name in os.listdir(files_fd):
        if name.startswith((f".{subdir}.tmp-", f".{seal_name(subdir)}.tmp-")):
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=files_fd, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=files_fd)
                else:
                    os.unlink(name, dir_fd=files_fd)
            except OSError as exc:
                log.debug("npu_cached: cannot remove the leftover %s: %r", name, exc)


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


def _lexists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except OSError:
        return False


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
        log.debug("npu_cached: the run-time cache %s of %s/%s was not taken from the remote: %r", subdir, kind,
                  key[:12], exc)
        return None
    log.info("npu_cached: the run-time cache %s of %s/%s was fetched from the remote cache", subdir, kind, key[:12])
    return RuntimeCache(files_dir, subdir, key, writer=False, lock_fd=None, snapshot=snapshot)


def _at_exit() -> None:
    """GE may add files after the first run: seal what changed (stat only when nothing did)."""
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


def _published(cache: RuntimeCache) -> None:
    """A newly sealed cache goes to the remote too, when the entry's root has one (streamed
    from disk, each file checked against the seal as it is sent)."""
    root, kind, key = _layout(cache.files_dir)
    try:
        from . import layers
        from .runtime_carry import sealed_caches

        lay = layers.layers_of(root)
        remote = lay.remote() if lay is not None else None
        if remote is None:
            return
        found, _ = sealed_caches(cache.files_dir)
        if cache.subdir in found:
            remote.put_runtime(kind, key, found[cache.subdir])
    except Exception as exc:  # noqa: BLE001 - the remote never fails a call
        log.debug("npu_cached: publishing the run-time cache %s to the remote failed: %r", cache.path, exc)
