"""What the guards' warm path does not run: the capture side's blob packing, the explanations
of a failing guard, and the tools' views.

Split off ``guard_runtime`` so a warm start (its guards hold; it runs the load-time and
per-call checks) never reads these bytes; ``guard_runtime`` re-exports the public names
on first use.
"""

from __future__ import annotations

import json
import types
import zlib
from typing import Any

import torch

from .guard_runtime import (
    _BLOB_MAGIC,
    _SIZES,
    GuardChecks,
    _inflate,
    _tensor_meta,
    unpack_checks,
)


def pack_checks(checks: bytes, full: bytes, meta: list[dict[str, Any]]) -> bytes:
    """One guards blob: the load-path checks, then zlib-compressed (fewer bytes to read and
    hash at every start) the full check and the explanations (JSON), decompressed on use."""
    meta_json = json.dumps(meta, separators=(",", ":"), default=str).encode()
    parts = (checks, zlib.compress(full, 6), zlib.compress(meta_json, 6))
    return _BLOB_MAGIC + _SIZES.pack(*map(len, parts)) + b"".join(parts)


def checks_meta(blob: bytes) -> list[dict[str, Any]]:
    """The guards' explanations stored in a guards blob (for ``readable_cache``)."""
    return json.loads(_inflate(unpack_checks(blob)[2]))


def failures(checks: GuardChecks, local: dict[str, Any], scopes: tuple[str, ...]) -> list[str]:
    """Descriptions of the guards of ``scopes`` that fail for the frame locals ``local`` (slow path)."""
    failed = []
    for meta in checks.meta:
        if meta["scope"] not in scopes:
            continue
        try:
            ok = bool(_eval(checks, meta["expr"], local))
        except Exception as exc:  # the object the guard reads is gone or changed shape
            failed.append(f"{meta['desc']} ({type(exc).__name__}: {exc})")
            continue
        if not ok:
            failed.append(_describe(checks, meta, local))
    return failed

def _eval(checks: GuardChecks, expr: str, local: dict[str, Any]) -> Any:
    return eval(expr, checks.namespace, {"L": local})  # noqa: S307 - our own stored, checksummed expression

def _describe(checks: GuardChecks, meta: dict[str, Any], local: dict[str, Any]) -> str:
    """``self.scale: 2.0 -> 3.0`` where the guard reads a value, else the guard itself."""
    if meta.get("edited"):
        return f"{meta['desc']} was edited since it was cached"
    if "reader" not in meta:
        return f"{meta['desc']} no longer holds"
    try:
        value = _eval(checks, meta["reader"], local)
        now = value if meta["kind"] == "TENSOR_MATCH" else short(value)
    except Exception as exc:
        now = f"<{type(exc).__name__}>"
    what = meta["desc"].split(" == ")[0].split(" (dtype")[0]
    return f"{what}: {meta.get('was', '?')} -> {now}"

def call_failures(checks: GuardChecks, args: tuple[Any, ...], kwargs: dict[str, Any], full: bool) -> list[str]:
    """Per-call guards that fail for these arguments (for the log line; slow path)."""
    try:
        local = checks.bind(*args, **kwargs)
    except TypeError as exc:
        return [f"arguments do not bind: {exc}"]
    return failures(checks, local, ("load", "call") if full else ("call",))


def short(value: Any) -> str:
    """A process-independent, short rendering of a guarded value (no addresses)."""
    if isinstance(value, torch.Tensor):
        return _tensor_meta(value)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type, types.MethodType)):
        return f"<{type(value).__name__} {getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}>"
    if isinstance(value, types.ModuleType):
        return f"<module {value.__name__}>"
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__qualname__}>"
    return text if len(text) <= 80 else text[:77] + "..."
