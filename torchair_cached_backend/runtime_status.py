"""What state an entry's run-time caches are in, for ``torchair-cache ls`` / ``validate``.

``ls`` looks without hashing (a seal that passes its own checks and lists exactly the files
there, with their sizes: ``sealed``); ``validate`` hashes every byte against the seal and
sets a broken cache aside as :func:`runtime_cache.prepare` would (into ``quarantine/``,
under the entry's ``files/`` exclusive lock, after checking again under it), so the next
start lets GE rebuild it instead of finding it then. A cache some process is still writing
(it holds the directory's lock until it seals) is reported as such and never touched.
"""

from __future__ import annotations

import os

from . import fs_security as fs
from .runtime_lock import _LOCK_EX, _LOCK_NB, _LOCK_SH, _layout, _open_files_dir, set_aside
from .runtime_seal import SUBDIRS, SealMismatch, _read_seal, parse_seal
from .runtime_verify import _scan, check

SEALED, UNSEALED, WRITING, BROKEN = "sealed", "unsealed", "being written", "broken"


class Status:
    """One run-time cache of an entry: its name, bytes, state and (when not sealed) why."""

    __slots__ = ("name", "size", "state", "detail")

    def __init__(self, name: str, size: int, state: str, detail: str = "") -> None:
        self.name, self.size, self.state, self.detail = name, size, state, detail

    def __repr__(self) -> str:
        return f"Status({self.name!r}, {self.size}, {self.state!r}, {self.detail!r})"


def _one(files_dir: str, files_fd: int, subdir: str, key: str, deep: bool) -> Status | None:
    """The state of ``subdir`` (None when the entry has none)."""
    try:
        raw = _read_seal(files_fd, subdir)
    except (SealMismatch, OSError) as exc:
        return Status(subdir, 0, BROKEN, str(exc))
    try:
        fd = fs.open_dir(subdir, dir_fd=files_fd, root=files_dir)
    except FileNotFoundError:
        return None if raw is None else Status(subdir, 0, BROKEN, "sealed but its directory is missing")
    except (OSError, fs.CacheSecurityError) as exc:
        return Status(subdir, 0, BROKEN, f"not a directory of ours ({exc})")
    try:
        if not fs.flock(fd, _LOCK_SH | _LOCK_NB):
            return Status(subdir, 0, WRITING, "a process is writing it (GE's first run has not returned)")
        size = 0
        try:
            found = _scan(fd)
            size = sum(st.st_size for st in found.values())
            if raw is None:
                if not found:
                    return Status(subdir, 0, UNSEALED, "empty")
                return Status(subdir, size, UNSEALED, "no seal: its writer stopped mid-write (set aside at the "
                              "next start)")
            sealed = parse_seal(raw, key, subdir)
            if deep:
                check(fd, sealed)
            elif {rel: st.st_size for rel, st in found.items()} != {rel: s for rel, (s, _) in sealed.items()}:
                raise SealMismatch("its files or their sizes differ from its seal")
        except SealMismatch as exc:
            return Status(subdir, size, BROKEN, str(exc))
        except OSError as exc:
            return Status(subdir, size, BROKEN, f"unreadable ({exc.strerror or exc})")
        return Status(subdir, size, SEALED)
    finally:
        os.close(fd)


def statuses(files_dir: str, *, deep: bool = False) -> list[Status]:
    """Every run-time cache of the entry whose files are in ``files_dir`` (``deep``: every byte
    hashed against the seal; otherwise names and sizes only)."""
    _, _, key = _layout(files_dir)
    try:
        files_fd = _open_files_dir(files_dir)
    except (OSError, fs.CacheSecurityError):
        return []
    try:
        fs.flock(files_fd, _LOCK_SH)
        return [s for s in (_one(files_dir, files_fd, sub, key, deep) for sub in SUBDIRS) if s is not None]
    finally:
        os.close(files_fd)


def validate(files_dir: str, *, fix: bool = True) -> list[Status]:
    """:func:`statuses` with every byte hashed; with ``fix``, a broken cache, or an unsealed one
    holding files that no process is writing, is checked again under the files dir's exclusive
    lock and set aside (its ``detail`` then says where). Returns every cache's status."""
    found = statuses(files_dir, deep=True)
    if not fix or not any(_bad(s) for s in found):
        return found
    _, _, key = _layout(files_dir)
    files_fd = _open_files_dir(files_dir)
    try:
        fs.flock(files_fd, _LOCK_EX)
        out = []
        for s in found:
            if _bad(s):
                again = _one(files_dir, files_fd, s.name, key, True)  # decided again under the lock
                if again is not None and _bad(again):
                    moved = set_aside(files_dir, s.name, again.detail, files_fd)
                    again.detail += "; moved to quarantine/" if moved else "; could not be moved"
                s = again or s
            out.append(s)
        return out
    finally:
        os.close(files_fd)


def _bad(s: Status) -> bool:
    return s.state == BROKEN or (s.state == UNSEALED and s.detail != "empty")


__all__ = ["BROKEN", "SEALED", "UNSEALED", "WRITING", "Status", "statuses", "validate"]
