"""Bundles: a cache packed into one tar archive, built once and shipped to a fleet.

Members: every file of every entry, ``cache/<root>/<kind>/<key>/manifest.json`` and
``.../files/<name>`` (``<root>`` is the entry's cache root relative to the packed
directory, so a ``cache_compile`` tree unpacks into the same layout), and a graph's
sealed run-time caches (GE's compiled model, torchair's static kernels:
``.../files/<cache>.seal.json`` and ``.../files/<cache>/<path>``, checked against
their seal when packed; an unsealed one is left out with a note); then
``torchair-bundle.json``, the bundle manifest (each entry with the versions it was
built under, and the size and sha256 of every member); and, when
``TORCHAIR_CACHE_KEY`` is set, ``torchair-bundle.sig``: the manifest's HMAC-SHA256.

Unpacking trusts nothing in the archive. Member names are compared with names
derived from the manifest, never used as paths; an absolute path, ``..``, a
symlink, hard link, device, fifo or directory, a member not in the manifest, and
sizes over the limits refuse the whole bundle before anything is written. With
``TORCHAIR_CACHE_KEY`` set an unsigned or altered bundle is refused. Entries are
staged in the stores' temporary directories and checked (every member's sha256,
each entry's own manifest against the bundle's, each run-time cache against its
seal), and only when all of them pass
is each one published with an atomic rename.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import shutil
import tarfile
import time
import uuid
from typing import Any

from . import fs_security as fs
from . import runtime_cache, runtime_carry
from .inventory import _MAX_DEPTH, find_entries
from .logs import log
from .runtime_carry import Sealed, sealed_caches
from .store import (
    FILES_DIR,
    KINDS,
    LOCKS_DIR,
    MANIFEST,
    QUARANTINE_DIR,
    TAG,
    BrokenEntry,
    Store,
    loads_bounded,
    parse_manifest,
    valid_name,
)

BUNDLE_MANIFEST = "torchair-bundle.json"
SIGNATURE = "torchair-bundle.sig"
FORMAT = "torchair-cache-bundle"
FORMAT_VERSION = 1
KEY_ENV = "TORCHAIR_CACHE_KEY"
_MEMBER_PREFIX = "cache"
_MAX_MANIFEST_BYTES = 64 << 20
_CHUNK = 1 << 20
_COMPRESSIONS = {"none": "", "gz": "gz", "xz": "xz"}


class BundleError(Exception):
    """A bundle that is refused or cannot be made; the message names the problem and the fix."""


class Limits:
    """Bounds on what unpack/verify accept (a bundle is not trusted to be small)."""

    __slots__ = ("max_member_size", "max_total_size", "max_members")

    def __init__(self, max_member_size: int = 4 << 30, max_total_size: int = 64 << 30, max_members: int = 100_000):
        self.max_member_size = max_member_size
        self.max_total_size = max_total_size
        self.max_members = max_members


def signing_key(key: str | bytes | None = None) -> bytes | None:
    """``key``, else ``$TORCHAIR_CACHE_KEY``, as bytes (None when neither is set).

    A key that is set but empty is an error, never "no key": ``KEY=$SECRET`` with
    ``$SECRET`` unset must not accept (or make) unsigned bundles."""
    where = "the signing key"
    if key is None:
        if KEY_ENV not in os.environ:
            return None
        key, where = os.environ[KEY_ENV], f"${KEY_ENV}"
    if isinstance(key, str):
        key = key.encode()
    if not key.strip():
        raise BundleError(
            f"{where} is set but empty: refusing to go on without the signature check. Set it to the secret "
            f"(e.g. {KEY_ENV}=\"$(cat /run/secrets/cache-key)\"), or unset it to use unsigned bundles"
        )
    return key


def compression_of(path: str, compression: str | None = None) -> str:
    """``none``/``gz``/``xz``: as given, else from the file name (``.tar.gz``/``.tgz``, ``.tar.xz``/``.txz``)."""
    if compression is not None:
        if compression not in _COMPRESSIONS:
            raise BundleError(f"unknown compression {compression!r}; use one of {sorted(_COMPRESSIONS)}")
        return compression
    name = path.lower()
    if name.endswith((".tar.gz", ".tgz", ".gz")):
        return "gz"
    if name.endswith((".tar.xz", ".txz", ".xz")):
        return "xz"
    return "none"


def _member_base(root: str, kind: str, key: str) -> str:
    return "/".join([_MEMBER_PREFIX, *([root] if root else []), kind, key])


def _mac(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


# ---------------------------------------------------------------------------
# pack
# ---------------------------------------------------------------------------


def pack(cache_dir: str, bundle: str, *, compression: str | None = None, key: str | bytes | None = None) -> dict[str, Any]:
    """Pack every verified entry under ``cache_dir`` (any level of a cache tree)
    into ``bundle``; broken entries are skipped and reported. Signs the manifest
    with ``key`` / ``$TORCHAIR_CACHE_KEY`` when set. Returns a summary."""
    t0 = time.perf_counter()
    cache_dir = os.path.abspath(cache_dir)
    mac_key = signing_key(key)
    located = find_entries(cache_dir)
    mode = "w:" + _COMPRESSIONS[compression_of(bundle, compression)]
    tmp = f"{bundle}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    records: list[dict[str, Any]] = []
    skipped: list[str] = []
    left_out: list[str] = []
    runtime_count = 0
    created = time.time()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, fs.FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as out:
            with tarfile.open(fileobj=out, mode=mode, format=tarfile.PAX_FORMAT) as tar:
                tar.copybufsize = _CHUNK  # members are streamed in these pieces, never read whole
                for item in located:
                    try:
                        entry = item.store.read_verified(item.key)
                    except BrokenEntry as exc:
                        skipped.append(f"{item.store.kind}/{item.key[:16]} ({exc})")
                        continue
                    if entry is None:
                        continue
                    root = "" if item.rel_root == "." else item.rel_root.replace(os.sep, "/")
                    blobs = {MANIFEST: json.dumps(entry.manifest, indent=1, default=str).encode()}
                    blobs.update({f"{FILES_DIR}/{name}": data for name, data in entry.files.items()})
                    base = _member_base(root, item.store.kind, item.key)
                    files = {}
                    for rel, data in blobs.items():
                        _add(tar, f"{base}/{rel}", data, created)
                        files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                    record = {
                        "root": root,
                        "kind": item.store.kind,
                        "key": item.key,
                        "versions": entry.manifest.get("versions"),
                        "size": sum(f["size"] for f in files.values()),
                        "files": files,
                    }
                    if item.store.kind == "graphs":
                        carried, notes = sealed_caches(entry.files_dir)
                        left_out += [f"{item.store.kind}/{item.key[:16]} {note}" for note in notes]
                        if carried:
                            record["runtime"] = _add_runtime(tar, base, carried, created)
                            record["size"] += sum(f["size"] for f in record["runtime"].values())
                            runtime_count += len(carried)
                    records.append(record)
                manifest = {
                    "format": FORMAT,
                    "version": FORMAT_VERSION,
                    "created": created,
                    "entries": records,
                    "total_size": sum(r["size"] for r in records),
                    "members": sum(len(r["files"]) for r in records),
                }
                raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
                _add(tar, BUNDLE_MANIFEST, raw, created)
                if mac_key:
                    sig = {"algorithm": "HMAC-SHA256", "mac": _mac(mac_key, raw)}
                    _add(tar, SIGNATURE, json.dumps(sig).encode(), created)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, bundle)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    for line in skipped:
        log.warning("torchair-cache pack: skipped broken entry %s", line)
    for line in left_out:
        log.warning("torchair-cache pack: left out the run-time cache of %s", line)
    return {
        "bundle": bundle,
        "entries": len(records),
        "skipped_broken": skipped,
        "runtime_caches": runtime_count,
        "runtime_caches_left_out": left_out,
        "payload_bytes": manifest["total_size"],
        "bundle_bytes": os.path.getsize(bundle),
        "signed": bool(mac_key),
        "seconds": time.perf_counter() - t0,
    }


def _add_runtime(tar: tarfile.TarFile, base: str, carried: dict[str, Sealed], mtime: float) -> dict[str, dict[str, Any]]:
    """Add an entry's verified run-time caches with their seals, each file streamed from disk and
    checked against its seal as it goes (one that changed since it was verified fails the pack);
    their member records."""
    out: dict[str, dict[str, Any]] = {}
    for subdir, sealed in sorted(carried.items()):
        rel = f"{FILES_DIR}/{runtime_cache.seal_name(subdir)}"
        _add(tar, f"{base}/{rel}", sealed.seal_raw, mtime)
        out[rel] = {"size": len(sealed.seal_raw), "sha256": hashlib.sha256(sealed.seal_raw).hexdigest()}
        for path, (size, digest) in sorted(sealed.files.items()):
            rel = f"{FILES_DIR}/{subdir}/{path}"
            info = tarfile.TarInfo(f"{base}/{rel}")
            info.size, info.mode, info.mtime = size, 0o600, int(mtime)
            try:
                with sealed.open(path) as reader:
                    tar.addfile(info, reader)
            except runtime_cache.SealMismatch as exc:
                raise BundleError(f"the run-time cache {subdir} of {base}: {exc}; pack again") from None
            out[rel] = {"size": size, "sha256": digest}
    return out


def _runtime_member(rel: str) -> tuple[str, str | None] | None:
    """(cache, path inside it) of a run-time cache member ``files/<cache>/<path>``, (cache, None)
    for its seal ``files/<cache>.seal.json``; None for anything else."""
    head, _, rest = rel.partition("/")
    if head != FILES_DIR:
        return None
    for subdir in runtime_cache.SUBDIRS:
        if rest == runtime_cache.seal_name(subdir):
            return subdir, None
        if rest.startswith(subdir + "/") and runtime_cache.valid_rel(rest[len(subdir) + 1:]):
            return subdir, rest[len(subdir) + 1:]
    return None


def _check_runtime(bundle: str, e: dict[str, Any], seals: dict[str, bytes]) -> None:
    """Each run-time cache an entry carries must be exactly what its seal (bound to the entry) lists."""
    where = f"bundle {bundle}: entry {e['kind']}/{e['key'][:16]}"
    groups: dict[str, dict[str, tuple[int, str]]] = {}
    for rel, info in e.get("runtime", {}).items():
        subdir, path = _runtime_member(rel)  # type: ignore[misc]  (checked by _expected_members)
        group = groups.setdefault(subdir, {})
        if path is not None:
            group[path] = (info["size"], info["sha256"])
    for subdir, group in groups.items():
        if subdir not in seals:
            raise BundleError(f"{where}: its run-time cache {subdir} has no seal; refusing (nothing was published)")
        try:
            sealed = runtime_cache.parse_seal(seals[subdir], e["key"], subdir)
        except runtime_cache.SealMismatch as exc:
            raise BundleError(f"{where}: the run-time cache {subdir}: {exc}; refusing (nothing was published)") from None
        if sealed != group:
            raise BundleError(f"{where}: the run-time cache {subdir} carried does not match its seal; refusing "
                              "(nothing was published)")


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o600
    info.mtime = int(mtime)
    tar.addfile(info, io.BytesIO(data))


# ---------------------------------------------------------------------------
# reading: every check that needs no write
# ---------------------------------------------------------------------------


class _Scanned:
    __slots__ = ("manifest", "members", "expected", "signature")

    def __init__(self, manifest: dict[str, Any], members: dict[str, tarfile.TarInfo],
                 expected: dict[str, dict[str, Any]], signature: str) -> None:
        self.manifest = manifest
        self.members = members
        self.expected = expected  # member name -> {"size", "sha256"}
        self.signature = signature  # "verified" | "unsigned" | "not checked"


#: no single read of the tar stream may be larger (a PAX / GNU long-name header is read whole by
#: tarfile before any limit could apply: this bounds memory before parsing)
MAX_READ = _CHUNK + 512


class _CappedReads:
    """A file wrapper that refuses any single read larger than :data:`MAX_READ`."""

    def __init__(self, inner: Any, bundle: str) -> None:
        self._inner = inner
        self._bundle = bundle

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > MAX_READ:
            raise BundleError(
                f"bundle {self._bundle} has a tar header or record of {size} bytes (over {MAX_READ}): a header bomb? "
                "Refusing it (nothing was written); make bundles with `torchair-cache pack`"
            )
        return self._inner.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._inner.seek(offset, whence)

    def tell(self) -> int:
        return self._inner.tell()

    def close(self) -> None:
        self._inner.close()


def _decompressed(raw: Any) -> Any:
    """The tar stream of ``raw`` (gzip / xz / bzip2 by magic bytes, else as is)."""
    magic = raw.read(6)
    raw.seek(0)
    if magic[:2] == b"\x1f\x8b":
        import gzip

        return gzip.GzipFile(fileobj=raw, mode="rb")
    if magic == b"\xfd7zXZ\x00":
        import lzma

        return lzma.LZMAFile(raw, "rb")
    if magic[:3] == b"BZh":
        import bz2

        return bz2.BZ2File(raw, "rb")
    return raw


class _Bundle:
    """An open bundle: the tar reader and what must be closed with it."""

    def __init__(self, bundle: str) -> None:
        try:
            self._raw = open(bundle, "rb")  # noqa: SIM115 - closed in __exit__
        except FileNotFoundError:
            raise BundleError(f"bundle {bundle} does not exist") from None
        except OSError as exc:
            raise BundleError(f"cannot read bundle {bundle} ({exc.strerror or exc})") from None
        try:
            self._stream = _decompressed(self._raw)
            self.tar = tarfile.open(fileobj=_CappedReads(self._stream, bundle), mode="r:")
        except BundleError:
            self._raw.close()
            raise
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
            self._raw.close()
            raise BundleError(
                f"{bundle} is not a readable tar archive ({exc}); make bundles with `torchair-cache pack`"
            ) from None

    def __enter__(self) -> tarfile.TarFile:
        return self.tar

    def __exit__(self, *exc: Any) -> None:
        self.tar.close()
        if self._stream is not self._raw:
            self._stream.close()
        self._raw.close()


def _open(bundle: str) -> _Bundle:
    return _Bundle(bundle)


def _check_member(bundle: str, member: tarfile.TarInfo, limits: Limits) -> None:
    name = member.name
    where = f"bundle {bundle}: member {name!r}"
    if name.startswith("/") or os.path.isabs(name):
        raise BundleError(f"{where} has an absolute path; refusing the bundle (nothing was written)")
    if ".." in name.replace("\\", "/").split("/"):
        raise BundleError(f"{where} contains '..'; refusing the bundle (nothing was written)")
    kinds = [(member.issym(), "is a symlink"), (member.islnk(), "is a hard link"),
             (member.ischr() or member.isblk(), "is a device file"), (member.isfifo(), "is a fifo"),
             (member.isdir(), "is a directory")]
    for hit, what in kinds:
        if hit:
            raise BundleError(f"{where} {what}; bundles hold regular files only. Refusing (nothing was written)")
    if not member.isreg():
        raise BundleError(f"{where} is not a regular file; refusing the bundle (nothing was written)")
    if member.size > limits.max_member_size:
        raise BundleError(
            f"{where} is {member.size} bytes, over the limit of {limits.max_member_size}; refusing "
            "(raise it with --max-member-size if this bundle is trusted)"
        )


def _read_small(tar: tarfile.TarFile, member: tarfile.TarInfo, bundle: str) -> bytes:
    src = tar.extractfile(member)
    if src is None:
        raise BundleError(f"bundle {bundle}: member {member.name!r} has no data")
    chunks, size = [], 0
    while size < member.size:
        chunk = src.read(min(_CHUNK, member.size - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _check_signature(bundle: str, raw: bytes, sig_raw: bytes | None, key: bytes | None) -> str:
    if key is None:
        if sig_raw is not None:
            log.warning("bundle %s is signed but %s is not set: its signature is not checked", bundle, KEY_ENV)
            return "not checked"
        return "unsigned"
    if sig_raw is None:
        raise BundleError(
            f"bundle {bundle} is not signed and {KEY_ENV} is set: refusing it. Re-pack it with {KEY_ENV} set "
            "(the same key), or unset the key to accept unsigned bundles"
        )
    try:
        sig = loads_bounded(sig_raw)
        algorithm, mac = sig["algorithm"], sig["mac"]
    except (ValueError, KeyError, TypeError):
        raise BundleError(f"bundle {bundle}: its signature member is malformed; refusing it") from None
    if algorithm != "HMAC-SHA256" or not isinstance(mac, str) or not hmac.compare_digest(_mac(key, raw), mac):
        raise BundleError(
            f"bundle {bundle}: the signature does not match its manifest (altered, or signed with another key); "
            "refusing it (nothing was written)"
        )
    return "verified"


def _valid_root(root: Any) -> bool:
    """A root ``ls``/``validate``/``prune``/``clear`` see: at most 8 levels of plain,
    visible names that are not a cache's own dirs (no hidden ``.tmp-x/...`` roots)."""
    if root == "":
        return True
    if not isinstance(root, str):
        return False
    parts = root.split("/")
    return len(parts) <= _MAX_DEPTH and all(
        valid_name(part) and part not in (*KINDS, LOCKS_DIR, QUARANTINE_DIR) for part in parts
    )


