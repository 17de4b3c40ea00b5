"""Serialize Dynamo-transformed code objects without pickle.

Dynamo's ``LOAD_CONST`` may carry values ``marshal`` refuses (``torch.dtype``,
``torch.Size``, classes, enum members, bound methods, module ``__dict__``s, ...).
``dumps_code`` swaps each one for a placeholder, marshals the code, and keeps a
JSON side table of descriptors.  ``loads_code`` rebuilds those values only by
importing a module and walking attribute names (plus a few torch value
constructors), so a payload can name existing objects but never run a pickle
opcode.

Payload layout: ``_PREFIX | u32 header length | JSON header | marshal body``.
marshal is version-specific, so the header pins ``sys.version_info[:2]`` and
``importlib.util.MAGIC_NUMBER``; the body's sha256 catches truncation.  This
guards against stale or corrupt caches, not hostile ones (marshal is not safe
against crafted input).
"""

from __future__ import annotations

import base64
import collections.abc
import enum
import hashlib
import importlib
import importlib.util
import json
import marshal
import struct
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "FORMAT_VERSION",
    "CodecError",
    "code_fingerprint",
    "decode_value",
    "dumps_code",
    "encode_value",
    "loads_code",
]

FORMAT_VERSION = 1
_PREFIX = b"TACB-CODE\n"
_HEADER_LEN = struct.Struct(">I")
_MAX_HEADER = 64 << 20
_TOKEN_BYTES = 16
_REPR_LIMIT = 120
# Exact types marshal writes natively (containers and code are walked separately).
_ATOMS: frozenset[type] = frozenset({type(None), bool, int, float, complex, str, bytes, type(Ellipsis)})
# Singleton types whose __module__ ("builtins") does not actually export them.
_SPECIAL_TYPES: dict[type, tuple[str, str]] = {
    type(None): ("types", "NoneType"),
    type(Ellipsis): ("types", "EllipsisType"),
    type(NotImplemented): ("types", "NotImplementedType"),
}
_FIX_OFF = "turn the bypass loader off for this function (it then recompiles normally)"
_FIX_STALE = "the cache entry is stale or corrupt: delete it so the function recompiles"
_MISSING = object()

Desc = dict[str, Any]


class CodecError(ValueError):
    """A value or payload the codec cannot handle.

    The message names the offending value, where it sits (``code_name`` and
    ``const_index`` of the top-level ``co_consts`` entry, nested code objects
    joined by ``" > "``) and the fix, because the user only sees it in a log.
    """

    def __init__(
        self,
        problem: str,
        *,
        fix: str = "",
        value_repr: str | None = None,
        code_name: str | None = None,
        const_index: int | None = None,
    ) -> None:
        self.problem = problem
        self.fix = fix
        self.value_repr = value_repr
        self.code_name = code_name
        self.const_index = const_index
        super().__init__(self._render())

    def _render(self) -> str:
        head = []
        if self.code_name is not None:
            head.append(f"constant #{self.const_index} of code {self.code_name!r}")
        if self.value_repr is not None:
            head.append(f"[{self.value_repr}]")
        msg = f"{' '.join(head)}: {self.problem}" if head else self.problem
        return f"{msg}. Fix: {self.fix}" if self.fix else msg

    def located(self, code_name: str, const_index: int) -> CodecError:
        """The same error, pinned to a ``co_consts`` slot (first location wins)."""
        if self.code_name is not None:
            return self
        return CodecError(
            self.problem,
            fix=self.fix,
            value_repr=self.value_repr,
            code_name=code_name,
            const_index=const_index,
        )


def _short_repr(obj: object) -> str:
    try:
        text = repr(obj)
    except Exception:  # a broken __repr__ must not hide the real error
        text = f"<{type(obj).__qualname__} with failing repr>"
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def _refuse(obj: object, problem: str, fix: str) -> CodecError:
    return CodecError(problem, fix=fix, value_repr=_short_repr(obj))


# --------------------------------------------------------------------------
# name resolution (the only way a payload reaches existing objects)
# --------------------------------------------------------------------------


