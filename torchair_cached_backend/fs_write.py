"""Writing cache files, and the cache's checks by path (see ``fs_security``).

New files are created 0600, never through a symlink, written whole (a short write
retried, the length checked) and fsync'd before a caller renames them into place;
directories are created 0700 and checked from the cache root down. Callers reach
these through ``fs_security`` (``fs.write_at``...); a warm load never imports this.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from .fs_security import _O_CLOEXEC, _O_NOFOLLOW, DIR_MODE, FILE_MODE, CacheSecurityError, _uid


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


@contextlib.contextmanager
def new_file_at(dir_fd: int, name: str) -> Iterator[int]:
    """A new file ``name`` (0600, never through a symlink, never an existing one) in the
    directory ``dir_fd``, open for writing; if the body raises, the partial file is removed."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
    try:
        os.fchmod(fd, FILE_MODE)
        yield fd
    except BaseException:
        os.close(fd)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    os.close(fd)


def write_at(dir_fd: int, name: str, data: bytes) -> None:
    """Create ``name`` in the directory ``dir_fd`` (:func:`new_file_at`) and write all of
    ``data`` with the length checked and fsync'd."""
    with new_file_at(dir_fd, name) as fd:
        write_all(fd, data)


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