def _expected_members(bundle: str, manifest: Any) -> dict[str, dict[str, Any]]:
    """Member name -> size/sha256 as the manifest declares them (structure checked)."""
    bad = f"bundle {bundle}: malformed manifest"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{bad} (not a {FORMAT}); make bundles with `torchair-cache pack`")
    if manifest.get("version") != FORMAT_VERSION:
        raise BundleError(f"bundle {bundle} has format version {manifest.get('version')!r}; this version reads {FORMAT_VERSION}")
    entries = manifest.get("entries")
    if not isinstance(entries, list):
        raise BundleError(f"{bad}: 'entries' is not a list")
    expected: dict[str, dict[str, Any]] = {}
    for e in entries:
        if not isinstance(e, dict) or not _valid_root(e.get("root")) or e.get("kind") not in KINDS \
                or not valid_name(e.get("key")) or not isinstance(e.get("files"), dict) or MANIFEST not in e["files"]:
            raise BundleError(f"{bad}: entry {str(e)[:120]!r}")
        base = _member_base(e["root"], e["kind"], e["key"])
        for rel, info in e["files"].items():
            head, _, name = rel.partition("/")
            if not (rel == MANIFEST or (head == FILES_DIR and valid_name(name))):
                raise BundleError(f"{bad}: entry file {rel!r} is not manifest.json or files/<name>")
            if not isinstance(info, dict) or not isinstance(info.get("size"), int) or info["size"] < 0 \
                    or not isinstance(info.get("sha256"), str) or len(info["sha256"]) != 64:
                raise BundleError(f"{bad}: record of {rel!r}")
            if f"{base}/{rel}" in expected:
                raise BundleError(f"{bad}: {base} is listed twice")
            expected[f"{base}/{rel}"] = info
        runtime = e.get("runtime", {})
        if not isinstance(runtime, dict) or (runtime and e["kind"] != "graphs"):
            raise BundleError(f"{bad}: entry {e['kind']}/{str(e['key'])[:16]} has a malformed 'runtime' record")
        for rel, info in runtime.items():
            if not isinstance(rel, str) or _runtime_member(rel) is None:
                raise BundleError(f"{bad}: run-time cache file {str(rel)[:120]!r} is not files/<cache>/<path> or "
                                  "files/<cache>.seal.json")
            if not isinstance(info, dict) or type(info.get("size")) is not int or info["size"] < 0 \
                    or not isinstance(info.get("sha256"), str) or len(info["sha256"]) != 64:
                raise BundleError(f"{bad}: record of {rel!r}")
            if f"{base}/{rel}" in expected:
                raise BundleError(f"{bad}: {base}/{rel} is listed twice")
            expected[f"{base}/{rel}"] = info
    return expected