def _local_error(module: str, qualname: str) -> CodecError:
    return CodecError(
        f"{module}.{qualname} is defined inside a function (<locals>), so a fresh process cannot import it",
        fix=f"define it at module level, or {_FIX_OFF}",
    )


def _import(module: str) -> types.ModuleType:
    loaded = sys.modules.get(module)
    if loaded is not None and not getattr(getattr(loaded, "__spec__", None), "_initializing", False):
        return loaded  # what import_module returns for a module already imported, without its lookups
    if not all(p.isidentifier() for p in module.split(".")):
        raise CodecError(f"malformed module name {module!r}", fix=_FIX_STALE)
    try:
        return importlib.import_module(module)
    except Exception as exc:
        raise CodecError(
            f"cannot import module {module!r} ({type(exc).__name__}: {exc})",
            fix="make it importable here (same sys.path and installed packages, e.g. "
            f"import torch_npu first), or {_FIX_OFF}",
        ) from exc


def _resolve(module: object, qualname: object) -> object:
    """Import ``module`` and walk ``qualname``; nothing else is ever executed."""
    if not isinstance(module, str) or not isinstance(qualname, str) or not module:
        raise CodecError(f"malformed name {module!r}.{qualname!r}", fix=_FIX_STALE)
    if "<locals>" in qualname:
        raise _local_error(module, qualname)
    parts = qualname.split(".")
    if not all(p.isidentifier() for p in parts):
        raise CodecError(
            f"{module}.{qualname} is not an importable dotted name",
            fix=f"give the object a module-level name, or {_FIX_OFF}",
        )
    obj: object = _import(module)
    for part in parts:
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise CodecError(
                f"module {module!r} has no attribute path {qualname!r}",
                fix=f"the code changed since it was cached; {_FIX_STALE}",
            ) from exc
    return obj


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


# --------------------------------------------------------------------------
# decode_value
# --------------------------------------------------------------------------


def _get(desc: Desc, key: str, typ: type | tuple[type, ...]) -> Any:
    value = desc.get(key, _MISSING)
    if value is _MISSING or not isinstance(value, typ) or (typ is int and type(value) is bool):
        raise CodecError(f"malformed {desc.get('kind')!r} descriptor: bad {key!r}", fix=_FIX_STALE)
    return value


def _expect(ok: bool, obj: object, what: str) -> None:
    if not ok:
        raise _refuse(
            obj,
            f"resolved to a {type(obj).__qualname__}, expected {what}",
            f"the name now refers to something else; {_FIX_STALE}",
        )


def _dec_class(desc: Desc) -> type:
    obj = _resolve(_get(desc, "module", str), _get(desc, "qualname", str))
    _expect(isinstance(obj, type), obj, "a class")
    return typing.cast(type, obj)


def _dec_function(desc: Desc) -> object:
    obj = _resolve(_get(desc, "module", str), _get(desc, "qualname", str))
    _expect(callable(obj) and not isinstance(obj, type), obj, "a function")
    return obj


def _dec_method(desc: Desc) -> object:
    owner = decode_value(_get(desc, "owner", dict))
    name = _get(desc, "name", str)
    obj = getattr(owner, name, _MISSING) if name.isidentifier() else _MISSING
    _expect(callable(obj), obj, f"a callable attribute {name!r}")
    return obj


def _dec_torch_attr(desc: Desc, typ: type) -> object:
    name = _get(desc, "name", str)
    obj = getattr(torch, name, None) if name.isidentifier() else None
    _expect(type(obj) is typ, obj, f"a {typ.__qualname__} named torch.{name}")
    return obj


def _dec_info(desc: Desc, ctor: Callable[[torch.dtype], object]) -> object:
    dtype = _dec_torch_attr({"kind": "dtype", "name": _get(desc, "dtype", str)}, torch.dtype)
    return ctor(typing.cast(torch.dtype, dtype))


def _dec_device(desc: Desc) -> torch.device:
    dev_type = _get(desc, "type", str)
    index = desc.get("index")
    if index is not None and type(index) is not int:
        raise CodecError("malformed 'device' descriptor: bad 'index'", fix=_FIX_STALE)
    try:
        return torch.device(dev_type) if index is None else torch.device(dev_type, index)
    except RuntimeError as exc:
        raise CodecError(
            f"device type {dev_type!r} is unknown to this torch ({exc})",
            fix=f"import its backend (e.g. torch_npu) before loading, or {_FIX_OFF}",
        ) from exc


