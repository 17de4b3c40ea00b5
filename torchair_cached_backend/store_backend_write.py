"""The write side of :class:`~torchair_cached_backend.store_backend.LocalDir`.

Publishing (staged under a hidden name, fsync'd, renamed into place; replaced by
an atomic exchange where the filesystem has it), rewriting a manifest in place,
unpublishing, quarantining and sweeping leftovers. ``LocalDir``'s write methods
call these; a warm load only reads, so it never imports this module.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import uuid
from typing import Any

from . import fs_security as fs
from .store_backend import LocalDir, _exists_at, subdir
from .store_layout import FILES_DIR, MANIFEST, QUARANTINE_DIR, TAG, TAG_TEXT, encode_manifest, sha256

#: test-only fault injection: SIGKILL this process at a stage of save() (tests/test_concurrency.py)
_KILL_AT = os.environ.get("TORCHAIR_CACHE_TEST_KILL_AT") or None


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


def ensure_tag(backend: LocalDir) -> None:
    rfd = backend.root_fd(create=True)
    assert rfd is not None
    try:
        os.stat(TAG, dir_fd=rfd, follow_symlinks=False)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):
            fs.write_at(rfd, TAG, TAG_TEXT.encode())


def _stage(backend: LocalDir, kfd: int, kind: str, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str:
    """A complete, fsync'd copy of the entry under a hidden name in the kind dir."""
    tmp = f".tmp-{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp, fs.DIR_MODE, dir_fd=kfd)
    try:
        tfd = fs.open_dir(tmp, dir_fd=kfd, root=backend.root)
        try:
            os.mkdir(FILES_DIR, fs.DIR_MODE, dir_fd=tfd)
            ffd = fs.open_dir(FILES_DIR, dir_fd=tfd, root=backend.root)
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


def publish(backend: LocalDir, kind: str, key: str, files: dict[str, bytes], manifest: dict[str, Any], *,
            replace: bool = False) -> bool:
    kfd = backend.kind_fd(kind, create=True)
    assert kfd is not None
    try:
        if not replace and _exists_at(kfd, key):
            return True
        tmp = _stage(backend, kfd, kind, key, files, manifest)
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


def rewrite_manifest(backend: LocalDir, entry_fd: int, manifest: dict[str, Any]) -> None:
    """Replace an entry's manifest in place: new file, length checked, fsync, rename."""
    tmp = f".{MANIFEST}.{uuid.uuid4().hex[:8]}"
    fs.write_at(entry_fd, tmp, encode_manifest(manifest))
    try:
        os.replace(tmp, MANIFEST, src_dir_fd=entry_fd, dst_dir_fd=entry_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=entry_fd)
        raise


def unpublish(backend: LocalDir, kind: str, key: str, identity: tuple[int, int] | None = None) -> bool:
    """Rename the entry away (only if it is still ``identity``) and delete it."""
    kfd = backend.kind_fd(kind)
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


def move_to_quarantine(backend: LocalDir, kind: str, key: str, identity: tuple[int, int] | None) -> str | None:
    """Move the entry to ``quarantine/`` if it is still ``identity``; the new name or None."""
    kfd = backend.kind_fd(kind)
    if kfd is None:
        return None
    try:
        if identity is not None and _identity_at(kfd, key) != identity:
            return None
        rfd = backend.root_fd()
        assert rfd is not None
        qfd = subdir(rfd, QUARANTINE_DIR, create=True, root=backend.root)
        assert qfd is not None
        try:
            dst = f"{kind}-{key[:32]}-{int(time.time())}-{uuid.uuid4().hex[:6]}"
            try:
                os.rename(key, dst, src_dir_fd=kfd, dst_dir_fd=qfd)
            except FileNotFoundError:
                return None
            return os.path.join(backend.root, QUARANTINE_DIR, dst)
        finally:
            os.close(qfd)
    finally:
        os.close(kfd)


def sweep(backend: LocalDir, kind: str, max_age_s: float) -> int:
    kfd = backend.kind_fd(kind)
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


def _identity_at(kfd: int, key: str) -> tuple[int, int] | None:
    try:
        st = os.stat(key, dir_fd=kfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)