def _scan(tar: tarfile.TarFile, bundle: str, limits: Limits, key: bytes | None) -> _Scanned:
    members: dict[str, tarfile.TarInfo] = {}
    raw = sig_raw = None
    count = 0
    while True:
        try:
            member = tar.next()
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise BundleError(f"bundle {bundle} is corrupt ({exc})") from None
        if member is None:
            break
        count += 1
        if count > limits.max_members:
            raise BundleError(f"bundle {bundle} has more than {limits.max_members} members; refusing (raise --max-members if trusted)")
        _check_member(bundle, member, limits)
        if member.name in members:
            raise BundleError(f"bundle {bundle}: member {member.name!r} appears twice; refusing it")
        members[member.name] = member
        if member.name in (BUNDLE_MANIFEST, SIGNATURE):
            if member.size > _MAX_MANIFEST_BYTES:
                raise BundleError(f"bundle {bundle}: {member.name} is {member.size} bytes; refusing it")
            data = _read_small(tar, member, bundle)
            if member.name == BUNDLE_MANIFEST:
                raw = data
            else:
                sig_raw = data
    if raw is None:
        raise BundleError(f"{bundle} has no {BUNDLE_MANIFEST}: not a bundle made by `torchair-cache pack`")
    signature = _check_signature(bundle, raw, sig_raw, key)
    try:
        manifest = loads_bounded(raw)
    except ValueError as exc:
        raise BundleError(f"bundle {bundle}: {BUNDLE_MANIFEST} is not valid JSON within bounds ({exc})") from None
    expected = _expected_members(bundle, manifest)
    total = 0
    for name, member in members.items():
        if name in (BUNDLE_MANIFEST, SIGNATURE):
            continue
        info = expected.get(name)
        if info is None:
            raise BundleError(f"bundle {bundle}: member {name!r} is not in its manifest; refusing (nothing was written)")
        if member.size != info["size"]:
            raise BundleError(f"bundle {bundle}: member {name!r} is {member.size} bytes, its manifest says {info['size']}")
        total += member.size
    missing = sorted(set(expected) - set(members))
    if missing:
        raise BundleError(f"bundle {bundle} lacks {len(missing)} member(s) its manifest lists, e.g. {missing[0]!r} (truncated?)")
    if total > limits.max_total_size:
        raise BundleError(f"bundle {bundle} unpacks to {total} bytes, over the limit of {limits.max_total_size}; "
                          "refusing (raise --max-total-size if trusted)")
    return _Scanned(manifest, members, expected, signature)


