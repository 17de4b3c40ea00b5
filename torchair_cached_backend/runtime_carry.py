"""Carrying sealed run-time caches (bundles, the remote, a read-only base) in bounded memory.

GE's compiled models are often GBs, so a carried cache is never held whole: a sealed cache
on disk is read file by file through :meth:`Sealed.open` (a reader that checks each file's
size and sha256 against the seal as it streams, and fails at its end otherwise), and a
carried one is written through :class:`Staging`: each file streamed into a temporary
directory next to the cache (``.<cache>.tmp-*``, fsync'd, sha256 checked while written),
renamed into place only when every file the seal lists passed, then the seal written.
A crash midway leaves only the temporary directory, which no reader looks at and the next
writer removes (``runtime_lock._drop_leftovers``): never a half-written cache GE could run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from . import fs_security as fs
from .logs import log
from .runtime_lock import _LOCK_EX, _layout, _open_files_dir
from .runtime_seal import SUBDIRS, SealMismatch, _read_seal, _write_seal, parse_seal, seal_name, valid_rel
from .runtime_verify import _lexists, _open_rel, check

#: bytes read or written per step when carrying a file
CHUNK = 1 << 20


class SealedReader:
    """A file of a sealed cache, read in pieces; at its end its size and sha256 must be the
    sealed ones (SealMismatch otherwise: it changed since it was verified)."""

    def __init__(self, fd: int, rel: str, size: int, digest: str) -> None:
        self._f = open(fd, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        self.rel = rel
        self._left = size
        self._digest = digest
        self._sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        if self._left == 0:
            return b""
        want = self._left if n is None or n < 0 else min(n, self._left)
        parts = []
        while want:
            data = self._f.read(min(want, CHUNK))
            if not data:
                raise SealMismatch(f"{self.rel!r} is shorter than its seal says (changed while it was read)")
            parts.append(data)
            want -= len(data)
        data = b"".join(parts)
        self._sha.update(data)
        self._left -= len(data)
        if self._left == 0:
            if self._f.read(1) or self._sha.hexdigest() != self._digest:
                raise SealMismatch(f"{self.rel!r} fails its sha256 (changed since it was verified)")
        return data

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> SealedReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def chunks_of(reader: Any, size: int = CHUNK) -> Iterator[bytes]:
    """``reader`` read ``size`` bytes at a time."""
    while True:
        data = reader.read(size)
        if not data:
            return
        yield data


class Sealed:
    """A sealed run-time cache of an entry that verified: its seal and what it lists."""

    __slots__ = ("files_dir", "subdir", "key", "seal_raw", "files")

    def __init__(self, files_dir: str, subdir: str, key: str, seal_raw: bytes, files: dict[str, tuple[int, str]]):
        self.files_dir = files_dir
        self.subdir = subdir
        self.key = key
        self.seal_raw = seal_raw
        self.files = files  # rel -> (size, sha256), as sealed

    @property
    def size(self) -> int:
        return sum(size for size, _ in self.files.values())

    def open(self, rel: str) -> SealedReader:
        """File ``rel`` (no level followed through a link), checked against the seal as it is read."""
        size, digest = self.files[rel]
        files_fd = _open_files_dir(self.files_dir)
        try:
            dfd = fs.open_dir(self.subdir, dir_fd=files_fd, root=self.files_dir)
        finally:
            os.close(files_fd)
        try:
            fd = _open_rel(dfd, rel)
        finally:
            os.close(dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise SealMismatch(f"{rel!r} is not a regular file of ours")
        return SealedReader(fd, rel, size, digest)

    def copy_into(self, staging: Staging) -> None:
        """Every file into ``staging`` (which checks it against the same seal)."""
        for rel in sorted(self.files):
            with self.open(rel) as reader:
                staging.write(rel, chunks_of(reader))


def sealed_caches(files_dir: str) -> tuple[dict[str, Sealed], list[str]]:
    """The sealed run-time caches of an entry that verify now (every byte hashed, nothing kept),
    and notes naming those left out (unsealed or not matching their seal)."""
    _, _, key = _layout(files_dir)
    found: dict[str, Sealed] = {}
    notes: list[str] = []
    try:
        files_fd = _open_files_dir(files_dir)
    except (OSError, fs.CacheSecurityError):
        return found, notes
    try:
        for subdir in SUBDIRS:
            try:
                raw = _read_seal(files_fd, subdir)
                try:
                    fd = fs.open_dir(subdir, dir_fd=files_fd, root=files_dir)
                except FileNotFoundError:
                    if raw is not None:
                        notes.append(f"{subdir}: sealed but its directory is missing")
                    continue
                try:
                    if raw is None:
                        if os.listdir(fd):
                            notes.append(f"{subdir}: not sealed (left out)")
                        continue
                    sealed = parse_seal(raw, key, subdir)
                    check(fd, sealed)
                finally:
                    os.close(fd)
            except (SealMismatch, OSError, fs.CacheSecurityError) as exc:
                notes.append(f"{subdir}: {exc} (left out)")
                continue
            found[subdir] = Sealed(files_dir, subdir, key, raw, sealed)
    finally:
        os.close(files_fd)
    return found, notes


#: what a carried cache must leave free on the cache's filesystem: 5% of it, at most 1 GiB
SPARE_FRACTION, SPARE_MAX = 0.05, 1 << 30


class NoRoom(OSError):
    """A carried run-time cache that would not leave the cache's filesystem room to spare."""