def _dec_size(desc: Desc) -> torch.Size:
    dims = _get(desc, "dims", list)
    if not all(type(d) is int for d in dims):
        raise CodecError("malformed 'size' descriptor: non-int dim", fix=_FIX_STALE)
    return torch.Size(dims)


def _dec_enum(desc: Desc) -> object:
    cls = _dec_class(_get(desc, "cls", dict))
    members = getattr(cls, "__members__", None)
    _expect(isinstance(members, collections.abc.Mapping), cls, "an enum class")
    if "name" in desc:
        name = _get(desc, "name", str)
        member = typing.cast(collections.abc.Mapping, members).get(name, _MISSING)
        if member is _MISSING:
            raise CodecError(
                f"enum {cls.__module__}.{cls.__qualname__} has no member {name!r}",
                fix=f"the enum changed; {_FIX_STALE}",
            )
    else:
        _expect(issubclass(cls, enum.Enum), cls, "an enum.Enum subclass")
        member = cls(decode_value(_get(desc, "value", dict)))
    _expect(isinstance(member, cls), member, f"a member of {cls.__qualname__}")
    return member


def _dec_namedtuple(desc: Desc) -> tuple[Any, ...]:
    cls = typing.cast(Any, _dec_class(_get(desc, "cls", dict)))
    names = _get(desc, "names", list)
    _expect(
        issubclass(cls, tuple) and list(getattr(cls, "_fields", ())) == names,
        cls,
        f"a namedtuple class with fields {names}",
    )
    return typing.cast(tuple, cls._make([decode_value(d) for d in _get(desc, "fields", list)]))


def _dec_op(desc: Desc) -> object:
    """``torch.ops.<namespace>.<name>[.<overload>]``, found through torch's op registry."""
    namespace, _, name = _get(desc, "name", str).partition("::")
    op: Any = getattr(getattr(torch.ops, namespace), name)
    overload = desc.get("overload")
    if overload is not None:
        op = getattr(op, _get(desc, "overload", str))
    return op


def _dec_op_namespace(desc: Desc) -> object:
    name = _get(desc, "name", str)
    _expect(name.isidentifier(), name, "an operator namespace name")
    return getattr(torch.ops, name)


def _dec_module(desc: Desc) -> types.ModuleType:
    return _import(_get(desc, "name", str))


def _dec_module_dict(desc: Desc) -> dict[str, Any]:
    return vars(_dec_module({"kind": "module", "name": _get(desc, "module", str)}))


def _dec_typing_alias(desc: Desc) -> object:
    args = tuple(decode_value(d) for d in _get(desc, "args", list))
    if "typing_name" in desc:
        name = _get(desc, "typing_name", str)
        base = getattr(typing, name, None) if name.isidentifier() else None
        _expect(base is not None, base, f"typing.{name}")
    else:
        base = _dec_class(_get(desc, "origin", dict))
    return typing.cast(Any, base)[args[0] if len(args) == 1 else args]


def _dec_generic_alias(desc: Desc) -> types.GenericAlias:
    origin = decode_value(_get(desc, "origin", dict))
    _expect(isinstance(origin, type), origin, "a class")
    return types.GenericAlias(origin, tuple(decode_value(d) for d in _get(desc, "args", list)))


def _dec_dict(desc: Desc) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for pair in _get(desc, "items", list):
        if not isinstance(pair, list) or len(pair) != 2:
            raise CodecError("malformed 'dict' descriptor: bad item", fix=_FIX_STALE)
        out[decode_value(pair[0])] = decode_value(pair[1])
    return out


def _dec_bytes(desc: Desc) -> bytes:
    try:
        return base64.b64decode(_get(desc, "b64", str), validate=True)
    except ValueError as exc:
        raise CodecError("malformed 'bytes' descriptor", fix=_FIX_STALE) from exc