def _stream_member(tar: tarfile.TarFile, bundle: str, scanned: _Scanned, name: str, sink: Any = None) -> bytes | None:
    """Read member ``name`` in chunks, checking its size and sha256; write it to
    ``sink`` (a binary file) or return its bytes when ``sink`` is None."""
    info = scanned.expected[name]
    src = tar.extractfile(scanned.members[name])
    if src is None:
        raise BundleError(f"bundle {bundle}: member {name!r} has no data")
    digest = hashlib.sha256()
    kept = [] if sink is None else None
    size = 0
    while True:
        chunk = src.read(_CHUNK)
        if not chunk:
            break
        size += len(chunk)
        if size > info["size"]:
            break
        digest.update(chunk)
        if kept is None:
            sink.write(chunk)
        else:
            kept.append(chunk)
    if size != info["size"] or digest.hexdigest() != info["sha256"]:
        raise BundleError(f"bundle {bundle}: member {name!r} fails its sha256 checksum (corrupted or altered); "
                          "refusing the bundle (nothing was published)")
    return None if kept is None else b"".join(kept)


def _check_entry(bundle: str, e: dict[str, Any], entry_manifest: bytes) -> None:
    """The entry's own manifest must name exactly the blobs the bundle carries for it."""
    where = f"bundle {bundle}: entry {e['kind']}/{e['key'][:16]}"
    try:
        m = parse_manifest(entry_manifest)
        declared = {f"{FILES_DIR}/{n}": (i["size"], i["sha256"]) for n, i in m.get("files", {}).items()}
    except BrokenEntry as exc:
        raise BundleError(f"{where} has a malformed manifest.json ({exc})") from None
    if m.get("key") != e["key"]:
        raise BundleError(f"{where}: its manifest.json belongs to key {str(m.get('key'))[:16]!r}")
    carried = {rel: (i["size"], i["sha256"]) for rel, i in e["files"].items() if rel != MANIFEST}
    if declared != carried:
        raise BundleError(f"{where}: its manifest.json and the bundle disagree on its files")


