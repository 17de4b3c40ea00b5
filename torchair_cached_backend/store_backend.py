"""The storage-backend protocol under :class:`~torchair_cached_backend.store.Store`,
and its local-directory implementation.

A backend holds the entries of one cache root, by ``(kind, key)``. It only moves
verified bytes: :meth:`StorageBackend.read` returns an entry whose every blob was
checked against its manifest's sha256 (raising :class:`BrokenEntry` otherwise),
:meth:`StorageBackend.publish` makes an entry visible atomically (whole or not at
all; with ``replace`` the old one stays until the new one is durable). Faults are
``OSError`` s: the :class:`Store` facade turns them into misses and warnings.

:class:`LocalDir` keeps one directory fd per root for the whole process, opened
once without following a symlink; every path below it is opened with
``openat(O_NOFOLLOW|O_DIRECTORY)`` from that fd, so swapping the root's path (or
any level below it) for a symlink mid-run changes nothing for this process. A
root on a read-only filesystem is a *read-only base*: readable, never written
(:meth:`writable` is False, the Store then skips every write). Its writes are in
``store_backend_write``, which a warm load (reads only) never imports.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from typing import Any

from . import fs_security as fs
from .store_layout import (
    FILES_DIR,
    LOCKS_DIR,
    MANIFEST,
    BrokenEntry,
    Entry,
    parse_manifest,
    sha256,
    valid_name,
)

#: the stages of a save a test may SIGKILL a process at (``store_backend_write``, tests/test_concurrency.py)
KILL_STAGES = ("between_blobs", "after_manifest", "before_rename", "after_rename")
#: test seam: called with (kind, key) after an entry was verified, before its bytes are used
AFTER_VERIFY: list[Any] = []


_ROOT_FDS: OrderedDict[str, int] = OrderedDict()
_MAX_ROOT_FDS = 128


def _writes() -> Any:
    """The write side of :class:`LocalDir` (``store_backend_write``)."""
    from . import store_backend_write

    return store_backend_write


def root_fd(root: str, *, create: bool) -> int | None:
    """The process-wide fd of ``root`` (opened once; reopened only if the directory
    was deleted). None if it does not exist and ``create`` is False."""
    fd = _ROOT_FDS.get(root)
    if fd is not None:
        try:
            if os.fstat(fd).st_nlink > 0:
                _ROOT_FDS.move_to_end(root)
                return fd
        except OSError:
            pass
        forget_root(root)
    fd = fs.open_root(root, create=create)
    if fd is None:
        return None
    _ROOT_FDS[root] = fd
    while len(_ROOT_FDS) > _MAX_ROOT_FDS:
        _, old = _ROOT_FDS.popitem(last=False)
        with contextlib.suppress(OSError):
            os.close(old)
    return fd


def forget_root(root: str) -> None:
    fd = _ROOT_FDS.pop(root, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def subdir(parent_fd: int, name: str, *, create: bool, root: str) -> int | None:
    """fd of directory ``name`` in ``parent_fd`` (never a symlink, owned by us)."""
    try:
        return fs.open_dir(name, dir_fd=parent_fd, root=root)
    except FileNotFoundError:
        if not create:
            return None
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, fs.DIR_MODE, dir_fd=parent_fd)
    return fs.open_dir(name, dir_fd=parent_fd, root=root)


class LocalDir:
    """Entries in ``<root>/<kind>/<key>/`` (see the module docstring)."""

    def __init__(self, root: str) -> None:
        self.root = root

    # -- fds --------------------------------------------------------------
    def root_fd(self, *, create: bool = False) -> int | None:
        return root_fd(self.root, create=create)

    def kind_fd(self, kind: str, *, create: bool = False) -> int | None:
        rfd = self.root_fd(create=create)
        if rfd is None:
            return None
        return subdir(rfd, kind, create=create, root=self.root)

    def entry_fd(self, kind: str, key: str) -> tuple[int, int] | None:
        """(kind fd, entry fd) or None when there is no such entry."""
        kfd = self.kind_fd(kind)
        if kfd is None:
            return None
        try:
            return kfd, fs.open_dir(key, dir_fd=kfd, root=self.root, private=True)
        except FileNotFoundError:
            os.close(kfd)
            return None
        except BaseException:
            os.close(kfd)
            raise

    def writable(self) -> bool:
        from .store_faults import write_blocker

        return write_blocker(self.root, os.path.join(self.root, "graphs")) is None

    # -- read -------------------------------------------------------------
    def verify_at(self, entry_fd: int, key: str) -> tuple[dict[str, Any], dict[str, bytes]]:
        try:
            manifest = parse_manifest(fs.read_at(entry_fd, MANIFEST, root=self.root))
        except FileNotFoundError:
            raise BrokenEntry("manifest.json is missing") from None
        if manifest.get("key") != key:
            raise BrokenEntry(f"manifest key {manifest.get('key')!r} does not match its directory {key!r}")
        infos = manifest.get("files", {})
        files: dict[str, bytes] = {}
        if not infos:
            return manifest, files
        try:
            files_fd = fs.open_dir(FILES_DIR, dir_fd=entry_fd, root=self.root, private=True)
        except FileNotFoundError:
            raise BrokenEntry("files/ is missing") from None
        try:
            for name, info in infos.items():
                if not valid_name(name):
                    raise BrokenEntry(f"manifest names blob {name!r}, which is not a plain file name (tampered?)")
                try:
                    data = fs.read_at(files_fd, name, root=self.root)
                except FileNotFoundError:
                    raise BrokenEntry(f"blob {name!r} is missing") from None
                if len(data) != info["size"]:
                    raise BrokenEntry(f"blob {name!r} is {len(data)} bytes, manifest says {info['size']} (truncated?)")
                if sha256(data) != info["sha256"]:
                    raise BrokenEntry(f"blob {name!r} fails its sha256 checksum (corrupted)")
                files[name] = data
        finally:
            os.close(files_fd)
        return manifest, files

    def read(self, kind: str, key: str) -> Entry | None:
        """The verified entry (no last-used refresh), or None if absent."""
        fds = self.entry_fd(kind, key)
        if fds is None:
            return None
        kfd, efd = fds
        try:
            st = os.fstat(efd)
            try:
                manifest, files = self.verify_at(efd, key)
            except BrokenEntry as exc:
                exc.identity = (st.st_dev, st.st_ino)
                raise
            return Entry(key=key, path=os.path.join(self.root, kind, key), manifest=manifest, files=files)
        finally:
            os.close(efd)
            os.close(kfd)

    def read_manifest(self, kind: str, key: str) -> dict[str, Any] | None:
        fds = self.entry_fd(kind, key)
        if fds is None:
            return None
        kfd, efd = fds
        try:
            try:
                return parse_manifest(fs.read_at(efd, MANIFEST, root=self.root))
            except FileNotFoundError:
                raise BrokenEntry("manifest.json is missing") from None
        finally:
            os.close(efd)
            os.close(kfd)

    def identity(self, kind: str, key: str) -> tuple[int, int] | None:
        kfd = self.kind_fd(kind)
        if kfd is None:
            return None
        try:
            st = os.stat(key, dir_fd=kfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            os.close(kfd)
        return (st.st_dev, st.st_ino)

    def keys(self, kind: str) -> list[str]:
        kfd = self.kind_fd(kind)
        if kfd is None:
            return []
        try:
            return sorted(n for n in os.listdir(kfd) if valid_name(n))
        finally:
            os.close(kfd)

    # -- write (``store_backend_write``: imported by the first write, never by a warm load) --
    def ensure_tag(self) -> None:
        _writes().ensure_tag(self)

    def publish(self, kind: str, key: str, files: dict[str, bytes], manifest: dict[str, Any], *,
                replace: bool = False) -> bool:
        return _writes().publish(self, kind, key, files, manifest, replace=replace)

    def rewrite_manifest(self, entry_fd: int, manifest: dict[str, Any]) -> None:
        """Replace an entry's manifest in place: new file, length checked, fsync, rename."""
        _writes().rewrite_manifest(self, entry_fd, manifest)

    def unpublish(self, kind: str, key: str, identity: tuple[int, int] | None = None) -> bool:
        """Rename the entry away (only if it is still ``identity``) and delete it."""
        return _writes().unpublish(self, kind, key, identity)

    def remove(self, kind: str, key: str) -> bool:
        return self.unpublish(kind, key)

    def move_to_quarantine(self, kind: str, key: str, identity: tuple[int, int] | None) -> str | None:
        """Move the entry to ``quarantine/`` if it is still ``identity``; the new name or None."""
        return _writes().move_to_quarantine(self, kind, key, identity)

    def sweep(self, kind: str, max_age_s: float) -> int:
        return _writes().sweep(self, kind, max_age_s)

    def locks_fd(self, *, create: bool) -> int | None:
        rfd = self.root_fd(create=create)
        if rfd is None:
            return None
        return subdir(rfd, LOCKS_DIR, create=create, root=self.root)


def _exists_at(kfd: int, key: str, *, entry_only: bool = True) -> bool:
    """Whether ``key`` is a published entry (has a manifest) in the kind dir ``kfd``."""
    try:
        efd = fs.open_dir(key, dir_fd=kfd, root="")
    except FileNotFoundError:
        return False
    except (OSError, fs.CacheSecurityError):
        return not entry_only
    try:
        os.stat(MANIFEST, dir_fd=efd, follow_symlinks=False)
        return True
    except OSError:
        return not entry_only
    finally:
        os.close(efd)


def __getattr__(name: str) -> Any:
    if name == "StorageBackend":  # the protocol (``store_protocol``): for type checkers and remote tiers
        from .store_protocol import StorageBackend

        return StorageBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