def _dec_float(desc: Desc, key: str = "hex") -> float:
    try:
        return float.fromhex(_get(desc, key, str))
    except ValueError as exc:
        raise CodecError(f"malformed float in {desc.get('kind')!r} descriptor", fix=_FIX_STALE) from exc


_DECODERS: dict[str, Callable[[Desc], object]] = {
    "none": lambda d: None,
    "ellipsis": lambda d: Ellipsis,
    "notimplemented": lambda d: NotImplemented,
    "bool": lambda d: _get(d, "value", bool),
    "int": lambda d: _get(d, "value", int),
    "float": _dec_float,
    "complex": lambda d: complex(_dec_float(d, "real"), _dec_float(d, "imag")),
    "str": lambda d: _get(d, "value", str),
    "bytes": _dec_bytes,
    "tuple": lambda d: tuple(decode_value(x) for x in _get(d, "items", list)),
    "frozenset": lambda d: frozenset(decode_value(x) for x in _get(d, "items", list)),
    "dict": _dec_dict,
    "dtype": lambda d: _dec_torch_attr(d, torch.dtype),
    "memory_format": lambda d: _dec_torch_attr(d, torch.memory_format),
    "layout": lambda d: _dec_torch_attr(d, torch.layout),
    "device": _dec_device,
    "size": _dec_size,
    "finfo": lambda d: _dec_info(d, torch.finfo),
    "iinfo": lambda d: _dec_info(d, torch.iinfo),
    "slice": lambda d: slice(
        decode_value(_get(d, "start", dict)),
        decode_value(_get(d, "stop", dict)),
        decode_value(_get(d, "step", dict)),
    ),
    "module": _dec_module,
    "op": _dec_op,
    "op_namespace": _dec_op_namespace,
    "list": lambda d: [decode_value(x) for x in _get(d, "items", list)],
    "set": lambda d: {decode_value(x) for x in _get(d, "items", list)},
    "range": lambda d: range(_get(d, "start", int), _get(d, "stop", int), _get(d, "step", int)),
    "module_dict": _dec_module_dict,
    "class": _dec_class,
    "enum": _dec_enum,
    "namedtuple": _dec_namedtuple,
    "function": _dec_function,
    "method": _dec_method,
    "generic_alias": _dec_generic_alias,
    "typing_alias": _dec_typing_alias,
}


def decode_value(desc: object) -> Any:
    """Rebuild the value an ``encode_value`` descriptor names.

    Named objects are found only by ``import_module`` + ``getattr`` and then
    type-checked (a class is a class, an enum member belongs to its enum, ...).
    """
    if not isinstance(desc, dict) or not isinstance(desc.get("kind"), str):
        raise CodecError(f"malformed descriptor {_short_repr(desc)}", fix=_FIX_STALE)
    decoder = _DECODERS.get(desc["kind"])
    if decoder is None:
        raise CodecError(
            f"unknown descriptor kind {desc['kind']!r}",
            fix=f"written by a newer codec? {_FIX_STALE}",
        )
    try:
        return decoder(desc)
    except CodecError:
        raise
    except Exception as exc:  # a value constructor rejected the descriptor's data
        raise CodecError(
            f"cannot rebuild {desc['kind']!r} value from {_short_repr(desc)} ({type(exc).__name__}: {exc})",
            fix=_FIX_STALE,
        ) from exc


# --------------------------------------------------------------------------
# code objects
# --------------------------------------------------------------------------


def _label(code: types.CodeType, parent: str | None) -> str:
    name = getattr(code, "co_qualname", code.co_name)
    return name if parent is None else f"{parent} > {name}"


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


class _ConstWalker:
    """Rebuilds a code object (nested code included) with each constant mapped by ``const``."""

    def code(self, code: types.CodeType, parent: str | None = None) -> types.CodeType:
        label = _label(code, parent)
        consts = []
        for index, const in enumerate(code.co_consts):
            try:
                consts.append(self.const(const, label))
            except CodecError as exc:
                raise exc.located(label, index) from None
        return code.replace(co_consts=tuple(consts))

    def const(self, value: object, label: str) -> object:
        raise NotImplementedError


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