def _entries_versions(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    for e in manifest["entries"]:
        v = e.get("versions")
        if v and v not in seen:
            seen.append(v)
    return seen


def verify(bundle: str, *, key: str | bytes | None = None, limits: Limits | None = None) -> dict[str, Any]:
    """Check a bundle completely without writing anything: structure, limits,
    signature (when a key is set), every member's sha256, every entry's manifest.
    Raises BundleError naming the first problem; returns a summary."""
    t0 = time.perf_counter()
    limits = limits or Limits()
    with _open(bundle) as tar:
        scanned = _scan(tar, bundle, limits, signing_key(key))
        for e in scanned.manifest["entries"]:
            base = _member_base(e["root"], e["kind"], e["key"])
            entry_manifest = _stream_member(tar, bundle, scanned, f"{base}/{MANIFEST}")
            for rel in e["files"]:
                if rel != MANIFEST:
                    _stream_member(tar, bundle, scanned, f"{base}/{rel}", sink=_NullSink())
            _check_entry(bundle, e, entry_manifest or b"")
            seals = {}
            for rel in e.get("runtime", {}):
                subdir, path = _runtime_member(rel)  # type: ignore[misc]
                if path is None:
                    seals[subdir] = _stream_member(tar, bundle, scanned, f"{base}/{rel}") or b""
                else:
                    _stream_member(tar, bundle, scanned, f"{base}/{rel}", sink=_NullSink())
            _check_runtime(bundle, e, seals)
    return _summary(bundle, scanned, t0)


class _NullSink:
    def write(self, data: bytes) -> None:
        pass


def _summary(bundle: str, scanned: _Scanned, t0: float, **extra: Any) -> dict[str, Any]:
    return {
        "bundle": bundle,
        "entries": len(scanned.manifest["entries"]),
        "payload_bytes": sum(e["size"] for e in scanned.manifest["entries"] if isinstance(e.get("size"), int)),
        "signature": scanned.signature,
        "versions": _entries_versions(scanned.manifest),
        "seconds": time.perf_counter() - t0,
        **extra,
    }


def read_manifest(bundle: str, *, limits: Limits | None = None) -> dict[str, Any]:
    """The bundle manifest (structure checked, checksums not): what ``ls BUNDLE`` prints."""
    with _open(bundle) as tar:
        return _scan(tar, bundle, limits or Limits(), None).manifest


# ---------------------------------------------------------------------------
# unpack
# ---------------------------------------------------------------------------


def _make_dirs(path: str, created: list[str]) -> None:
    """mkdir -p with 0700, recording what was created (removed again on failure)."""
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    for d in reversed(missing):
        os.mkdir(d, fs.DIR_MODE)
        created.append(d)


def unpack(bundle: str, cache_dir: str, *, key: str | bytes | None = None, limits: Limits | None = None) -> dict[str, Any]:
    """Unpack ``bundle`` into ``cache_dir`` after checking everything (see the module
    docstring). Entries already present and intact are kept. Raises BundleError
    (nothing written) for any refusal; returns a summary."""
    t0 = time.perf_counter()
    cache_dir = os.path.abspath(cache_dir)
    limits = limits or Limits()
    staged: list[tuple[Store, str, str]] = []
    created: list[str] = []
    published: list[str] = []
    kept: list[str] = []
    merged: list[str] = []
    seals: dict[str, dict[str, bytes]] = {}  # staging dir -> its run-time caches' seals
    runtime_added = 0
    with _open(bundle) as tar:
        scanned = _scan(tar, bundle, limits, signing_key(key))  # nothing is written before this passes
        try:
            for e in scanned.manifest["entries"]:
                root = os.path.join(cache_dir, *e["root"].split("/")) if e["root"] else cache_dir
                store = Store(root, e["kind"])
                _make_dirs(store.dir, created)
                fs.ensure_dir(store.dir, root=cache_dir)  # every level: a real dir we own
                tmp = os.path.join(store.dir, f".tmp-{e['key'][:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
                os.mkdir(tmp, fs.DIR_MODE)
                staged.append((store, e["key"], tmp))
                os.mkdir(os.path.join(tmp, FILES_DIR), fs.DIR_MODE)
                base = _member_base(e["root"], e["kind"], e["key"])
                for rel in e["files"]:
                    target = os.path.join(tmp, *rel.split("/"))
                    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), fs.FILE_MODE)
                    with os.fdopen(fd, "wb") as sink:
                        _stream_member(tar, bundle, scanned, f"{base}/{rel}", sink=sink)
                        sink.flush()
                        os.fsync(sink.fileno())
                with open(os.path.join(tmp, MANIFEST), "rb") as f:
                    _check_entry(bundle, e, f.read())
                seals[tmp] = _stage_runtime(tar, bundle, scanned, e, base, tmp)
                _check_runtime(bundle, e, seals[tmp])
            for store, key, tmp in staged:  # everything checked: publish, entry by entry
                name = f"{store.kind}/{key[:16]}"
                existing = _intact_existing(store, key)
                if existing is not None:
                    if store.kind == "programs" and _merge_program(store, key, existing, tmp):
                        merged.append(name)
                    else:
                        kept.append(name)
                    runtime_added += _adopt_runtime(existing.files_dir, key, tmp, seals.get(tmp, {}))
                    shutil.rmtree(tmp, ignore_errors=True)
                    continue
                try:
                    os.rename(tmp, store.entry_path(key))
                except OSError:
                    if _intact_existing(store, key) is None:
                        raise
                    kept.append(name)
                    shutil.rmtree(tmp, ignore_errors=True)
                    continue
                published.append(name)
            for root in sorted({s.root for s, _, _ in staged}):
                tag = os.path.join(root, TAG)
                if not os.path.lexists(tag):
                    store = Store(root, KINDS[0])
                    store.prepare(quiet=True)  # writes CACHEDIR.TAG
        except BaseException:
            for _, _, tmp in staged:
                shutil.rmtree(tmp, ignore_errors=True)
            if not published:
                for d in reversed(created):
                    try:
                        os.rmdir(d)
                    except OSError:
                        pass
            raise
    return _summary(bundle, scanned, t0, cache_dir=cache_dir, published=len(published), kept=len(kept),
                    merged=len(merged), runtime_caches_added=runtime_added)


