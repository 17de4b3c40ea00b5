"""The storage-backend protocol under :class:`~torchair_cached_backend.store.Store`,
and its local-directory implementation.

A backend holds the entries of one cache root, by ``(kind, key)``. It only moves
verified bytes: :meth:`StorageBackend.read` returns an entry whose every blob was
checked against its manifest's sha256 (raising :class:`BrokenEntry` otherwise),
:meth:`StorageBackend.publish` makes an entry visible atomically (whole or not at
all; with ``replace`` the old one stays until the new one is durable). Faults are
``OSError`` s: the :class:`Store` facade turns them into misses and warnings.

:class:`LocalDir` keeps one directory fd per root for the whole process, opened
once without following a symlink; every path below it is opened with
``openat(O_NOFOLLOW|O_DIRECTORY)`` from that fd, so swapping the root's path (or
any level below it) for a symlink mid-run changes nothing for this process. A
root on a read-only filesystem is a *read-only base*: readable, never written
(:meth:`writable` is False, the Store then skips every write).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import uuid
from collections import OrderedDict
from typing import Any, Protocol

from . import fs_security as fs
from .store_faults import write_blocker
from .store_layout import (
    FILES_DIR,
    LOCKS_DIR,
    MANIFEST,
    QUARANTINE_DIR,
    TAG,
    TAG_TEXT,
    BrokenEntry,
    Entry,
    encode_manifest,
    parse_manifest,
    sha256,
    valid_name,
)

#: test-only fault injection: SIGKILL this process at a stage of save() (tests/test_concurrency.py)
_KILL_AT = os.environ.get("TORCHAIR_CACHE_TEST_KILL_AT") or None
KILL_STAGES = ("between_blobs", "after_manifest", "before_rename", "after_rename")
#: test seam: called with (kind, key) after an entry was verified, before its bytes are used
AFTER_VERIFY: list[Any] = []


class StorageBackend(Protocol):
    """Entries of one cache root by (kind, key). A remote tier implements this."""

    root: str

    def writable(self) -> bool:
        """Whether publish/remove may be attempted (found without writing)."""
        ...

    def read(self, kind: str, key: str) -> Entry | None:
        """The verified entry, None if absent. BrokenEntry (with ``identity``) if it
        fails a check, OSError for a fault, CacheSecurityError for a foreign object."""
        ...

    def read_manifest(self, kind: str, key: str) -> dict[str, Any] | None:
        """The parsed, schema-checked manifest only (no blob read)."""
        ...

    def publish(self, kind: str, key: str, files: dict[str, bytes], manifest: dict[str, Any], *,
                replace: bool = False) -> bool:
        """Publish atomically. Without ``replace`` an existing entry wins (True if one
        is there). With ``replace`` the old entry is swapped out only after the new
        one is complete. Raises OSError for a fault (nothing published)."""
        ...

    def keys(self, kind: str) -> list[str]:
        ...

    def remove(self, kind: str, key: str) -> bool:
        """Unpublish then delete; False if absent."""
        ...


_ROOT_FDS: OrderedDict[str, int] = OrderedDict()
_MAX_ROOT_FDS = 128


def root_fd(root: str, *, create: bool) -> int | None:
    """The process-wide fd of ``root`` (opened once; reopened only if the directory
    was deleted). None if it does not exist and ``create`` is False."""
    fd = _ROOT_FDS.get(root)
    if fd is not None:
        try:
            if os.fstat(fd).st_nlink > 0:
                _ROOT_FDS.move_to_end(root)
                return fd
        except OSError:
            pass
        forget_root(root)
    fd = fs.open_root(root, create=create)
    if fd is None:
        return None
    _ROOT_FDS[root] = fd
    while len(_ROOT_FDS) > _MAX_ROOT_FDS:
        _, old = _ROOT_FDS.popitem(last=False)
        with contextlib.suppress(OSError):
            os.close(old)
    return fd


def forget_root(root: str) -> None:
    fd = _ROOT_FDS.pop(root, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def subdir(parent_fd: int, name: str, *, create: bool, root: str) -> int | None:
    """fd of directory ``name`` in ``parent_fd`` (never a symlink, owned by us)."""
    try:
        return fs.open_dir(name, dir_fd=parent_fd, root=root)
    except FileNotFoundError:
        if not create:
            return None
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, fs.DIR_MODE, dir_fd=parent_fd)
    return fs.open_dir(name, dir_fd=parent_fd, root=root)


def _rename_exchange(dir_fd: int, a: str, b: str) -> bool:
    """Atomically swap ``a`` and ``b`` (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    if fn(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), 2) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), b)