class _SwapIn(_ConstWalker):
    """Inverse of ``_SwapOut``; decodes each table entry once, on first use."""

    def __init__(self, token: bytes, table: list[object]) -> None:
        self.token = token
        self.table = table
        self.values: dict[int, object] = {}

    def const(self, value: object, label: str) -> object:
        t = type(value)
        if t is types.CodeType:
            return self.code(typing.cast(types.CodeType, value), label)
        if t is tuple:
            items = typing.cast(tuple, value)
            if len(items) == 2 and type(items[0]) is bytes and items[0] == self.token:
                return self.placeholder(items[1])
            return tuple(self.const(v, label) for v in items)
        if t is frozenset:
            return frozenset(self.const(v, label) for v in typing.cast(frozenset, value))
        return value

    def placeholder(self, index: object) -> object:
        if type(index) is not int or not 0 <= typing.cast(int, index) < len(self.table):
            raise CodecError(f"placeholder index {index!r} out of range", fix=_FIX_STALE)
        i = typing.cast(int, index)
        if i not in self.values:
            self.values[i] = decode_value(self.table[i])
        return self.values[i]


def _python_tag() -> dict[str, Any]:
    return {"python": list(sys.version_info[:2]), "magic": importlib.util.MAGIC_NUMBER.hex()}


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


