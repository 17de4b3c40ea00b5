"""Decoders of the value kinds few programs hold (see ``code_codec.decode_value``).

Bytes, complex numbers, sets, slices, ranges, ``finfo``/``iinfo``, a module's
``__dict__``, namedtuples, bound methods and typing aliases: found the same way
(import + attribute walk, then type-checked), imported by the first such value a
load decodes.
"""

from __future__ import annotations

import base64
import types
import typing
from collections.abc import Callable
from typing import Any

import torch

from .code_codec import (
    _FIX_STALE,
    _MISSING,
    CodecError,
    Desc,
    _dec_class,
    _dec_float,
    _dec_module,
    _dec_torch_attr,
    _expect,
    _get,
    decode_value,
)


def _dec_method(desc: Desc) -> object:
    owner = decode_value(_get(desc, "owner", dict))
    name = _get(desc, "name", str)
    obj = getattr(owner, name, _MISSING) if name.isidentifier() else _MISSING
    _expect(callable(obj), obj, f"a callable attribute {name!r}")
    return obj


def _dec_info(desc: Desc, ctor: Callable[[torch.dtype], object]) -> object:
    dtype = _dec_torch_attr({"kind": "dtype", "name": _get(desc, "dtype", str)}, torch.dtype)
    return ctor(typing.cast(torch.dtype, dtype))


def _dec_namedtuple(desc: Desc) -> tuple[Any, ...]:
    cls = typing.cast(Any, _dec_class(_get(desc, "cls", dict)))
    names = _get(desc, "names", list)
    _expect(
        issubclass(cls, tuple) and list(getattr(cls, "_fields", ())) == names,
        cls,
        f"a namedtuple class with fields {names}",
    )
    return typing.cast(tuple, cls._make([decode_value(d) for d in _get(desc, "fields", list)]))


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


def _dec_bytes(desc: Desc) -> bytes:
    try:
        return base64.b64decode(_get(desc, "b64", str), validate=True)
    except ValueError as exc:
        raise CodecError("malformed 'bytes' descriptor", fix=_FIX_STALE) from exc


RARE_DECODERS: dict[str, Callable[[Desc], object]] = {
    "complex": lambda d: complex(_dec_float(d, "real"), _dec_float(d, "imag")),
    "bytes": _dec_bytes,
    "frozenset": lambda d: frozenset(decode_value(x) for x in _get(d, "items", list)),
    "set": lambda d: {decode_value(x) for x in _get(d, "items", list)},
    "finfo": lambda d: _dec_info(d, torch.finfo),
    "iinfo": lambda d: _dec_info(d, torch.iinfo),
    "slice": lambda d: slice(
        decode_value(_get(d, "start", dict)),
        decode_value(_get(d, "stop", dict)),
        decode_value(_get(d, "step", dict)),
    ),
    "range": lambda d: range(_get(d, "start", int), _get(d, "stop", int), _get(d, "step", int)),
    "module_dict": _dec_module_dict,
    "namedtuple": _dec_namedtuple,
    "method": _dec_method,
    "generic_alias": _dec_generic_alias,
    "typing_alias": _dec_typing_alias,
}
