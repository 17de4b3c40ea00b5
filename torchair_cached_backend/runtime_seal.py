"""The seal of a GE / torchair run-time cache: its format, its bounds, and its bytes on disk.

``<entry>/files/<cache>.seal.json`` lists every file's relative path, size and sha256,
bound to the entry's key and the cache's name, with a digest of its own; it is written to
a temporary name, fsync'd and renamed (a crash leaves the old seal or none, never one that
lies), and read without following a link. A seal is untrusted input until
:func:`parse_seal` checked its bounds, schema, binding and digest.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import uuid
from typing import Any

from . import fs_security as fs
from .store_layout import loads_bounded

#: the run-time cache directories the project points GE / torchair at inside an entry's files
SUBDIRS = ("ge_cache", "fw.ge_cache", "bw.ge_cache", "static_kernels")
SEAL_SUFFIX = ".seal.json"
SEAL_FORMAT = "tcb-runtime-cache-seal"
SEAL_VERSION = 1
#: bounds on what a seal may describe (a seal is untrusted input until checked)
MAX_DEPTH = 8
MAX_FILES = 100_000
MAX_SEAL_BYTES = 64 << 20


class SealMismatch(Exception):
    """A run-time cache that does not match its seal (or has none); the message says which check."""


def seal_name(subdir: str) -> str:
    return subdir + SEAL_SUFFIX


def plain_name(name: Any) -> bool:
    """One path component GE may write: not empty, ``.`` or ``..``, no separator or NUL
    (hidden names allowed: GE's own index and lock files may be)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def valid_rel(rel: Any) -> bool:
    """A relative path inside a run-time cache: 1..MAX_DEPTH plain names joined by ``/``."""
    if not isinstance(rel, str):
        return False
    parts = rel.split("/")
    return 0 < len(parts) <= MAX_DEPTH and all(plain_name(p) for p in parts)


# ---------------------------------------------------------------- seal bytes
def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def encode_seal(key: str, subdir: str, files: dict[str, tuple[int, str]]) -> bytes:
    """The seal of ``files`` (rel -> (size, sha256)) of run-time cache ``subdir`` of entry ``key``."""
    body: dict[str, Any] = {
        "format": SEAL_FORMAT, "version": SEAL_VERSION, "key": key, "cache": subdir,
        "files": {rel: {"size": size, "sha256": digest} for rel, (size, digest) in sorted(files.items())},
    }
    body["digest"] = hashlib.sha256(_canonical(body)).hexdigest()
    return _canonical(body)


def parse_seal(raw: bytes, key: str, subdir: str) -> dict[str, tuple[int, str]]:
    """rel -> (size, sha256) of a seal, after its bounds, schema, binding and digest checks."""
    if len(raw) > MAX_SEAL_BYTES:
        raise SealMismatch(f"its seal is {len(raw)} bytes, over {MAX_SEAL_BYTES}")
    try:
        body = loads_bounded(raw)
    except ValueError as exc:
        raise SealMismatch(f"its seal is not valid JSON ({exc}); truncated?") from None
    if not isinstance(body, dict) or body.get("format") != SEAL_FORMAT or body.get("version") != SEAL_VERSION:
        raise SealMismatch("its seal has another format")
    digest = body.pop("digest", None)
    if not isinstance(digest, str) or hashlib.sha256(_canonical(body)).hexdigest() != digest:
        raise SealMismatch("its seal fails its own digest (corrupted or altered)")
    if body.get("key") != key or body.get("cache") != subdir:
        raise SealMismatch(f"its seal belongs to {str(body.get('key'))[:12]}/{body.get('cache')}, not {key[:12]}/{subdir}")
    files = body.get("files")
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise SealMismatch("its seal's file list is malformed")
    out: dict[str, tuple[int, str]] = {}
    for rel, info in files.items():
        ok = (valid_rel(rel) and isinstance(info, dict) and type(info.get("size")) is int and info["size"] >= 0
              and isinstance(info.get("sha256"), str) and len(info["sha256"]) == 64)
        if not ok:
            raise SealMismatch(f"its seal's record of {str(rel)[:80]!r} is malformed")
        out[rel] = (info["size"], info["sha256"])
    return out


def _read_seal(files_fd: int, subdir: str) -> bytes | None:
    try:
        fd = os.open(seal_name(subdir), fs.FILE_READ_FLAGS, dir_fd=files_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SealMismatch("its seal is a symlink") from None
        raise
    with open(fd, "rb", buffering=0) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise SealMismatch("its seal is not a regular file of ours")
        return f.read(MAX_SEAL_BYTES + 1)


def _read_seal_quiet(files_fd: int, subdir: str) -> bytes | None:
    try:
        return _read_seal(files_fd, subdir)
    except (OSError, SealMismatch):
        return None


def _write_seal(*, files_dir_fd: int, subdir: str, raw: bytes) -> None:
    """Temp file (0600, fsync'd) renamed over the seal, then the directory fsync'd."""
    tmp = f".{seal_name(subdir)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fs.write_at(files_dir_fd, tmp, raw)
    try:
        os.rename(tmp, seal_name(subdir), src_dir_fd=files_dir_fd, dst_dir_fd=files_dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=files_dir_fd)
        except OSError:
            pass
        raise
    os.fsync(files_dir_fd)