def _read_header(data: bytes) -> tuple[dict[str, Any], bytes]:
    if not data.startswith(_PREFIX):
        raise CodecError("not a code payload (bad prefix)", fix=_FIX_STALE)
    start = len(_PREFIX) + _HEADER_LEN.size
    if len(data) < start:
        raise CodecError("truncated code payload", fix=_FIX_STALE)
    (size,) = _HEADER_LEN.unpack_from(data, len(_PREFIX))
    if size > _MAX_HEADER or len(data) < start + size:
        raise CodecError("truncated or corrupt code payload header", fix=_FIX_STALE)
    try:
        header = json.loads(data[start : start + size].decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CodecError(f"corrupt code payload header ({exc})", fix=_FIX_STALE) from exc
    if not isinstance(header, dict):
        raise CodecError("corrupt code payload header (not an object)", fix=_FIX_STALE)
    return header, data[start + size :]


def _check_header(header: dict[str, Any], body: bytes, verified: bool = False) -> bytes:
    """Validate format, interpreter and body hash (unless ``verified``); return the placeholder token."""
    if header.get("format") != FORMAT_VERSION:
        raise CodecError(
            f"code payload format {header.get('format')!r}, this codec reads {FORMAT_VERSION}",
            fix=_FIX_STALE,
        )
    here = _python_tag()
    theirs = {"python": header.get("python"), "magic": header.get("magic")}
    if theirs != here:
        py = theirs["python"]
        their_py = ".".join(map(str, py)) if isinstance(py, list) else repr(py)
        raise CodecError(
            f"code payload was written by Python {their_py} (bytecode magic "
            f"{theirs['magic']}) but this is Python {sys.version_info[0]}."
            f"{sys.version_info[1]} (magic {here['magic']}); marshal and bytecode are "
            "version-specific",
            fix="recompile under this interpreter: delete the cache entry, or keep "
            "one cache directory per Python version",
        )
    if not isinstance(header.get("body_sha256"), str) or (
            not verified and header["body_sha256"] != hashlib.sha256(body).hexdigest()):
        raise CodecError("code payload body does not match its checksum", fix=_FIX_STALE)
    token = header.get("token")
    table = header.get("table")
    if not isinstance(token, str) or not isinstance(table, list):
        raise CodecError("code payload header lacks token/table", fix=_FIX_STALE)
    try:
        return bytes.fromhex(token)
    except ValueError as exc:
        raise CodecError("corrupt placeholder token", fix=_FIX_STALE) from exc


def loads_code(data: bytes, *, verified: bool = False) -> types.CodeType:
    """Inverse of ``dumps_code``; refuses other Python versions and corrupt data.
    ``verified``: the caller already checked these exact bytes against a sha256 (a cache
    entry's blob), so the body is not hashed a second time."""
    data = bytes(data)
    header, body = _read_header(data)
    token = _check_header(header, body, verified)
    try:
        code = marshal.loads(body)
    except (EOFError, ValueError, TypeError) as exc:
        raise CodecError(f"corrupt marshal body ({exc})", fix=_FIX_STALE) from exc
    if type(code) is not types.CodeType:
        raise CodecError(f"payload holds a {type(code).__qualname__}, not code", fix=_FIX_STALE)
    if not header["table"]:
        return code  # nothing was swapped out: no placeholder to find
    return _SwapIn(token, header["table"]).code(code)


# --------------------------------------------------------------------------
# fingerprint
# --------------------------------------------------------------------------

# Everything that changes what the code does.  Deliberately *not* hashed:
# co_filename, co_firstlineno, co_linetable/co_lnotab/positions.  An edit that
# only moves code (a blank line above it, a moved file) leaves the cached
# bytecode valid; its only cost is stale line numbers in tracebacks.
_FP_FIELDS = (
    "co_argcount",
    "co_posonlyargcount",
    "co_kwonlyargcount",
    "co_nlocals",
    "co_stacksize",
    "co_flags",
    "co_name",
    "co_qualname",
    "co_names",
    "co_varnames",
    "co_freevars",
    "co_cellvars",
)


#: bumped when what the fingerprint covers or how it is written changes (2: a tagged tuple
#: tree written by marshal format 2, ~15x faster than the JSON document of version 1)
FINGERPRINT_VERSION = 2
# marshal atoms, written by type and exact value (``1`` / ``1.0`` / ``True`` / ``'1'`` / ``b'1'``
# apart; ``-0.0`` too). Format 2 has no back-references, so the bytes depend on the values
# alone, never on reference counts (formats 3+ mark shared objects, which vary by process).
_FP_ATOMS: frozenset[type] = frozenset({type(None), bool, int, float, complex, str, bytes, type(Ellipsis)})


def _fp_item(value: object) -> object:
    t = type(value)
    if t in _FP_ATOMS:
        return value
    if t is types.CodeType:
        return _fp_tree(typing.cast(types.CodeType, value))
    if t is tuple:
        return ("t", tuple(_fp_item(v) for v in typing.cast(tuple, value)))
    if t is frozenset:
        return ("f", tuple(sorted(repr(_fp_item(v)) for v in typing.cast(frozenset, value))))
    try:
        return ("v", json.dumps(encode_value(value), sort_keys=True, separators=(",", ":")))
    except CodecError:
        pass
    # Only hand-built code gets here (compilers emit atoms/tuples/code).  A repr
    # with an address never matches again, which errs toward recompiling.
    try:
        text = repr(value)
    except Exception:
        text = f"<unrepresentable at {id(value):#x}>"
    return ("o", f"{t.__module__}.{t.__qualname__}", text)


def _fp_tree(code: types.CodeType) -> tuple[object, ...]:
    """Every tuple of the tree is tagged (``c`` code, ``t`` tuple, ``f`` frozenset, ``v``/``o``
    other values) and atoms never are tuples, so two different codes never write alike."""
    return ("c", *(getattr(code, f, None) for f in _FP_FIELDS), code.co_code,
            getattr(code, "co_exceptiontable", b""), tuple(_fp_item(c) for c in code.co_consts))


#: id(code) -> (code, fingerprint): a live code object never changes (strong refs, bounded)
_fp_memo: dict[int, tuple[types.CodeType, str]] = {}
_FP_MEMO_MAX = 8192


def code_fingerprint(code: types.CodeType) -> str:
    """sha256 over what ``code`` does (bytecode, constants, names, signature).

    Line numbers and the file name are excluded (see ``_FP_FIELDS``); the
    interpreter's version and bytecode magic are included because bytecode is
    only comparable within one version. Memoized per code object (capture, the
    sources check and the guards fingerprint the same functions).
    """
    hit = _fp_memo.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    tag = (FINGERPRINT_VERSION, *sys.version_info[:2], importlib.util.MAGIC_NUMBER)
    fp = hashlib.sha256(marshal.dumps((tag, _fp_tree(code)), 2)).hexdigest()
    if len(_fp_memo) >= _FP_MEMO_MAX:
        _fp_memo.clear()
    _fp_memo[id(code)] = (code, fp)
    return fp
