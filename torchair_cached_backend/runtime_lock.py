"""Where an entry's run-time caches live, who may write them, and setting one aside.

A writer holds an exclusive ``flock`` on the cache directory from its creation until it is
sealed; verifying takes the entry's ``files/`` directory's shared lock, and setting aside,
creating, installing and sealing its exclusive one. A cache that is not trusted is moved
(with its seal) into ``<root>/quarantine/``, reported once and counted, never deleted.
"""

from __future__ import annotations

import os
import stat
import time
import uuid

from . import fs_security as fs
from .logs import log
from .runtime_seal import seal_name
from .stats import record
from .store_layout import QUARANTINE_DIR

_LOCK_SH = 1 if fs.fcntl is None else fs.fcntl.LOCK_SH
_LOCK_EX = 2 if fs.fcntl is None else fs.fcntl.LOCK_EX
_LOCK_NB = 4 if fs.fcntl is None else fs.fcntl.LOCK_NB


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
