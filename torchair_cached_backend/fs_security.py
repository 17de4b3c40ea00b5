"""Filesystem rules for the cache: owned by us, no planted symlinks, private modes.

A cache entry is code we execute (bytecode, generated Python, shared
libraries), so whoever can write the cache can run code as the user. We only
use directories the current user owns and refuse symlinks inside the cache.
"""

from __future__ import annotations

import errno
import os
import stat

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

DIR_MODE = 0o700
FILE_MODE = 0o600
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: open flags of a directory below the cache root: never through a symlink
DIR_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_NOFOLLOW | _O_CLOEXEC


class CacheSecurityError(PermissionError):
    """The cache dir is unsafe to use; the message says why and what to do."""


def _uid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


def check_dir(path: str, *, root: str) -> None:
    """Refuse ``path`` if it is a symlink or is owned by someone else.

    ``root`` is the cache root: symlinks *above* it (e.g. /home -> /data) are
    the user's business; symlinks at or below it are refused.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise CacheSecurityError(
            f"refusing cache path {path!r}: it is a symlink inside the cache dir {root!r}. "
            "Remove the symlink, or point cache_dir at a real directory you own."
        )
    if not stat.S_ISDIR(st.st_mode):
        raise CacheSecurityError(f"refusing cache path {path!r}: not a directory. Remove it or choose another cache_dir.")
    uid = _uid()
    if uid >= 0 and st.st_uid != uid:
        raise CacheSecurityError(
            f"refusing cache dir {path!r}: owned by uid {st.st_uid}, not by the current user (uid {uid}). "
            "Another user could plant code there. Use a cache_dir you own "
            "(e.g. TORCHAIR_CACHE_HOME=$HOME/.cache/torchair), or chown it."
        )


def ensure_dir(path: str, *, root: str) -> str:
    """Create ``path`` (mode 0700) below ``root`` as needed and check every
    component from ``root`` down. Returns ``path``."""
    path = os.path.abspath(path)
    root = os.path.abspath(root)
    rel = os.path.relpath(path, root)
    if rel.startswith(".."):
        raise CacheSecurityError(f"{path!r} is outside the cache dir {root!r}")
    if not os.path.lexists(root):
        os.makedirs(root, mode=DIR_MODE, exist_ok=True)
    check_dir(root, root=root)
    current = root
    for part in [] if rel == "." else rel.split(os.sep):
        current = os.path.join(current, part)
        try:
            os.mkdir(current, DIR_MODE)
        except FileExistsError:
            pass
        check_dir(current, root=root)
    return path


def check_file(path: str, *, root: str) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise CacheSecurityError(f"refusing cache file {path!r}: not a regular file (symlink planted in {root!r}?)")
    uid = _uid()
    if uid >= 0 and st.st_uid != uid:
        raise CacheSecurityError(f"refusing cache file {path!r}: owned by uid {st.st_uid}, not uid {uid}")


def _check_owner(st: os.stat_result, path: str) -> None:
    uid = _uid()
    if uid >= 0 and st.st_uid != uid:
        raise CacheSecurityError(
            f"refusing cache path {path!r}: owned by uid {st.st_uid}, not by the current user (uid {uid}). "
            "Another user could plant code there. Use a cache_dir you own, or chown it."
        )


def open_dir(name: str, *, dir_fd: int | None = None, root: str) -> int:
    """Open a cache directory (``name`` relative to ``dir_fd`` when given) without
    following a symlink, and check it is a directory we own. Returns the fd.

    Reading an entry through directory fds opened once means a path can never be
    swapped under a reader, and no level of the entry (``files/`` included) can
    be a symlink. FileNotFoundError propagates (a miss)."""
    try:
        fd = os.open(name, DIR_OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CacheSecurityError(
                f"refusing cache path {name!r} in {root!r}: a symlink or not a directory. "
                "Remove it, or point cache_dir at a real directory you own."
            ) from None
        raise
    return _owned_dir(fd, name, f"refusing cache path {name!r} in {root!r}")


def read_at(dir_fd: int, name: str, *, root: str) -> bytes:
    """The bytes of regular file ``name`` in the directory ``dir_fd``; refuses a
    symlink or a file owned by someone else."""
    try:
        fd = os.open(name, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CacheSecurityError(
                f"refusing cache file {name!r}: not a regular file (symlink planted in {root!r}?)"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheSecurityError(f"refusing cache file {name!r}: not a regular file (planted in {root!r}?)")
        _check_owner(st, name)
        chunks = []
        remaining = st.st_size
        while True:  # read to EOF: the size may have changed since fstat
            chunk = os.read(fd, max(remaining, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to ``fd`` (a short write is retried; a write that
    makes no progress is ENOSPC), then fsync: a caller renames only complete files."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]
    os.fsync(fd)
    if os.fstat(fd).st_size != len(data):
        raise OSError(errno.EIO, f"wrote {len(data)} bytes but the file holds {os.fstat(fd).st_size}")


def write_at(dir_fd: int, name: str, data: bytes) -> None:
    """Create ``name`` (0600, never through a symlink) in the directory ``dir_fd`` and
    write all of ``data`` with the length checked and fsync'd. A failed write
    removes the partial file and raises."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
    try:
        os.fchmod(fd, FILE_MODE)
        write_all(fd, data)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    os.close(fd)


def open_root(path: str, *, create: bool) -> int | None:
    """An fd of the cache root ``path`` (the last component never a symlink), created
    (0700, missing parents 0700 too) when ``create``; None when it does not exist.
    Refuses a root owned by another user or writable by group/other."""
    try:
        fd = os.open(path, DIR_OPEN_FLAGS)
    except FileNotFoundError:
        if not create:
            return None
        missing = []
        probe = os.path.dirname(path)
        while not os.path.lexists(probe):
            missing.append(probe)
            probe = os.path.dirname(probe)
        for d in reversed(missing):
            try:
                os.mkdir(d, DIR_MODE)
            except FileExistsError:
                pass
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass
        return open_root(path, create=False)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CacheSecurityError(
                f"refusing cache dir {path!r}: it is a symlink or not a directory. "
                "Point cache_dir at a real directory you own."
            ) from None
        raise
    return _owned_dir(fd, path, f"refusing cache dir {path!r}", private=True)


def _owned_dir(fd: int, name: str, refusing: str, *, private: bool = False) -> int:
    """``fd`` when it is a directory we own (and, when ``private``, writable by no one
    else); otherwise it is closed and the refusal raised, worded ``refusing ...: why``."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise CacheSecurityError(f"{refusing}: not a directory")
        _check_owner(st, name)
        if private and st.st_mode & 0o022:
            raise CacheSecurityError(
                f"{refusing}: it is writable by {'group' if st.st_mode & 0o020 else 'others'} "
                f"(mode {stat.S_IMODE(st.st_mode):o}), so another user could plant code in it. "
                f"Fix: chmod 700 {name}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: str, data: bytes) -> None:
    """Write a new file with mode 0600 and fsync it (the caller renames it into place)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_private(path: str, *, root: str) -> bytes:
    check_file(path, root=root)
    with open(path, "rb") as f:
        return f.read()


def flock(fd: int, operation: int) -> bool:
    """flock ``fd``; False only when a non-blocking request finds it held. A
    filesystem without flock counts as unlocked (never blocks, never fails)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, operation)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return False
        return True
    return True
