"""Filesystem rules for the cache: owned by us, no planted symlinks, private modes.

A cache entry is code we execute (bytecode, generated Python, shared
libraries), so whoever can write the cache can run code as the user. We only
use directories the current user owns and refuse symlinks inside the cache.
This module reads through directory fds (what every warm load does); creating and
writing files, and the checks by path, are ``fs_write`` (re-exported here).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

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
#: flags of every open of a file of the cache (entries, seals, the ledger, lock files): never through a
#: symlink, and never blocking (a FIFO put where a file was expected would hold ``open`` until a writer
#: came: the caller's start hung). I/O on a regular file ignores O_NONBLOCK; every opener then refuses
#: what ``fstat`` says is not a regular file
FILE_OPEN_FLAGS = _O_NOFOLLOW | _O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)
FILE_READ_FLAGS = os.O_RDONLY | FILE_OPEN_FLAGS


class CacheSecurityError(PermissionError):
    """The cache dir is unsafe to use; the message says why and what to do."""


def _uid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


def _check_owner(st: os.stat_result, path: str) -> None:
    uid = _uid()
    if uid >= 0 and st.st_uid != uid:
        raise CacheSecurityError(
            f"refusing cache path {path!r}: owned by uid {st.st_uid}, not by the current user (uid {uid}). "
            "Another user could plant code there. Use a cache_dir you own, or chown it."
        )


def open_dir(name: str, *, dir_fd: int | None = None, root: str, private: bool = False) -> int:
    """Open a cache directory (``name`` relative to ``dir_fd`` when given) without
    following a symlink, and check it is a directory we own (and, when ``private``,
    writable by no one else: an entry's directories). Returns the fd.

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
    return _owned_dir(fd, name, f"refusing cache path {name!r} in {root!r}", private=private)


def read_at(dir_fd: int, name: str, *, root: str) -> bytes:
    """The bytes of regular file ``name`` in the directory ``dir_fd``; refuses a
    symlink, a file owned by someone else, and one others may write (they could change
    it and, the manifest being writable too, its checksum: ours are written 0600)."""
    try:
        fd = os.open(name, FILE_READ_FLAGS, dir_fd=dir_fd)
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
        _check_private(st, f"refusing cache file {name!r}", f"(Planted in {root!r}?)")
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
        if private:
            _check_private(st, refusing, f"Fix: chmod 700 {name}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_private(st: os.stat_result, refusing: str, then: str) -> None:
    """Refuse what group or others may write: they could plant code in it (or, in a file, change
    its bytes and, the manifest being writable too, its checksum: ours are written 0600/0700)."""
    if st.st_mode & 0o022:
        raise CacheSecurityError(
            f"{refusing}: it is writable by {'group' if st.st_mode & 0o020 else 'others'} "
            f"(mode {stat.S_IMODE(st.st_mode):o}), so another user could plant code in it. {then}"
        )


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


#: writing, and the checks by path (``fs_write``): imported by the first write, never by a warm load
_WRITE_SIDE = frozenset({"check_dir", "ensure_dir", "check_file", "write_all", "write_at", "write_private",
                         "read_private"})


def __getattr__(name: str) -> Any:
    if name in _WRITE_SIDE:
        from . import fs_write

        return getattr(fs_write, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