def _check_room(files_fd: int, subdir: str, need: int) -> None:
    """A seal from elsewhere (the remote, a base, a bundle's copy) names how many bytes come:
    refuse them up front when they would fill the disk, which would fail the other writes of
    this process and of the host (GE then builds the cache itself, in place)."""
    st = os.fstatvfs(files_fd)
    free = st.f_bavail * st.f_frsize
    spare = min(SPARE_MAX, int(st.f_blocks * st.f_frsize * SPARE_FRACTION))
    if need + spare > free:
        mib = 1 << 20
        raise NoRoom(28, f"the run-time cache {subdir} needs {need / mib:.1f} MiB and the cache's filesystem has "
                         f"{free / mib:.1f} MiB free (keeping {spare / mib:.1f} MiB spare): not carried; free space "
                         "or move the cache root to a larger filesystem")


class Staging:
    """A carried run-time cache being written next to its place, checked file by file against
    its seal; :meth:`commit` renames it into place (the caller holds the files dir's exclusive
    lock from creation to commit), leaving it otherwise removes it. :class:`NoRoom` up front
    when the cache would not leave room to spare on the filesystem."""

    def __init__(self, files_dir: str, files_fd: int, subdir: str, seal_raw: bytes) -> None:
        if subdir not in SUBDIRS:
            raise SealMismatch(f"{subdir!r} is not a run-time cache this version knows")
        _, _, key = _layout(files_dir)
        self.sealed = parse_seal(seal_raw, key, subdir)
        _check_room(files_fd, subdir, sum(size for size, _ in self.sealed.values()))
        self.files_dir, self.files_fd, self.subdir, self.seal_raw = files_dir, files_fd, subdir, seal_raw
        self.tmp = f".{subdir}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.mkdir(self.tmp, fs.DIR_MODE, dir_fd=files_fd)
        self._fd: int | None = fs.open_dir(self.tmp, dir_fd=files_fd, root=files_dir)
        self._written: set[str] = set()
        self.committed = False

    def write(self, rel: str, chunks: Iterable[bytes]) -> None:
        """File ``rel`` from ``chunks``: SealMismatch (the file removed) unless it is exactly the sealed one."""
        if rel not in self.sealed or rel in self._written or not valid_rel(rel):
            raise SealMismatch(f"{str(rel)[:80]!r} is not a file its seal lists (or came twice)")
        size, digest = self.sealed[rel]
        assert self._fd is not None
        parts = rel.split("/")
        dfd = self._fd
        try:
            for part in parts[:-1]:
                try:
                    os.mkdir(part, fs.DIR_MODE, dir_fd=dfd)
                except FileExistsError:
                    pass
                nxt = fs.open_dir(part, dir_fd=dfd, root=self.files_dir)
                if dfd != self._fd:
                    os.close(dfd)
                dfd = nxt
            self._write_file(dfd, parts[-1], rel, chunks, size, digest)
        finally:
            if dfd != self._fd:
                os.close(dfd)
        self._written.add(rel)

    @staticmethod
    def _write_file(dfd: int, name: str, rel: str, chunks: Iterable[bytes], size: int, digest: str) -> None:
        from .fs_write import new_file_at

        sha, got = hashlib.sha256(), 0
        with new_file_at(dfd, name) as fd:  # removed unless every byte matched the seal
            for data in chunks:
                got += len(data)
                if got > size:
                    raise SealMismatch(f"{rel!r} is longer than its seal says ({size} bytes)")
                sha.update(data)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            if got != size or sha.hexdigest() != digest:
                raise SealMismatch(f"{rel!r} fails its size/sha256 check against its seal")
            os.fsync(fd)

    def commit(self) -> bool:
        """Rename the checked cache into place, then write its seal; False when the entry got
        one meanwhile (kept). SealMismatch when a file the seal lists was not written."""
        missing = sorted(set(self.sealed) - self._written)
        if missing:
            raise SealMismatch(f"{missing[0]!r} was not carried ({len(missing)} file(s) its seal lists)")
        if _lexists(self.files_fd, self.subdir) or _lexists(self.files_fd, seal_name(self.subdir)):
            return False
        assert self._fd is not None
        os.fsync(self._fd)
        os.rename(self.tmp, self.subdir, src_dir_fd=self.files_fd, dst_dir_fd=self.files_fd)
        self.committed = True
        _write_seal(files_dir_fd=self.files_fd, subdir=self.subdir, raw=self.seal_raw)
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self.committed:
            try:
                shutil.rmtree(self.tmp, dir_fd=self.files_fd)
            except OSError as exc:
                log.debug("npu_cached: cannot remove the staging directory %s: %r", self.tmp, exc)

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