def _kill_point(stage: str) -> None:
    """Test-only: ``TORCHAIR_CACHE_TEST_KILL_AT=<stage>`` SIGKILLs the process at
    that stage of a save, to prove a crash never leaves a partial entry."""
    if _KILL_AT == stage:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class LocalDir:
    """Entries in ``<root>/<kind>/<key>/`` (see the module docstring)."""

    def __init__(self, root: str) -> None:
        self.root = root

    # -- fds --------------------------------------------------------------
    def root_fd(self, *, create: bool = False) -> int | None:
        return root_fd(self.root, create=create)

    def kind_fd(self, kind: str, *, create: bool = False) -> int | None:
        rfd = self.root_fd(create=create)
        if rfd is None:
            return None
        return subdir(rfd, kind, create=create, root=self.root)

    def entry_fd(self, kind: str, key: str) -> tuple[int, int] | None:
        """(kind fd, entry fd) or None when there is no such entry."""
        kfd = self.kind_fd(kind)
        if kfd is None:
            return None
        try:
            return kfd, fs.open_dir(key, dir_fd=kfd, root=self.root)
        except FileNotFoundError:
            os.close(kfd)
            return None
        except BaseException:
            os.close(kfd)
            raise

    def writable(self) -> bool:
        return write_blocker(self.root, os.path.join(self.root, "graphs")) is None

    def ensure_tag(self) -> None:
        rfd = self.root_fd(create=True)
        assert rfd is not None
        try:
            os.stat(TAG, dir_fd=rfd, follow_symlinks=False)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                fs.write_at(rfd, TAG, TAG_TEXT.encode())

    # -- read -------------------------------------------------------------
    def verify_at(self, entry_fd: int, key: str) -> tuple[dict[str, Any], dict[str, bytes]]:
        try:
            manifest = parse_manifest(fs.read_at(entry_fd, MANIFEST, root=self.root))
        except FileNotFoundError:
            raise BrokenEntry("manifest.json is missing") from None
        if manifest.get("key") != key:
            raise BrokenEntry(f"manifest key {manifest.get('key')!r} does not match its directory {key!r}")
        infos = manifest.get("files", {})
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
                    data = fs.read_at(files_fd, name, root=self.root)
                except FileNotFoundError:
                    raise BrokenEntry(f"blob {name!r} is missing") from None
                if len(data) != info["size"]:
                    raise BrokenEntry(f"blob {name!r} is {len(data)} bytes, manifest says {info['size']} (truncated?)")
                if sha256(data) != info["sha256"]:
                    raise BrokenEntry(f"blob {name!r} fails its sha256 checksum (corrupted)")
                files[name] = data
        finally:
            os.close(files_fd)
        return manifest, files

    def read(self, kind: str, key: str) -> Entry | None:
        """The verified entry (no last-used refresh), or None if absent."""
        fds = self.entry_fd(kind, key)
        if fds is None:
            return None
        kfd, efd = fds
        try:
            st = os.fstat(efd)
            try:
                manifest, files = self.verify_at(efd, key)
            except BrokenEntry as exc:
                exc.identity = (st.st_dev, st.st_ino)
                raise
            return Entry(key=key, path=os.path.join(self.root, kind, key), manifest=manifest, files=files)
        finally:
            os.close(efd)
            os.close(kfd)

    def read_manifest(self, kind: str, key: str) -> dict[str, Any] | None:
        fds = self.entry_fd(kind, key)
        if fds is None:
            return None
        kfd, efd = fds
        try:
            try:
                return parse_manifest(fs.read_at(efd, MANIFEST, root=self.root))
            except FileNotFoundError:
                raise BrokenEntry("manifest.json is missing") from None
        finally:
            os.close(efd)
            os.close(kfd)

    def identity(self, kind: str, key: str) -> tuple[int, int] | None:
        kfd = self.kind_fd(kind)
        if kfd is None:
            return None
        try:
            st = os.stat(key, dir_fd=kfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            os.close(kfd)
        return (st.st_dev, st.st_ino)

    def keys(self, kind: str) -> list[str]:
        kfd = self.kind_fd(kind)
        if kfd is None:
            return []
        try:
            return sorted(n for n in os.listdir(kfd) if valid_name(n))
        finally:
            os.close(kfd)

    # -- write ------------------------------------------------------------
    def _stage(self, kfd: int, kind: str, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str:
        """A complete, fsync'd copy of the entry under a hidden name in the kind dir."""
        tmp = f".tmp-{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.mkdir(tmp, fs.DIR_MODE, dir_fd=kfd)
        try:
            tfd = fs.open_dir(tmp, dir_fd=kfd, root=self.root)
            try:
                os.mkdir(FILES_DIR, fs.DIR_MODE, dir_fd=tfd)
                ffd = fs.open_dir(FILES_DIR, dir_fd=tfd, root=self.root)
                infos = {}
                try:
                    for i, (name, data) in enumerate(files.items()):
                        if _KILL_AT and i == 1:
                            _kill_point("between_blobs")
                        fs.write_at(ffd, name, data)
                        infos[name] = {"size": len(data), "sha256": sha256(data)}
                    os.fsync(ffd)
                finally:
                    os.close(ffd)
                now = time.time()
                full = dict(manifest, key=key, kind=kind, files=infos, created=now, last_used=now)
                fs.write_at(tfd, MANIFEST, encode_manifest(full))
                os.fsync(tfd)
            finally:
                os.close(tfd)
        except BaseException:
            shutil.rmtree(tmp, dir_fd=kfd, ignore_errors=True)
            raise
        if _KILL_AT:
            _kill_point("after_manifest")
        return tmp

    def publish(self, kind: str, key: str, files: dict[str, bytes], manifest: dict[str, Any], *,
                replace: bool = False) -> bool:
        kfd = self.kind_fd(kind, create=True)
        assert kfd is not None
        try:
            if not replace and _exists_at(kfd, key):
                return True
            tmp = self._stage(kfd, kind, key, files, manifest)
            try:
                if _KILL_AT:
                    _kill_point("before_rename")
                if replace and _exists_at(kfd, key, entry_only=False):
                    if not _rename_exchange(kfd, tmp, key):  # new and old swapped: tmp now holds the old
                        trash = f".trash-{key[:16]}-{uuid.uuid4().hex[:8]}"
                        os.rename(key, trash, src_dir_fd=kfd, dst_dir_fd=kfd)
                        try:
                            os.rename(tmp, key, src_dir_fd=kfd, dst_dir_fd=kfd)
                        except BaseException:
                            os.rename(trash, key, src_dir_fd=kfd, dst_dir_fd=kfd)
                            raise
                        tmp = trash
                else:
                    try:
                        os.rename(tmp, key, src_dir_fd=kfd, dst_dir_fd=kfd)
                    except OSError as exc:
                        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):  # another writer won: keep theirs
                            return _exists_at(kfd, key)
                        raise
                if _KILL_AT:
                    _kill_point("after_rename")
                with contextlib.suppress(OSError):
                    os.fsync(kfd)
                return True
            finally:
                shutil.rmtree(tmp, dir_fd=kfd, ignore_errors=True)
        finally:
            os.close(kfd)

    def rewrite_manifest(self, entry_fd: int, manifest: dict[str, Any]) -> None:
        """Replace an entry's manifest in place: new file, length checked, fsync, rename."""
        tmp = f".{MANIFEST}.{uuid.uuid4().hex[:8]}"
        fs.write_at(entry_fd, tmp, encode_manifest(manifest))
        try:
            os.replace(tmp, MANIFEST, src_dir_fd=entry_fd, dst_dir_fd=entry_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=entry_fd)
            raise

    def unpublish(self, kind: str, key: str, identity: tuple[int, int] | None = None) -> bool:
        """Rename the entry away (only if it is still ``identity``) and delete it."""
        kfd = self.kind_fd(kind)
        if kfd is None:
            return False
        try:
            if identity is not None and _identity_at(kfd, key) != identity:
                return False
            trash = f".trash-{key[:16]}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(key, trash, src_dir_fd=kfd, dst_dir_fd=kfd)
            except FileNotFoundError:
                return False
            shutil.rmtree(trash, dir_fd=kfd, ignore_errors=True)
            return True
        finally:
            os.close(kfd)

    def remove(self, kind: str, key: str) -> bool:
        return self.unpublish(kind, key)

    def move_to_quarantine(self, kind: str, key: str, identity: tuple[int, int] | None) -> str | None:
        """Move the entry to ``quarantine/`` if it is still ``identity``; the new name or None."""
        kfd = self.kind_fd(kind)
        if kfd is None:
            return None
        try:
            if identity is not None and _identity_at(kfd, key) != identity:
                return None
            rfd = self.root_fd()
            assert rfd is not None
            qfd = subdir(rfd, QUARANTINE_DIR, create=True, root=self.root)
            assert qfd is not None
            try:
                dst = f"{kind}-{key[:32]}-{int(time.time())}-{uuid.uuid4().hex[:6]}"
                try:
                    os.rename(key, dst, src_dir_fd=kfd, dst_dir_fd=qfd)
                except FileNotFoundError:
                    return None
                return os.path.join(self.root, QUARANTINE_DIR, dst)
            finally:
                os.close(qfd)
        finally:
            os.close(kfd)

    def sweep(self, kind: str, max_age_s: float) -> int:
        kfd = self.kind_fd(kind)
        if kfd is None:
            return 0
        removed = 0
        now = time.time()
        try:
            for name in os.listdir(kfd):
                if not name.startswith((".tmp-", ".trash-")):
                    continue
                try:
                    if now - os.stat(name, dir_fd=kfd, follow_symlinks=False).st_mtime < max_age_s:
                        continue
                except OSError:
                    continue
                shutil.rmtree(name, dir_fd=kfd, ignore_errors=True)
                removed += 1
        except OSError:
            return removed
        finally:
            os.close(kfd)
        return removed

    def locks_fd(self, *, create: bool) -> int | None:
        rfd = self.root_fd(create=create)
        if rfd is None:
            return None
        return subdir(rfd, LOCKS_DIR, create=create, root=self.root)


def _identity_at(kfd: int, key: str) -> tuple[int, int] | None:
    try:
        st = os.stat(key, dir_fd=kfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def _exists_at(kfd: int, key: str, *, entry_only: bool = True) -> bool:
    """Whether ``key`` is a published entry (has a manifest) in the kind dir ``kfd``."""
    try:
        efd = fs.open_dir(key, dir_fd=kfd, root="")
    except FileNotFoundError:
        return False
    except (OSError, fs.CacheSecurityError):
        return not entry_only
    try:
        os.stat(MANIFEST, dir_fd=efd, follow_symlinks=False)
        return True
    except OSError:
        return not entry_only
    finally:
        os.close(efd)
