"""Checking a run-time cache directory against its seal, through directory fds.

Every level is opened without following a link; a symlink, a special file, a foreign
owner, an odd name, too deep a tree or too many files is a :class:`SealMismatch`, as is a
missing, extra, resized or changed file. Files are hashed in pieces (nothing is kept).
"""

from __future__ import annotations

import hashlib
import os
import stat

from . import fs_security as fs
from .runtime_seal import MAX_DEPTH, MAX_FILES, SealMismatch, plain_name


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
        return os.open(parts[-1], fs.FILE_READ_FLAGS, dir_fd=fd)
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


def _lexists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except OSError:
        return False
