"""Process-independent names and digests of callables, for cache keys.

Kept below ``key.py`` and ``torchair_config.py`` (both use it) so neither
imports the other.
"""

from __future__ import annotations

import hashlib
from typing import Any


def qualified_name(obj: Any) -> str:
    """A process-independent name for a node target or callable (never an id)."""
    import torch

    if isinstance(obj, str):
        return obj
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"op:{obj}"
    module = getattr(obj, "__module__", None) or type(obj).__module__
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if qualname is None:
        return f"{type(obj).__module__}.{type(obj).__qualname__}"
    return f"{module}.{qualname}"


def function_digest(fn: Any) -> str:
    """Digest of a Python callable's code (for decompositions, custom passes).

    The same fingerprint the bypass uses for traced sources (bytecode and
    constants, not source text, so REPL functions work too); builtins and C
    functions digest by name.
    """
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return qualified_name(fn)
    from .code_codec import code_fingerprint

    return code_fingerprint(code)


# --------------------------------------------------------------- callables with bound values
#: code object -> fingerprint (code objects are immutable; weak so REPL churn is freed)
_CODE_DIGESTS: Any = None
_ADDRESS: Any = None  # `` at 0x7f...`` in a repr; compiled on first use (a warm start rarely needs it)
_MAX_DEPTH = 4
_MAX_HASHED_NUMEL = 1 << 16


def _code_digest(code: Any) -> str:
    global _CODE_DIGESTS
    if _CODE_DIGESTS is None:
        import weakref

        _CODE_DIGESTS = weakref.WeakKeyDictionary()
    found = _CODE_DIGESTS.get(code)
    if found is None:
        from .code_codec import code_fingerprint

        found = _CODE_DIGESTS[code] = code_fingerprint(code)
    return found


def describe_callable(fn: Any, _depth: int = 0) -> Any:
    """JSON-able description of what ``fn`` computes: its code *and* the values bound
    to it (defaults, closure cells, ``functools.partial`` arguments, a callable
    object's attributes), so two partials of one function, or one callable class
    with other settings, never describe alike. Builtins describe by name."""
    import functools
    import types

    if _depth > _MAX_DEPTH:
        return qualified_name(fn)
    if isinstance(fn, functools.partial):
        return {
            "partial": describe_callable(fn.func, _depth + 1),
            "args": [describe_value(a, _depth + 1) for a in fn.args],
            "keywords": {k: describe_value(v, _depth + 1) for k, v in sorted(fn.keywords.items())},
        }
    if isinstance(fn, types.MethodType):
        return {"method": describe_callable(fn.__func__, _depth + 1), "self": describe_value(fn.__self__, _depth + 1)}
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        cells = []
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                cells.append(describe_value(cell.cell_contents, _depth + 1))
            except ValueError:  # an empty cell
                cells.append("<empty>")
        return {
            "code": _code_digest(code),
            "defaults": describe_value(getattr(fn, "__defaults__", None), _depth + 1),
            "kwdefaults": describe_value(getattr(fn, "__kwdefaults__", None), _depth + 1),
            "closure": cells,
        }
    if isinstance(fn, type) or not hasattr(fn, "__dict__") or isinstance(fn, types.BuiltinFunctionType):
        return qualified_name(fn)
    # a callable object: its class's __call__ plus its own attributes
    call = vars(type(fn)).get("__call__") or next(
        (vars(c)["__call__"] for c in type(fn).__mro__ if "__call__" in vars(c)), None
    )
    out: dict[str, Any] = {"type": qualified_name(type(fn)), "state": describe_value(vars(fn), _depth + 1)}
    if call is not None and hasattr(call, "__code__"):
        out["call"] = describe_callable(call, _depth + 1)
    uuid = getattr(fn, "uuid", None)  # Inductor's CustomGraphPass names its own version
    if callable(uuid):
        try:
            out["uuid"] = describe_value(uuid(), _depth + 1)
        except Exception:  # noqa: BLE001 - a broken uuid() only loses this extra detail
            pass
    return out


def describe_value(value: Any, _depth: int = 0) -> Any:
    """A value bound to a callable, as JSON-able data without process addresses."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if _depth > _MAX_DEPTH:
        return f"<{qualified_name(type(value))}>"
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [describe_value(v, _depth + 1) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        return {str(k): describe_value(v, _depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, bytes):
        return {"bytes": hashlib.sha256(value).hexdigest()}
    import types

    if isinstance(value, types.ModuleType):
        return {"module": value.__name__}
    import torch

    if isinstance(value, torch.Tensor):
        meta: dict[str, Any] = {"tensor": [str(value.dtype), list(value.shape), str(value.device)]}
        if value.device.type != "meta" and value.numel() <= _MAX_HASHED_NUMEL:
            data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            meta["sha256"] = hashlib.sha256(data).hexdigest()
        return meta
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)) or isinstance(
        value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
    ):
        return str(value)
    if callable(value) and not isinstance(value, torch.nn.Module):
        return describe_callable(value, _depth + 1)
    if isinstance(value, torch.nn.Module):  # a module's weights are not a setting; its structure is
        return {"module": qualified_name(type(value)), "repr": _without_addresses(repr(value))}
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        return {"type": qualified_name(type(value)), "state": describe_value(attrs, _depth + 1)}
    return _without_addresses(repr(value))


def _without_addresses(text: str) -> str:
    global _ADDRESS
    if " at 0x" not in text:  # most reprs: no pattern compiled on a warm start
        return text
    if _ADDRESS is None:
        import re

        _ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
    return _ADDRESS.sub("", text)


def callable_digest(fn: Any) -> str:
    """sha256 of :func:`describe_callable` (custom passes, decompositions, GE converters)."""
    import json

    blob = json.dumps(describe_callable(fn), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
