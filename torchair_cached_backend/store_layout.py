"""What an entry is on disk: names, the manifest and its bounded, schema-checked parse.

An entry is ``<root>/<kind>/<key>/`` holding ``manifest.json`` and ``files/<name>``.
A manifest is untrusted input until verified: it is parsed with bounds (no
integer longer than 20 digits, no ``Infinity``/``NaN``, no nesting deeper than
:data:`MAX_DEPTH`) and a schema (the fields the store and the tools read have
their types), so an odd but valid JSON document is a broken entry, set aside,
never an ``OverflowError`` or ``RecursionError`` in a user's call.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

MANIFEST = "manifest.json"
FILES_DIR = "files"
TAG = "CACHEDIR.TAG"
LOCKS_DIR = "locks"
QUARANTINE_DIR = "quarantine"
KINDS = ("graphs", "programs")
#: how deep a manifest (or any JSON the cache reads) may nest
MAX_DEPTH = 64
#: the longest integer literal accepted (int64 has 19 digits)
_MAX_INT_DIGITS = 20
TAG_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This directory is a torchair_cached_backend compile cache.\n"
    "# See https://bford.info/cachedir/ and `python -m torchair_cached_backend --help`.\n"
)


class BrokenEntry(Exception):
    """An entry failed verification; the message says which check.

    ``identity`` is the (st_dev, st_ino) of the entry directory that was read,
    so a caller can tell a broken entry from one a writer replaced meanwhile."""

    identity: tuple[int, int] | None = None


def valid_name(name: object) -> bool:
    """Whether ``name`` can be one path component of an entry: no separator, not
    absolute, not ``.``/``..``, not hidden (temporary and trash dirs are)."""
    return (
        isinstance(name, str)
        and bool(name)
        and not name.startswith(".")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


class Entry:
    """A verified entry: its manifest and blobs (a plain class: this is the warm path).

    ``files`` are the bytes that were checked against the manifest's sha256:
    whatever is executed, unpickled or dlopened must come from them, never from
    ``path`` (the directory may change after the check)."""

    __slots__ = ("key", "path", "manifest", "files")

    def __init__(self, key: str, path: str, manifest: dict[str, Any], files: dict[str, bytes]) -> None:
        self.key = key
        self.path = path
        self.manifest = manifest
        self.files = files

    @property
    def files_dir(self) -> str:
        return os.path.join(self.path, FILES_DIR)

    def path_of(self, name: str) -> str:
        """The on-disk path of blob ``name`` (for humans and GE's own caches; code is
        loaded from :attr:`files`). Only checksummed names are accepted."""
        if name not in self.files:
            raise BrokenEntry(
                f"cache entry {self.key[:12]} has no checksummed file {name!r}; refusing to load it"
            )
        return os.path.join(self.path, FILES_DIR, name)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class JsonBoundsError(ValueError):
    """A JSON document outside the bounds the cache accepts."""


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise JsonBoundsError(f"an integer of {len(text)} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonBoundsError(f"a non-finite number {text[:20]}")
    return value


def _no_constant(name: str) -> Any:
    raise JsonBoundsError(f"the non-standard constant {name}")


def _check_depth(obj: Any, limit: int = MAX_DEPTH) -> None:
    """Iteratively, a level at a time: no recursion, whatever the document."""
    level = [obj] if isinstance(obj, _CONTAINERS) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            raise JsonBoundsError(f"nesting deeper than {limit}")
        level = [v for item in level for v in (item.values() if type(item) is dict else item)
                 if isinstance(v, _CONTAINERS)]  # one comprehension per level, not one per container


_CONTAINERS = (dict, list)


def loads_bounded(raw: bytes | str) -> Any:
    """``json.loads`` with bounds: JsonBoundsError (a ValueError) for huge integers,
    Infinity/NaN, nesting deeper than :data:`MAX_DEPTH`, and anything that would
    otherwise raise RecursionError."""
    try:
        value = json.loads(raw, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError:
        raise JsonBoundsError(f"nesting deeper than {MAX_DEPTH}") from None
    _check_depth(value)
    return value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_manifest(raw: bytes) -> dict[str, Any]:
    """A manifest, bounded and schema-checked; BrokenEntry names what is off."""
    try:
        manifest = loads_bounded(raw)
    except JsonBoundsError as exc:
        raise BrokenEntry(f"manifest.json holds {exc} (tampered?)") from None
    except ValueError as exc:
        raise BrokenEntry(f"manifest.json is not valid JSON ({exc}); truncated?") from None
    if not isinstance(manifest, dict):
        raise BrokenEntry("manifest.json does not hold a JSON object")
    check_schema(manifest)
    return manifest


def check_schema(manifest: dict[str, Any]) -> None:
    """The types of the fields the store and the tools read."""
    for field in ("key", "kind", "identity", "compiler"):
        if field in manifest and not isinstance(manifest[field], str):
            raise BrokenEntry(f"manifest field {field!r} is not a string")
    for field in ("created", "last_used", "compile_seconds"):
        if field in manifest and not _number(manifest[field]):
            raise BrokenEntry(f"manifest field {field!r} is not a number")
    for field in ("meta", "versions", "factors", "program"):
        if field in manifest and not isinstance(manifest[field], dict):
            raise BrokenEntry(f"manifest field {field!r} is not an object")
    files = manifest.get("files", {})
    if not isinstance(files, dict):
        raise BrokenEntry("manifest 'files' is not a mapping")
    for name, info in files.items():
        if not isinstance(info, dict) or not isinstance(info.get("size"), int) or isinstance(info.get("size"), bool) \
                or info["size"] < 0 or not isinstance(info.get("sha256"), str) or len(info["sha256"]) != 64:
            raise BrokenEntry(f"manifest record of blob {name!r} is malformed")


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1, default=str).encode()
