"""Per-key compile locks: one process compiles a graph, the others wait and load it.

A lock is an ``flock`` on ``<root>/locks/<kind>-<key>.lock`` opened through the
root's directory fd (never through a symlink). It dies with its process, so a
killed holder never blocks anyone. The holder writes who it is into the file
(pid, host, since when, what), so a waiter can say who it waits for within
seconds; a holder on this host that is stopped (SIGSTOP, a debugger) is seen as such
and not waited for. Waiting is bounded (option ``lock_timeout`` /
``$TORCHAIR_CACHE_LOCK_TIMEOUT``): a holder that is stopped (SIGSTOP, a debugger,
a frozen container) costs the others at most that long, after which they compile
and serve without the lock. A lock file is deleted with its entry, by a process
holding the lock; an acquirer that finds its file unlinked under it starts over.
"""

from __future__ import annotations

import json
import os
import stat
import time

from .fs_security import FILE_OPEN_FLAGS, FILE_READ_FLAGS, fcntl, flock  # noqa: F401  (flock: re-exported)
from .logs import log

#: a waiter names the holder after this long, then every _HOLDER_REPEAT_S
HOLDER_LOG_S = 2.0
_HOLDER_REPEAT_S = 60.0
_MAX_HOLDER_BYTES = 4096


class KeyLock:
    """A held lock (``release()`` it); ``is_locked`` until released."""

    __slots__ = ("fd", "dir_fd", "name")

    def __init__(self, fd: int, dir_fd: int, name: str) -> None:
        self.fd = fd
        self.dir_fd = dir_fd
        self.name = name

    @property
    def is_locked(self) -> bool:
        return self.fd >= 0

    def unlink(self) -> None:
        """Delete the lock file while holding it (its entry is gone)."""
        try:
            st = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
            mine = os.fstat(self.fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(self.name, dir_fd=self.dir_fd)
        except OSError:
            pass

    def release(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)  # releases the flock


def _open_lock_file(dir_fd: int, name: str) -> int:
    fd = os.open(name, os.O_RDWR | os.O_CREAT | FILE_OPEN_FLAGS, 0o600, dir_fd=dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
        os.close(fd)
        from .fs_security import CacheSecurityError

        raise CacheSecurityError(f"refusing lock file {name!r}: not a regular file we own (planted?)")
    return fd


def _still_named(fd: int, dir_fd: int, name: str) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _write_holder(fd: int, what: str) -> None:
    import socket

    info = {"pid": os.getpid(), "host": socket.gethostname(), "pidns": _pid_namespace(), "since": time.time(),
            "what": what}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
    except OSError:
        pass  # only informative


def holder_info(dir_fd: int, name: str) -> dict | None:
    """Who holds the lock ``name`` (as its holder wrote it), or None."""
    from .store_layout import loads_bounded

    try:
        fd = os.open(name, FILE_READ_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        info = loads_bounded(os.pread(fd, _MAX_HOLDER_BYTES, 0) or b"null")
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return info if isinstance(info, dict) else None


def describe_holder(info: dict | None) -> str:
    if not info:
        return "a process that has not said who it is"
    since = info.get("since")
    ago = f", holding it for {time.time() - since:.0f}s" if isinstance(since, (int, float)) else ""
    return f"pid {info.get('pid')} on host {info.get('host')}{ago} ({info.get('what')})"


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _stopped_here(info: dict | None) -> bool:
    """Whether the holder is a process on this host that is stopped or traced (its
    ``/proc/<pid>/stat`` state is T or t): it will not let go while stopped."""
    if not info or not isinstance(info.get("pid"), int) or info["pid"] <= 0:
        return False
    import socket

    if info.get("host") != socket.gethostname() or info.get("pidns") != _pid_namespace():
        return False
    try:
        with open(f"/proc/{info['pid']}/stat", "rb") as f:
            stat_line = f.read(4096)
    except OSError:
        return False
    state = stat_line.rpartition(b")")[2].split()[:1]
    return state in ([b"T"], [b"t"])


def acquire(dir_fd: int, name: str, *, timeout: float, what: str) -> KeyLock | None:
    """Take the lock ``name`` in the directory ``dir_fd``, waiting at most
    ``timeout`` seconds (None on timeout). OSError when the file cannot be
    created (the caller degrades to no lock)."""
    t0 = time.monotonic()
    deadline = t0 + max(timeout, 0.0)
    logged = checked = None
    poll = 0.005
    while True:
        fd = _open_lock_file(dir_fd, name)
        try:
            while not flock(fd, (fcntl.LOCK_EX | fcntl.LOCK_NB) if fcntl else 0):
                now = time.monotonic()
                if now >= deadline:
                    log.warning("npu_cached: gave up waiting %.0fs for the lock of %s held by %s; compiling without it "
                                "(raise option lock_timeout / $TORCHAIR_CACHE_LOCK_TIMEOUT to wait longer)",
                                timeout, what, describe_holder(holder_info(dir_fd, name)))
                    os.close(fd)
                    return None
                if now - t0 >= HOLDER_LOG_S and (checked is None or now - checked >= 1.0):
                    checked = now
                    info = holder_info(dir_fd, name)
                    if _stopped_here(info):
                        log.warning("npu_cached: the lock of %s is held by %s, which is stopped (SIGSTOP or a "
                                    "debugger); compiling without it", what, describe_holder(info))
                        os.close(fd)
                        return None
                    if logged is None or now - logged >= _HOLDER_REPEAT_S:
                        logged = now
                        log.warning("npu_cached: waiting for the lock of %s, held by %s; giving up after %.0fs",
                                    what, describe_holder(info), timeout)
                time.sleep(min(poll, max(deadline - now, 0.0)))
                poll = min(poll * 2, 0.05)
            if not _still_named(fd, dir_fd, name):  # deleted with its entry while we waited: start over
                os.close(fd)
                continue
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        _write_holder(fd, what)
        return KeyLock(fd, dir_fd, name)


def try_acquire(dir_fd: int, name: str) -> KeyLock | None | bool:
    """The lock if free (a KeyLock), False if held, True if there is no lock file
    (nobody holds it). Never blocks, never creates a lock file."""
    try:
        fd = os.open(name, os.O_RDWR | FILE_OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return True
    if not flock(fd, (fcntl.LOCK_EX | fcntl.LOCK_NB) if fcntl else 0):
        os.close(fd)
        return False
    return KeyLock(fd, dir_fd, name)