def _adopt_runtime(files_dir: str, key: str, tmp: str, seals: dict[str, bytes]) -> int:
    """The bundle's checked run-time caches (staged in ``tmp``) into an intact entry already
    here that lacks them (one it has is kept), each copied in pieces and checked against its
    seal again, installed atomically; how many were added."""
    added = 0
    for subdir, seal_raw in sorted(seals.items()):
        staged = Sealed(os.path.join(tmp, FILES_DIR), subdir, key, seal_raw,
                        runtime_cache.parse_seal(seal_raw, key, subdir))
        if runtime_carry.copy_sealed(staged, files_dir):
            added += 1
    return added


def _stage_runtime(tar: tarfile.TarFile, bundle: str, scanned: _Scanned, e: dict[str, Any], base: str,
                   tmp: str) -> dict[str, bytes]:
    """Write an entry's run-time cache members into its staging dir; their seals' bytes."""
    seals: dict[str, bytes] = {}
    for rel in e.get("runtime", {}):
        subdir, path = _runtime_member(rel)  # type: ignore[misc]  (checked by _expected_members)
        parts = rel.split("/")
        for depth in range(2, len(parts)):  # files/<cache>/...: each level ours, 0700 (never through a link)
            level = os.path.join(tmp, *parts[:depth])
            if not os.path.lexists(level):
                os.mkdir(level, fs.DIR_MODE)
        target = os.path.join(tmp, *parts)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), fs.FILE_MODE)
        with os.fdopen(fd, "wb") as sink:
            if path is None:
                seals[subdir] = _stream_member(tar, bundle, scanned, f"{base}/{rel}") or b""
                sink.write(seals[subdir])
            else:
                _stream_member(tar, bundle, scanned, f"{base}/{rel}", sink=sink)
            sink.flush()
            os.fsync(sink.fileno())
    for subdir in seals:  # a sealed cache that holds no file is still a directory
        level = os.path.join(tmp, FILES_DIR, subdir)
        if not os.path.lexists(level):
            os.mkdir(level, fs.DIR_MODE)
    return seals


