"""Filesystem rules for the cache: owned by us, no planted symlinks, private modes.

A cache entry is code we execute (bytecode, generated Python, shared
libraries), so whoever can write the cache can run code as the user. We only
use directories the current user owns and refuse symlinks inside the cache.
"""

from __future__ import annotations

import os
import stat

DIR_MODE = 0o700
FILE_MODE = 0o600


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
