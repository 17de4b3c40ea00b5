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

This module is the decode side (and the fingerprint), which every warm start runs;
the encode side (``encode_value``, ``dumps_code``) is ``code_encode``, imported only
by capture and re-exported here lazily.
"""

from __future__ import annotations

import collections.abc
import enum
import hashlib
import importlib
import importlib.util
import json
import marshal
import operator
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


def _dec_torch_attr(desc: Desc, typ: type) -> object:
    name = _get(desc, "name", str)
    obj = getattr(torch, name, None) if name.isidentifier() else None
    _expect(type(obj) is typ, obj, f"a {typ.__qualname__} named torch.{name}")
    return obj


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


def _dec_module(desc: Desc) -> types.ModuleType:
    return _import(_get(desc, "name", str))


def _dec_dict(desc: Desc) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for pair in _get(desc, "items", list):
        if not isinstance(pair, list) or len(pair) != 2:
            raise CodecError("malformed 'dict' descriptor: bad item", fix=_FIX_STALE)
        out[decode_value(pair[0])] = decode_value(pair[1])
    return out


def _dec_float(desc: Desc, key: str = "hex") -> float:
    try:
        return float.fromhex(_get(desc, key, str))
    except ValueError as exc:
        raise CodecError(f"malformed float in {desc.get('kind')!r} descriptor", fix=_FIX_STALE) from exc


def _type_name(obj: object) -> str:
    """``module.qualname`` of ``obj``'s type: how a ``global`` descriptor names what it found."""
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _dec_global(desc: Desc) -> object:
    """An object a module binds at its top level (``encode_global``: transformers' modeling
    modules bind such instances with ``kernels`` installed), of the type it had when captured."""
    module = _import(_get(desc, "module", str))
    name = _get(desc, "name", str)
    obj = vars(module).get(name, _MISSING) if name.isidentifier() else _MISSING
    if obj is _MISSING:
        raise CodecError(f"module {module.__name__!r} has no top-level name {name!r}",
                         fix=f"the code changed since it was cached; {_FIX_STALE}")
    _expect(_type_name(obj) == _get(desc, "type", str), obj, f"a {desc['type']}")
    return obj


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


#: the kinds most programs hold; the rest (``code_decode_rare``) are imported by the first value of such a kind
_DECODERS: dict[str, Callable[[Desc], object]] = {
    "none": lambda d: None,
    "ellipsis": lambda d: Ellipsis,
    "notimplemented": lambda d: NotImplemented,
    "bool": lambda d: _get(d, "value", bool),
    "int": lambda d: _get(d, "value", int),
    "float": _dec_float,
    "str": lambda d: _get(d, "value", str),
    "tuple": lambda d: tuple(decode_value(x) for x in _get(d, "items", list)),
    "dict": _dec_dict,
    "dtype": lambda d: _dec_torch_attr(d, torch.dtype),
    "memory_format": lambda d: _dec_torch_attr(d, torch.memory_format),
    "layout": lambda d: _dec_torch_attr(d, torch.layout),
    "device": _dec_device,
    "size": _dec_size,
    "module": _dec_module,
    "list": lambda d: [decode_value(x) for x in _get(d, "items", list)],
    "class": _dec_class,
    "enum": _dec_enum,
    "function": _dec_function,
    "global": _dec_global,
    "op": _dec_op,  # MoE routing (Mixtral, Qwen3-MoE, DeepSeek-V3) holds torch.ops.aten.* constants
    "op_namespace": _dec_op_namespace,
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
        from .code_decode_rare import RARE_DECODERS

        decoder = RARE_DECODERS.get(desc["kind"])
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
    if t is tuple:  # a tuple of atoms maps to itself: no walk
        value = typing.cast(tuple, value)
        return ("t", value if _FP_ATOMS.issuperset(map(type, value)) else tuple(map(_fp_item, value)))
    if t is frozenset:
        return ("f", tuple(sorted(repr(_fp_item(v)) for v in typing.cast(frozenset, value))))
    from .code_encode import encode_value  # rare: a constant that is not plain data

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


#: the fields ``_fp_tree`` writes, read in one C call (where the interpreter has them all)
_FP_CODE_FIELDS = operator.attrgetter(*_FP_FIELDS, "co_code", "co_exceptiontable")


def _fp_tree(code: types.CodeType) -> tuple[object, ...]:
    """Every tuple of the tree is tagged (``c`` code, ``t`` tuple, ``f`` frozenset, ``v``/``o``
    other values) and atoms never are tuples, so two different codes never write alike. An
    atom is written as itself, so constants that are all atoms are written without a walk
    (the warm start's guards fingerprint every function they check)."""
    try:
        fields: tuple[object, ...] = _FP_CODE_FIELDS(code)
    except AttributeError:  # another interpreter's code object: a missing field is written as a default
        fields = (*(getattr(code, f, None) for f in _FP_FIELDS), code.co_code, getattr(code, "co_exceptiontable", b""))
    consts = code.co_consts
    if not _FP_ATOMS.issuperset(map(type, consts)):
        consts = tuple(map(_fp_item, consts))
    return ("c", *fields, consts)


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


#: the encode side (capture only) lives in ``code_encode``: a warm start never imports it
_ENCODE_SIDE = frozenset({"encode_value", "encode_global", "dumps_code", "_locate", "_fresh_token", "_SwapOut"})


def __getattr__(name: str) -> Any:
    if name in _ENCODE_SIDE:
        from . import code_encode

        return getattr(code_encode, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
