"""The on-disk store: one directory per entry, a JSON manifest plus blobs.

Writes go to a temporary directory that is renamed into place, so a reader
sees a whole entry or none, and a crash mid-write loses nothing that was
already cached. Every load verifies every blob's sha256; a broken entry is
moved to ``quarantine/`` (never deleted, never run) and reported once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import Any

from . import fs_security as fs
from .logs import log
from .stats import record

MANIFEST = "manifest.json"
FILES_DIR = "files"
TAG = "CACHEDIR.TAG"
_TAG_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This directory is a torchair_cached_backend compile cache.\n"
    "# See https://bford.info/cachedir/ and `python -m torchair_cached_backend --help`.\n"
)
#: last_used is rewritten at most this often, so hits stay read-only in steady state
_TOUCH_INTERVAL_S = 3600.0


class BrokenEntry(Exception):
    """An entry failed verification; the message says which check."""


class Entry:
    """A verified entry: its manifest and blobs (a plain class: this is the warm path)."""

    __slots__ = ("key", "path", "manifest", "files")

    def __init__(self, key: str, path: str, manifest: dict[str, Any], files: dict[str, bytes]) -> None:
        self.key = key
        self.path = path
        self.manifest = manifest
        self.files = files

    @property
    def files_dir(self) -> str:
        return os.path.join(self.path, FILES_DIR)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Store:
    """Entries of one kind (``graphs`` or ``programs``) under a cache root."""

    def __init__(self, root: str, kind: str) -> None:
        self.root = os.path.abspath(root)
        self.kind = kind
        self.dir = os.path.join(self.root, kind)
        self._ready = False

    # -- layout ---------------------------------------------------------
    def _prepare(self) -> None:
        if self._ready:
            return
        fs.ensure_dir(self.dir, root=self.root)
        tag = os.path.join(self.root, TAG)
        if not os.path.lexists(tag):
            with contextlib.suppress(FileExistsError):
                fs.write_private(tag, _TAG_TEXT.encode())
        self._ready = True

    def entry_path(self, key: str) -> str:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"invalid cache key {key!r}")
        return os.path.join(self.dir, key)

    # -- read -----------------------------------------------------------
    def exists(self, key: str) -> bool:
        return os.path.isfile(os.path.join(self.entry_path(key), MANIFEST))

    def read_manifest(self, key: str) -> dict[str, Any] | None:
        path = os.path.join(self.entry_path(key), MANIFEST)
        if not os.path.lexists(path):
            return None
        return json.loads(fs.read_private(path, root=self.root))

    def load(self, key: str) -> Entry | None:
        """The verified entry, or None on a miss. A broken entry is
        quarantined (and None returned) so the caller rebuilds it."""
        self._prepare()
        path = self.entry_path(key)
        if not os.path.lexists(path):
            return None
        try:
            entry = self._verify(key, path)
        except fs.CacheSecurityError:
            raise
        except Exception as exc:  # corrupt JSON, missing or altered blob, ...
            self.quarantine(key, f"{type(exc).__name__}: {exc}")
            return None
        self._touch(entry)
        return entry

    def _verify(self, key: str, path: str) -> Entry:
        fs.check_dir(path, root=self.root)
        manifest = json.loads(fs.read_private(os.path.join(path, MANIFEST), root=self.root))
        if manifest.get("key") != key:
            raise BrokenEntry(f"manifest key {manifest.get('key')!r} does not match its directory {key!r}")
        files: dict[str, bytes] = {}
        for name, info in manifest.get("files", {}).items():
            data = fs.read_private(os.path.join(path, FILES_DIR, name), root=self.root)
            if len(data) != info["size"]:
                raise BrokenEntry(f"blob {name!r} is {len(data)} bytes, manifest says {info['size']} (truncated?)")
            if _sha256(data) != info["sha256"]:
                raise BrokenEntry(f"blob {name!r} fails its sha256 checksum (corrupted)")
            files[name] = data
        return Entry(key=key, path=path, manifest=manifest, files=files)

    def _touch(self, entry: Entry) -> None:
        now = time.time()
        if now - float(entry.manifest.get("last_used", 0)) < _TOUCH_INTERVAL_S:
            return
        entry.manifest["last_used"] = now
        with contextlib.suppress(OSError):
            self._write_manifest(entry.path, entry.manifest)

    # -- write ----------------------------------------------------------
    def save(self, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str | None:
        """Atomically publish an entry. If another process published the same
        key first, keep theirs. Returns the entry path, or None if nothing was written."""
        self._prepare()
        final = self.entry_path(key)
        tmp = os.path.join(self.dir, f".tmp-{key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(tmp, fs.DIR_MODE)
        try:
            os.mkdir(os.path.join(tmp, FILES_DIR), fs.DIR_MODE)
            infos = {}
            for name, data in files.items():
                if "/" in name or name.startswith("."):
                    raise ValueError(f"invalid blob name {name!r}")
                fs.write_private(os.path.join(tmp, FILES_DIR, name), data)
                infos[name] = {"size": len(data), "sha256": _sha256(data)}
            now = time.time()
            full = dict(manifest, key=key, kind=self.kind, files=infos, created=now, last_used=now)
            fs.write_private(os.path.join(tmp, MANIFEST), json.dumps(full, indent=1, default=str).encode())
            if os.path.lexists(final):
                return final if self.exists(key) else None
            os.rename(tmp, final)
            _fsync_dir(self.dir)
            return final
        finally:
            if os.path.lexists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)

    def replace(self, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> str:
        """Publish an entry, replacing an existing one (programs grow as frames compile).

        The old entry is renamed away before the new one is renamed in, so a
        reader sees the old entry, no entry, or the new one, never a mix."""
        self._prepare()
        final = self.entry_path(key)
        if os.path.lexists(final):
            self.remove(key)
        path = self.save(key, files, manifest)
        if path is None:  # lost a race with another writer: theirs is as good as ours
            return final
        return path

    def _write_manifest(self, path: str, manifest: dict[str, Any]) -> None:
        tmp = os.path.join(path, f".{MANIFEST}.{uuid.uuid4().hex[:8]}")
        fs.write_private(tmp, json.dumps(manifest, indent=1, default=str).encode())
        os.replace(tmp, os.path.join(path, MANIFEST))

    def quarantine(self, key: str, reason: str) -> None:
        """Move a broken entry aside (kept for inspection) and log why, once."""
        src = self.entry_path(key)
        qdir = fs.ensure_dir(os.path.join(self.root, "quarantine"), root=self.root)
        dst = os.path.join(qdir, f"{self.kind}-{key[:32]}-{int(time.time())}-{uuid.uuid4().hex[:6]}")
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            return  # another process moved it already
        record(quarantined=1)
        log.warning("cache entry %s/%s is broken (%s); moved to %s and rebuilding", self.kind, key[:12], reason, dst)

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float = 3600.0) -> Iterator[None]:
        """Cross-process lock per key: one process compiles, the others wait and load."""
        from filelock import FileLock

        self._prepare()
        lock_dir = fs.ensure_dir(os.path.join(self.root, "locks"), root=self.root)
        with FileLock(os.path.join(lock_dir, f"{self.kind}-{key[:32]}.lock"), timeout=timeout, mode=fs.FILE_MODE):
            yield

    def remove(self, key: str) -> bool:
        path = self.entry_path(key)
        if not os.path.lexists(path):
            return False
        fs.check_dir(path, root=self.root)
        trash = os.path.join(self.dir, f".trash-{key[:16]}-{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)  # atomic unpublish first, then delete
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def keys(self) -> list[str]:
        if not os.path.isdir(self.dir):
            return []
        return sorted(k for k in os.listdir(self.dir) if not k.startswith("."))


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
