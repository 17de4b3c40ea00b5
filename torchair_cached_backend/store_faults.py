"""Storage faults: counted, warned once per cause and filesystem with the fix, never raised.

A read that hits an OS error is a miss; a write that cannot happen (read-only or
full filesystem, no permission, I/O error, a vanished dir, a lock file that
cannot be created) publishes nothing. Roots found unwritable for good are
remembered, so a read-only cache dir is never written to again.
"""

from __future__ import annotations

import errno
import os

from .logs import warn_once
from .stats import record

#: roots a write failed on for good (read-only filesystem, no permission): never tried again
_UNWRITABLE: dict[str, OSError] = {}


def advice(exc: OSError, root: str) -> str:
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


def nearest_existing(path: str) -> str:
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def report(root: str, exc: OSError, doing: str, *, writing: bool = True, lock: bool = False) -> None:
    """Count a storage fault and warn once per cause and filesystem (a lock that
    cannot be created is its own cause: it costs coordination, not caching)."""
    record(storage_faults=1)
    if writing and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        _UNWRITABLE.setdefault(root, exc)
    try:
        device = os.stat(nearest_existing(root)).st_dev
    except OSError:
        device = -1
    cause = f"storage:{exc.errno}:{'lock' if lock else ''}:{device}"
    warn_once(cause, "npu_cached: could not %s: %s.", doing, advice(exc, root))


def write_blocker(root: str, probe_dir: str) -> OSError | None:
    """Why ``root`` cannot be written, found without writing (a read-only
    filesystem, no write permission), or None."""
    known = _UNWRITABLE.get(root)
    if known is not None:
        return known
    probe = nearest_existing(probe_dir)
    try:
        if os.statvfs(probe).f_flag & getattr(os, "ST_RDONLY", 1):
            return OSError(errno.EROFS, os.strerror(errno.EROFS), probe)
        if not os.access(probe, os.W_OK | os.X_OK):
            return PermissionError(errno.EACCES, os.strerror(errno.EACCES), probe)
    except OSError:
        return None
    return None