def _intact_existing(store: Store, key: str) -> Any:
    """The intact entry already at ``key`` (kept), or None; a broken one is set aside
    (only the directory that was read) for the bundle's."""
    try:
        return store.read_verified(key)
    except BrokenEntry as exc:
        store.quarantine(key, f"{exc}; replaced by an unpacked bundle entry", identity=exc.identity)
        return None


def _merge_program(store: Store, key: str, existing: Any, staged_dir: str) -> bool:
    """Merge the bundle's program (staged and checked in ``staged_dir``) into the one
    already here, so a newer bundle's extra variants are kept; True if it changed."""
    from .bypass.program import merge_programs

    with open(os.path.join(staged_dir, MANIFEST), "rb") as f:
        manifest = parse_manifest(f.read())
    files = {}
    for name in manifest.get("files", {}):
        with open(os.path.join(staged_dir, FILES_DIR, name), "rb") as f:
            files[name] = f.read()
    new = manifest.get("program")
    if not isinstance(new, dict):
        return False
    with store.lock(key):
        try:
            existing = store.read_verified(key) or existing  # the newest, under the lock
        except BrokenEntry:
            pass
        old = existing.manifest.get("program")
        program, merged_files = merge_programs(old, existing.files, new, files)
        if program == old and merged_files == existing.files:
            return False
        fields = {k: v for k, v in manifest.items() if k not in ("key", "kind", "files", "created", "last_used")}
        return store.replace(key, merged_files, dict(fields, program=program)) is not None
