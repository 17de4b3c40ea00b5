"""The encode side of the code codec: values to descriptors, code objects to payloads.

Only capture (a cold compile) encodes; a warm start only decodes (``code_codec``), so
this half is never imported on the warm path. ``code_codec`` re-exports
``encode_value`` and ``dumps_code`` lazily, so callers keep one name for the codec.
"""

from __future__ import annotations

import base64
import collections.abc
import enum
import hashlib
import json
import marshal
import sys
import types
import typing
from typing import Any

import torch

from .code_codec import (
    _ATOMS,
    _FIX_OFF,
    _HEADER_LEN,
    _MISSING,
    _PREFIX,
    _SPECIAL_TYPES,
    _TOKEN_BYTES,
    FORMAT_VERSION,
    CodecError,
    Desc,
    _ConstWalker,
    _label,
    _local_error,
    _python_tag,
    _refuse,
    _resolve,
    _type_name,
    decode_value,
)


def _same(a: object, b: object) -> bool:
    """Identity, or equality for objects rebuilt on access (bound methods)."""
    if a is b:
        return True
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def _locate(obj: object) -> tuple[str, str]:
    """A ``(module, qualname)`` that imports back as ``obj`` itself."""
    if isinstance(obj, type) and obj in _SPECIAL_TYPES:
        return _SPECIAL_TYPES[obj]
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    name = getattr(obj, "__name__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        # instances (an nn.Module, a partial) are state, not names: never resolve them
        raise _refuse(obj, "it has no __module__/__qualname__ to import it by", _FIX_OFF)
    if "<locals>" in qualname:
        raise _local_error(module, qualname)
    for cand in dict.fromkeys(c for c in (qualname, name) if isinstance(c, str)):
        try:
            if _same(_resolve(module, cand), obj):
                return module, cand
        except CodecError:
            pass
    # Re-exported under another name, e.g. torch.nn.attention.SDPBackend (_SDPBackend).
    mod = sys.modules.get(module)
    if mod is not None:
        for attr, val in sorted(vars(mod).items()):
            if val is obj and attr.isidentifier():
                return module, attr
    raise _refuse(
        obj,
        f"{module}.{qualname} does not import back as this same object",
        f"expose it under a module-level name, or {_FIX_OFF}",
    )



def encode_global(obj: object) -> Desc:
    """An object no name imports (an instance, e.g. a function wrapped into a module
    object by a decorator) that a module binds at its top level:
    ``{"kind": "global", "module", "name", "type"}``, found again as that attribute.

    The identity of such an object in another process is the object that module binds
    under that name (as a function's is the one its import path finds). The modules its
    type and the object itself name are searched first, then every module in import
    order, ``__main__`` last; a name that does not read back as ``obj`` is never used.
    """
    named = [m for m in (getattr(type(obj), "__module__", None), _safe_attr(obj, "__module__")) if isinstance(m, str)]
    order = list(dict.fromkeys([*named, *(m for m in list(sys.modules) if m not in ("__main__", "__mp_main__")),
                                "__main__"]))
    for module in order:
        mod = sys.modules.get(module)
        if not isinstance(mod, types.ModuleType):  # a lazy proxy some libraries put there: never touched
            continue
        space = vars(mod)
        if space.get("__name__") != module:  # an alias (os.path), a module under another name
            continue
        for attr, val in list(space.items()):
            if val is obj and type(attr) is str and attr.isidentifier():
                return {"kind": "global", "module": module, "name": attr, "type": _type_name(obj)}
    raise _refuse(
        obj,
        f"no module binds this {type(obj).__qualname__} at its top level, so a fresh process cannot find it",
        f"bind it to a module-level name, or {_FIX_OFF}",
    )


def _safe_attr(obj: object, name: str) -> object:
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


# --------------------------------------------------------------------------
# encode_value
# --------------------------------------------------------------------------


def _class_desc(cls: type) -> Desc:
    module, qualname = _locate(cls)
    return {"kind": "class", "module": module, "qualname": qualname}


def _torch_attr_name(obj: object, prefix: str = "torch.") -> str:
    """``torch.float32`` -> ``"float32"``, checked to resolve back to ``obj``."""
    text = str(obj)
    name = text[len(prefix) :] if text.startswith(prefix) else ""
    if not name.isidentifier() or getattr(torch, name, None) is not obj:
        raise _refuse(obj, "it is not reachable as a torch.<name> attribute", _FIX_OFF)
    return name


def _enum_desc(obj: object) -> Desc | None:
    """``enum.Enum`` members and pybind11 enums (``__members__`` + ``.name``)."""
    cls = type(obj)
    members = getattr(cls, "__members__", None)
    if not isinstance(members, collections.abc.Mapping):
        return None
    name = getattr(obj, "name", None)
    if isinstance(name, str) and members.get(name) is obj:
        return {"kind": "enum", "cls": _class_desc(cls), "name": name}
    if isinstance(obj, enum.Enum):  # composite Flag values have no single member
        return {"kind": "enum", "cls": _class_desc(cls), "value": encode_value(obj.value)}
    return None


def _is_namedtuple(obj: object) -> bool:
    cls = type(obj)
    return (
        isinstance(obj, tuple)
        and isinstance(getattr(cls, "_fields", None), tuple)
        and callable(getattr(cls, "_make", None))
    )


def _typing_alias_desc(obj: Any) -> Desc:
    """``typing.List[int]``-style aliases, accepted only if they rebuild equal."""
    args = [encode_value(a) for a in obj.__args__]
    origin = getattr(obj, "__origin__", None)
    bases: list[Desc] = [
        {"typing_name": n}
        for n in (getattr(obj, "_name", None), getattr(origin, "_name", None))  # List / Union
        if isinstance(n, str) and n.isidentifier() and getattr(typing, n, None) is not None
    ]
    if isinstance(origin, type):
        bases.append({"origin": _class_desc(origin)})  # a user Generic subclass
    for base in bases:
        desc = {"kind": "typing_alias", **base, "args": args}
        try:
            if _same(decode_value(desc), obj):
                return desc
        except CodecError:
            pass
    raise _refuse(obj, "this typing alias does not rebuild to an equal alias", _FIX_OFF)


def _module_dict_name(obj: dict[Any, Any]) -> str | None:
    name = obj.get("__name__")
    mod = sys.modules.get(name) if isinstance(name, str) else None
    return name if mod is not None and vars(mod) is obj else None


def _callable_desc(obj: Any) -> Desc:
    """By import name, else as ``getattr(owner, name)`` (``NT._make``, ``tuple.__new__``)."""
    try:
        module, qualname = _locate(obj)
        return {"kind": "function", "module": module, "qualname": qualname}
    except CodecError as exc:
        first = exc
    owner = getattr(obj, "__self__", None)
    if owner is None or isinstance(owner, types.ModuleType):
        owner = getattr(obj, "__objclass__", None)
    name = getattr(obj, "__name__", None)
    if owner is None or not isinstance(name, str):
        raise first
    owner_desc = encode_value(owner)  # its error (e.g. a local class) is the useful one
    if not _same(getattr(owner, name, _MISSING), obj):
        raise first
    return {"kind": "method", "owner": owner_desc, "name": name}


def _sorted_descs(items: collections.abc.Iterable[object]) -> list[Desc]:
    """Frozenset order depends on the hash seed; sort so output is deterministic."""
    descs = [encode_value(x) for x in items]
    return sorted(descs, key=lambda d: json.dumps(d, sort_keys=True))


def encode_value(obj: object) -> Desc:
    """A JSON-able descriptor that ``decode_value`` turns back into ``obj``.

    Covers what Dynamo bakes into bytecode or globals (torch dtype/device/Size/
    memory_format/layout/finfo/iinfo, slices, classes, enum members,
    namedtuples, functions and bound methods, modules, module ``__dict__``s,
    plain dicts such as ``__annotations__``, generic aliases) plus the marshal
    atoms so values nest.  Anything else raises ``CodecError`` rather than
    guessing.
    """
    t = type(obj)
    # atoms (exact types: an IntEnum member must not decay to int)
    if obj is None:
        return {"kind": "none"}
    if obj is Ellipsis:
        return {"kind": "ellipsis"}
    if obj is NotImplemented:
        return {"kind": "notimplemented"}
    if t is bool:
        return {"kind": "bool", "value": obj}
    if t is int:
        return {"kind": "int", "value": obj}
    if t is float:
        return {"kind": "float", "hex": float.hex(typing.cast(float, obj))}
    if t is complex:
        c = typing.cast(complex, obj)
        return {"kind": "complex", "real": float.hex(c.real), "imag": float.hex(c.imag)}
    if t is str:
        return {"kind": "str", "value": obj}
    if t is bytes:
        return {"kind": "bytes", "b64": base64.b64encode(typing.cast(bytes, obj)).decode()}
    if t is tuple:
        return {"kind": "tuple", "items": [encode_value(x) for x in typing.cast(tuple, obj)]}
    if t is frozenset:
        return {"kind": "frozenset", "items": _sorted_descs(typing.cast(frozenset, obj))}
    # torch value types
    if t is torch.dtype:
        return {"kind": "dtype", "name": _torch_attr_name(obj)}
    if t is torch.memory_format:
        return {"kind": "memory_format", "name": _torch_attr_name(obj)}
    if t is torch.layout:
        return {"kind": "layout", "name": _torch_attr_name(obj)}
    if t is torch.device:
        dev = typing.cast(torch.device, obj)
        return {"kind": "device", "type": dev.type, "index": dev.index}
    if t is torch.Size:
        dims = list(typing.cast(torch.Size, obj))
        if not all(type(d) is int for d in dims):
            raise _refuse(obj, "a torch.Size with symbolic dims", _FIX_OFF)
        return {"kind": "size", "dims": dims}
    if t is torch.finfo or t is torch.iinfo:
        kind = "finfo" if t is torch.finfo else "iinfo"
        name = getattr(obj, "dtype", None)  # a str such as "float32"
        if not isinstance(name, str) or not isinstance(getattr(torch, name, None), torch.dtype):
            raise _refuse(obj, f"{kind} without a torch dtype name", _FIX_OFF)
        return {"kind": kind, "dtype": name}
    if t is slice:
        s = typing.cast(slice, obj)
        return {
            "kind": "slice",
            "start": encode_value(s.start),
            "stop": encode_value(s.stop),
            "step": encode_value(s.step),
        }
    # named Python objects
    if isinstance(obj, torch._ops._OpNamespace):  # torch.ops.aten: a module subclass, not in sys.modules
        return {"kind": "op_namespace", "name": typing.cast(Any, obj).name}
    if isinstance(obj, types.ModuleType):
        if sys.modules.get(obj.__name__) is not obj:
            raise _refuse(obj, "module is not registered in sys.modules", _FIX_OFF)
        return {"kind": "module", "name": obj.__name__}
    if isinstance(obj, type):
        return _class_desc(obj)
    enum_desc = _enum_desc(obj)
    if enum_desc is not None:
        return enum_desc
    if _is_namedtuple(obj):
        cls = typing.cast(Any, t)
        return {
            "kind": "namedtuple",
            "cls": _class_desc(t),
            "names": list(cls._fields),
            "fields": [encode_value(x) for x in typing.cast(tuple, obj)],
        }
    if t is types.GenericAlias:
        alias = typing.cast(Any, obj)
        return {
            "kind": "generic_alias",
            "origin": encode_value(alias.__origin__),
            "args": [encode_value(a) for a in alias.__args__],
        }
    if t.__module__ == "typing" and hasattr(obj, "__origin__") and hasattr(obj, "__args__"):
        return _typing_alias_desc(obj)
    if t is dict:
        d = typing.cast(dict, obj)
        name = _module_dict_name(d)
        if name is not None:  # f_globals of a nested function Dynamo rebuilds
            return {"kind": "module_dict", "module": name}
        # e.g. the __annotations__ of such a function; keys and values must encode
        return {"kind": "dict", "items": [[encode_value(k), encode_value(v)] for k, v in d.items()]}
    if t is types.CodeType:
        raise _refuse(obj, "code objects are not values", "serialize them with dumps_code")
    if t is list:  # EQUALS_MATCH guards compare lists (and sets) of constants
        return {"kind": "list", "items": [encode_value(x) for x in typing.cast(list, obj)]}
    if t is set:
        return {"kind": "set", "items": _sorted_descs(typing.cast(set, obj))}
    if t is range:
        r = typing.cast(range, obj)
        return {"kind": "range", "start": r.start, "stop": r.stop, "step": r.step}
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        op = typing.cast(Any, obj)
        if isinstance(obj, torch._ops.OpOverload):
            return {"kind": "op", "name": f"{op.namespace}::{op._opname}", "overload": op._overloadname}
        return {"kind": "op", "name": op._qualified_op_name, "overload": None}
    if callable(obj):
        return _callable_desc(obj)
    raise _refuse(
        obj,
        f"unsupported constant type {t.__module__}.{t.__qualname__}",
        f"keep such values out of compiled code's constants, or {_FIX_OFF}",
    )





def _leaf_bytes(value: object, out: set[bytes]) -> None:
    t = type(value)
    if t is bytes:
        out.add(typing.cast(bytes, value))
    elif t is types.CodeType:
        for c in typing.cast(types.CodeType, value).co_consts:
            _leaf_bytes(c, out)
    elif t is tuple or t is frozenset:
        for c in typing.cast(collections.abc.Iterable, value):
            _leaf_bytes(c, out)


def _fresh_token(code: types.CodeType) -> bytes:
    """Random placeholder tag that is provably not one of the code's constants."""
    taken: set[bytes] = set()
    _leaf_bytes(code, taken)
    while True:
        import secrets  # capture side only: keep it off the warm path

        token = secrets.token_bytes(_TOKEN_BYTES)
        if token not in taken:
            return token



class _SwapOut(_ConstWalker):
    """Replace unmarshallable constants by ``(token, table_index)`` tuples."""

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.table: list[Desc] = []

    def const(self, value: object, label: str) -> object:
        t = type(value)
        if t in _ATOMS:
            return value
        if t is types.CodeType:
            return self.code(typing.cast(types.CodeType, value), label)
        if t is tuple:
            return tuple(self.const(v, label) for v in typing.cast(tuple, value))
        if t is frozenset:
            return frozenset(self.const(v, label) for v in typing.cast(frozenset, value))
        self.table.append(encode_value(value))
        return (self.token, len(self.table) - 1)



def dumps_code(code: types.CodeType) -> bytes:
    """Serialize ``code`` (nested code included) to bytes; see the module docstring."""
    if not isinstance(code, types.CodeType):
        raise TypeError(f"dumps_code expects a code object, got {type(code).__qualname__}")
    swap = _SwapOut(_fresh_token(code))
    encoded = swap.code(code)
    try:
        body = marshal.dumps(encoded)
    except ValueError as exc:  # a constant slipped past the walker: a codec bug
        raise CodecError(
            f"marshal refused code {_label(code, None)!r} after substitution ({exc})",
            fix=f"report this codec bug, or {_FIX_OFF}",
        ) from exc
    header = {
        "format": FORMAT_VERSION,
        **_python_tag(),
        "token": swap.token.hex(),
        "table": swap.table,
        "body_sha256": hashlib.sha256(body).hexdigest(),
    }
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("ascii")
    return _PREFIX + _HEADER_LEN.pack(len(raw)) + raw + body