Fill = Callable[[Staging], None]


def install_locked(files_dir: str, files_fd: int, subdir: str, seal_raw: bytes, fill: Fill) -> bool:
    """Carry a run-time cache into an entry that has none, under the files dir's exclusive lock
    (the caller holds it): ``fill`` writes its files into the staging. False if the entry
    already has one (kept); raises what the check or ``fill`` raised (nothing installed)."""
    if _lexists(files_fd, subdir) or _lexists(files_fd, seal_name(subdir)):
        return False
    with Staging(files_dir, files_fd, subdir, seal_raw) as staging:
        fill(staging)
        return staging.commit()


def install(files_dir: str, subdir: str, seal_raw: bytes, fill: Fill) -> bool:
    """:func:`install_locked` taking the lock; a refusal or fault is logged and False (GE then builds its own)."""
    try:
        files_fd = _open_files_dir(files_dir)
    except (OSError, fs.CacheSecurityError) as exc:
        log.warning("npu_cached: cannot install the run-time cache %s into %s (%s)", subdir, files_dir, exc)
        return False
    try:
        fs.flock(files_fd, _LOCK_EX)
        return install_locked(files_dir, files_fd, subdir, seal_raw, fill)
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be carried is rebuilt by GE
        log.warning("npu_cached: cannot install the run-time cache %s into %s (%s); GE rebuilds it", subdir,
                    files_dir, exc)
        return False
    finally:
        os.close(files_fd)


def bytes_fill(files: dict[str, bytes]) -> Fill:
    """A fill of small in-memory files (tests, tiny caches)."""
    def fill(staging: Staging) -> None:
        for rel, data in sorted(files.items()):
            staging.write(rel, [data])
    return fill


def copy_sealed(src: Sealed, files_dir: str) -> bool:
    """Copy a verified sealed cache into another entry with the same key (a base's into the local one)."""
    return install(files_dir, src.subdir, src.seal_raw, src.copy_into)
