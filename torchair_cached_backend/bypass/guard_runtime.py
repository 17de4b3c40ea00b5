"""Evaluating recorded guards at a warm start, without Dynamo.

A frame's guards are stored as one blob (compiled once at capture, marshalled
through our code codec: the checks every warm start runs; apart, the full check
only ``guards="call"`` uses and the guards' explanations, read only when a guard
fails) plus a JSON table of the constants the checks compare against. This module rebuilds that namespace: the helper
functions the guard expressions call, the decoded constants, and the live
module globals the expressions read as ``___G``. The same namespace is used at
capture to self-test the generated checks, so both processes evaluate
identically.
"""

from __future__ import annotations

import builtins
import collections
import hashlib
import importlib
import importlib.util
import json
import marshal
import math
import operator
import os
import struct
import sys
import types
import zlib
from collections.abc import Callable
from typing import Any

import torch

from .. import code_codec
from ..key import storage_groups
from . import world_state

#: bumped when the generated check module's contract changes (3: the blob holds the
#: checks, the full check and the explanations as separate parts; 4: a check repeated per
#: item of a module list is one check in a loop over the items; 5: reads shared by guards bound
#: once, resolved-method guards as memoizing sites, ``___dict_has``; 6: a function's bound
#: values digested from their marshal form, not their JSON text; 7: a guard on a global or a container
#: the frame itself changes is a per-call check; 8: a process-wide switch, ``torch.backends.*``, is a per-call check; so is
#: the torch.func transform stack)
CHECKS_FORMAT = 8
_BLOB_MAGIC = b"npu_cached guards 4\0"
_SIZES = struct.Struct("<3Q")


def unpack_checks(blob: bytes) -> tuple[bytes, bytes, bytes]:
    """The three parts of :func:`pack_checks`; CodecError for anything else."""
    head = len(_BLOB_MAGIC) + _SIZES.size
    if not blob.startswith(_BLOB_MAGIC) or len(blob) < head:
        raise code_codec.CodecError("the guards blob is not in this version's format",
                                    fix="it is rebuilt by the next compile")
    sizes = _SIZES.unpack_from(blob, len(_BLOB_MAGIC))
    if head + sum(sizes) != len(blob):
        raise code_codec.CodecError("the guards blob's parts do not add up (truncated?)",
                                    fix="it is rebuilt by the next compile")
    a, b = head + sizes[0], head + sizes[0] + sizes[1]
    return blob[head:a], blob[a:b], blob[b:]


def _inflate(part: bytes | None) -> bytes:
    try:
        return zlib.decompress(part or b"")
    except zlib.error as exc:
        raise code_codec.CodecError(f"a part of the guards blob does not decompress ({exc})",
                                    fix="it is rebuilt by the next compile") from None


def _odict_getitem(d: Any, key: Any) -> Any:
    return collections.OrderedDict.__getitem__(d, key)


def _dict_contains(key: Any, d: Any) -> bool:
    return dict.__contains__(d, key)


def _tuple_iterator_len(it: Any) -> int:
    _, (obj,), start = it.__reduce__()
    return len(obj) - start


def _tuple_iterator_getitem(it: Any, index: int) -> Any:
    _, (obj,), start = it.__reduce__()
    return obj[start + index]


def _dataclass_fields(obj: Any) -> Any:
    import dataclasses

    return dataclasses.fields(obj)


def _type_name(cls: Any) -> str:
    """``module.qualname`` of a class: how a class defined in a function is named across processes."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _eq(value: Any, expected: Any) -> bool:
    """Dynamo's EQUALS_MATCH: same type and equal (NaN equals NaN)."""
    if type(value) is not type(expected):
        return False
    if value == expected:
        return True
    return isinstance(expected, float) and math.isnan(expected) and math.isnan(value)


def _code_fp(code: Any) -> str:
    """Fingerprint of a code object: the codec's (memoized per object, the same digest capture
    stored)."""
    return code_codec.code_fingerprint(code)


def _fn_fp(fn: Any) -> str:
    """A Python function by what it runs: its code's fingerprint (defaults and closure
    contents are guarded separately, as Dynamo does)."""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return f"<not a Python function: {type(fn).__qualname__}>"
    return _code_fp(code)


def _resolved(cls: Any, name: str) -> Any:
    """What ``obj.name`` calls for an instance of ``cls`` (or ``cls.name``): the first
    definition along ``cls.__mro__``, unwrapped to its function (static/class methods,
    properties); None when no class defines it."""
    for klass in cls.__mro__:
        raw = klass.__dict__.get(name, _MISSING)
        if raw is _MISSING:
            continue
        return unwrap_attribute(raw)
    return None


_MISSING = object()


def unwrap_attribute(raw: Any) -> Any:
    if type(raw) is types.FunctionType:  # the common case, without the failed ``func`` lookup below
        return raw
    if isinstance(raw, (staticmethod, classmethod)):
        return raw.__func__
    if isinstance(raw, property):
        return raw.fget
    func = getattr(raw, "func", None)  # functools.cached_property
    if type(raw).__name__ == "cached_property" and func is not None:
        return func
    return raw


def _fn_digest(fn: Any) -> str:
    """A function by what it runs *and* the values bound to it: its code's fingerprint
    plus its defaults and closure contents (a dataclass ``__init__`` is generated code
    whose field defaults are its ``__defaults__``). Memoized per function object, the memo
    re-validated on every use by identity of everything the digest reads that can be
    reassigned (see :func:`_bound_snapshot`)."""
    return _fn_digest_and_state(fn)[0]


def _fn_digest_and_state(fn: Any) -> tuple[str, list[tuple[Any, ...]] | None]:
    """:func:`_fn_digest` and the snapshot that pins it (None: not pinned by identities)."""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return f"<not a Python function: {type(fn).__qualname__}>", None
    fp = _code_fp(code)
    if not (fn.__defaults__ or fn.__kwdefaults__ or fn.__closure__):
        if type(fn) is not types.FunctionType:
            return fp, None
        kwdefaults = fn.__kwdefaults__
        items = tuple(kwdefaults.items()) if kwdefaults is not None else None
        return fp, [(fn, code, fn.__defaults__, kwdefaults, items, (), ())]
    hit = _digest_memo.get(id(fn))
    if hit is not None and hit[0] is fn and _bound_same(hit[1]):
        return hit[2], hit[1]
    nodes = _bound_snapshot(fn)  # before the digest: a change meanwhile fails the next validation
    value = fp + ":" + _bound_digest(fn)
    if nodes is not None:  # the entry holds what it was made from: its ids stay unique
        _digest_memo[id(fn)] = (fn, nodes, value)
    return value, nodes


_digest_memo: dict[int, tuple[Any, Any, str]] = {}
_is = operator.is_
_cell_contents = operator.attrgetter("cell_contents")
#: values whose identity fixes what ``describe_value`` makes of them (immutable, or described by name)
_IDENTITY_STABLE = (type(None), bool, int, float, complex, str, bytes, type, types.ModuleType,
                    types.BuiltinFunctionType, torch.dtype, torch.device, torch.layout, torch.memory_format)
#: a callable bound this many levels of functions below the digested one is described by its
#: name only (``describe_value`` stops at depth 4, and each level of functions adds at least 2)
_NAMED_ONLY_LEVEL = 3


def _bound_snapshot(fn: Any) -> list[tuple[Any, ...]] | None:
    """What :func:`_fn_digest` of ``fn`` depends on, as identities to re-check: for ``fn`` and
    every function bound to it (in a default or a closure cell, recursively, as deep as the
    digest describes them) its ``__code__``, ``__defaults__``, ``__kwdefaults__`` (and each
    of its items) and its cells' contents (a function's ``__closure__`` itself is read-only).
    None when a bound value is one identity does not pin (a list, a dict, a tensor, an object
    with state, a bound method...): then the digest is recomputed on every use."""
    nodes: list[tuple[Any, ...]] = []
    try:
        return nodes if _bound_nodes(fn, nodes, 0) else None
    except ValueError:  # an empty cell
        return None


def _bound_nodes(fn: Any, nodes: list[tuple[Any, ...]], level: int) -> bool:
    kwdefaults = fn.__kwdefaults__
    cells = fn.__closure__ or ()
    contents = tuple(map(_cell_contents, cells))
    items = tuple(kwdefaults.items()) if kwdefaults is not None else None
    nodes.append((fn, fn.__code__, fn.__defaults__, kwdefaults, items, cells, contents))
    values = [*(fn.__defaults__ or ()), *(v for _, v in items or ()), *contents]
    return all(_identity_pins(v, nodes, level + 1) for v in values)


def _identity_pins(value: Any, nodes: list[tuple[Any, ...]], level: int) -> bool:
    """Whether the identity of ``value`` (a function's, with its nodes added) fixes its description."""
    if isinstance(value, _IDENTITY_STABLE):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_identity_pins(v, nodes, level) for v in value)
    if level >= _NAMED_ONLY_LEVEL and callable(value) and not isinstance(value, torch.nn.Module):
        return True
    if type(value) is types.FunctionType:
        return _bound_nodes(value, nodes, level)
    return False


def _bound_same(nodes: list[tuple[Any, ...]]) -> bool:
    """Whether every identity :func:`_bound_snapshot` recorded still holds."""
    try:
        for fn, code, defaults, kwdefaults, items, cells, contents in nodes:
            if fn.__code__ is not code or fn.__defaults__ is not defaults or fn.__kwdefaults__ is not kwdefaults:
                return False
            if items is not None and (len(kwdefaults) != len(items)
                                      or not all(kwdefaults.get(k, _MISSING) is v for k, v in items)):
                return False
            if cells and not all(map(_is, map(_cell_contents, cells), contents)):
                return False
    except ValueError:  # a cell emptied since
        return False
    return True


class ResolvedSite:
    """One ``___fn_digest(___resolved(owner, name)) == digest`` guard of a generated check,
    with a memo of the last resolution that held: the owner, its ``__mro__`` (replaced when
    ``__bases__`` is assigned), the class dicts (live views) before the defining class, which
    must still not define ``name``, the defining class's entry, and the function's bound
    state (:func:`_bound_snapshot`). Re-validated by identity on every call; anything else
    takes the full path, which re-resolves and re-digests."""

    __slots__ = ("name", "digest", "memo")

    def __init__(self, name: str, digest: str) -> None:
        self.name = name
        self.digest = digest
        self.memo: tuple[Any, ...] | None = None

    def holds(self, owner: Any) -> bool:
        memo = self.memo
        if memo and owner is memo[0] and owner.__mro__ is memo[1]:
            name = self.name
            for proxy in memo[2]:
                if name in proxy:
                    break
            else:
                raw, fn = memo[3].get(name, _MISSING), memo[5]
                if raw is memo[4] and (raw is fn or unwrap_attribute(raw) is fn) and _bound_same(memo[6]):
                    return True
        return self._resolve(owner)

    def _resolve(self, owner: Any) -> bool:
        """The guard as written (resolve, digest), memoized from its second evaluation on (a
        check evaluated once, at load, does not pay for the memo)."""
        if self.memo is None:
            self.memo = ()
            return _fn_digest(_resolved(owner, self.name)) == self.digest
        name = self.name
        mro = owner.__mro__
        before = []
        for klass in mro:
            proxy = klass.__dict__
            raw = proxy.get(name, _MISSING)
            if raw is not _MISSING:
                break
            before.append(proxy)
        else:
            return _fn_digest(None) == self.digest
        fn = unwrap_attribute(raw)
        digest, nodes = _fn_digest_and_state(fn)  # the state read before the digest
        ok = digest == self.digest
        self.memo = (owner, mro, tuple(before), proxy, raw, fn, nodes) if ok and nodes is not None else ()
        return ok


def _resolved_site(name: str, digest: str) -> Callable[[Any], bool]:
    return ResolvedSite(name, digest).holds


def _bound_digest(fn: Any) -> str:
    """sha256 of the values bound to ``fn`` as :func:`fingerprint.describe_value` describes
    them (:func:`_describe`: the same description, faster for the common values), written
    by marshal (equal descriptions write equal bytes: their dicts are built in a fixed or
    sorted order, so the JSON writer's key sort added nothing but time)."""
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_describe(cell.cell_contents, 0))
        except ValueError:  # an empty cell
            cells.append("<empty>")
    bound = [_describe(fn.__defaults__, 0), _describe(fn.__kwdefaults__, 0), cells]
    try:  # marshal format 0: bytes by type and value alone (no references, no interning marks); ~5x faster
        blob = b"m" + marshal.dumps(bound, 0)
    except ValueError:  # a value marshal cannot write (describe_value returns JSON data; never seen)
        blob = b"j" + json.dumps(bound, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


_PLAIN = (bool, int, float, str)
_describers: tuple[Any, Any] | None = None


def _load_describers() -> tuple[Any, Any]:
    """``fingerprint``'s describers, imported on first use (not every guard needs them)."""
    global _describers
    from ..fingerprint import describe_value, qualified_name

    _describers = (describe_value, qualified_name)
    return _describers
_DESCRIBE_MAX_DEPTH = 4  # fingerprint._MAX_DEPTH


def _describe(value: Any, depth: int) -> Any:
    """Exactly ``fingerprint.describe_value(value, depth)`` (tested), without its generic
    dispatch for what functions bind most (atoms, tuples, dicts, modules, classes, plain
    functions: a function's code by the same fingerprint, via the fast walk); anything
    else is described by ``describe_value`` itself."""
    if value is None or isinstance(value, _PLAIN):
        return value
    describe_value, qualified_name = _describers or _load_describers()
    if depth > _DESCRIBE_MAX_DEPTH:
        return describe_value(value, depth)
    t = type(value)
    if t is tuple or t is list:
        return [_describe(v, depth + 1) for v in value]
    if t is dict:
        return {str(k): _describe(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if t is types.ModuleType:
        return {"module": value.__name__}
    if t is types.FunctionType:
        if depth + 1 > _DESCRIBE_MAX_DEPTH:
            return qualified_name(value)
        cells = []
        for cell in value.__closure__ or ():
            try:
                cells.append(_describe(cell.cell_contents, depth + 2))
            except ValueError:  # an empty cell
                cells.append("<empty>")
        return {"code": _code_fp(value.__code__), "defaults": _describe(value.__defaults__, depth + 2),
                "kwdefaults": _describe(value.__kwdefaults__, depth + 2), "closure": cells}
    if isinstance(value, type) and type(getattr(value, "__code__", None)) is not types.CodeType \
            and not issubclass(t, torch.nn.Module):
        return qualified_name(value)
    return describe_value(value, depth)


def _dist_state() -> tuple[Any, ...]:
    """(initialized, rank, world size) of the default process group: values Dynamo folds
    into a graph as constants when forward calls ``dist.get_rank()`` and friends."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return (False, -1, -1)
    return (True, dist.get_rank(), dist.get_world_size())


def _matmul(flags: tuple[str, ...]) -> tuple[Any, ...]:
    """``torch.backends.cuda.matmul``'s ``flags`` (None where this torch has no such flag): a
    forward that reads one has its value folded into the graph."""
    matmul = torch.backends.cuda.matmul
    out = []
    for flag in flags:
        try:
            out.append(getattr(matmul, flag))
        except Exception:  # noqa: BLE001  (not a flag of this torch)
            out.append(None)
    return tuple(out)


def _env(names: tuple[str, ...]) -> tuple[Any, ...]:
    """The environment variables ``names`` (None when unset): a forward that reads one
    has its value folded into the graph. Read as ``os.environ.get`` reads them (its
    ``_data`` under the encoded key), without the two exceptions an unset name costs there."""
    environ = os.environ
    data, encode, decode = (getattr(environ, a, None) for a in ("_data", "encodekey", "decodevalue"))
    if type(environ) is not os._Environ or not isinstance(data, dict) or encode is None or decode is None:
        return tuple(environ.get(n) for n in names)
    out = []
    for name in names:
        value = data.get(encode(name))
        out.append(None if value is None else decode(value))
    return tuple(out)


def _from_numpy(value: Any) -> Any:
    """Dynamo's ``___from_numpy``: the tensor view of a numpy array or scalar."""
    return torch.as_tensor(value)


def function_modes(stack: list[Any] | None = None) -> tuple[Any, ...]:
    """The torch function mode stack (``stack``: as Dynamo saw it while tracing, when it
    has popped it), portably: each mode's class by path, and for
    ``torch.set_default_device``'s DeviceContext its device (Dynamo folds it in)."""
    if stack is None:
        n = torch._C._len_torch_function_stack()
        if not n:
            return ()
        stack = [torch._C._get_function_stack_at(i) for i in range(n)]
    out = []
    for mode in stack:
        cls = type(mode)
        device = getattr(mode, "device", None)
        out.append((f"{cls.__module__}.{cls.__qualname__}", None if device is None else str(device)))
    return tuple(out)


def _autocast(device_type: str) -> tuple[bool, Any]:
    if not torch.is_autocast_enabled(device_type):
        return (False, None)
    return (True, torch.get_autocast_dtype(device_type))


def _tensor_meta(t: Any) -> str:
    """``float32[7, 16] stride (16, 1) cpu``: what a tensor guard compares, for messages."""
    if not isinstance(t, torch.Tensor):
        return f"not a tensor ({type(t).__qualname__})"
    grad = " requires_grad" if t.requires_grad else ""
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)} stride {tuple(t.stride())} {t.device}{grad}"


#: names the generated guard expressions may call (Dynamo's helper names where its
#: source expressions use them, ``___``-prefixed ones of our own otherwise)
HELPERS: dict[str, Any] = {
    "___builtins": builtins,  # builtins a parameter shadows (guard_codegen._unshadowed)
    "___odict_getitem": _odict_getitem,
    "___dict_contains": _dict_contains,
    "___tuple_iterator_len": _tuple_iterator_len,
    "___tuple_iterator_getitem": _tuple_iterator_getitem,
    "___dataclass_fields": _dataclass_fields,
    "___namedtuple_fields": lambda x: x._fields,
    "__math_isnan": math.isnan,
    "math": math,
    "inf": math.inf,
    "__load_module": importlib.import_module,
    "device": torch.device,
    "torch": torch,
    "___tname": _type_name,
    "___tmeta": _tensor_meta,
    "___eq": _eq,
    "___code_fp": _code_fp,
    "___fn_fp": _fn_fp,
    "___fn_digest": _fn_digest,
    "___resolved_site": _resolved_site,
    "___dict_has": dict.__contains__,
    "___resolved": _resolved,
    "___dist": _dist_state,
    "___storages": lambda *tensors: storage_groups(tensors),
    "___env": _env,
    "___matmul": _matmul,
    "___from_numpy": _from_numpy,
    "___tf_modes": function_modes,
    "___get_torch_function_mode_stack_at": lambda i: torch._C._get_function_stack_at(i),
    "___grad": torch.is_grad_enabled,
    "___functorch_stack": torch._C._functorch.peek_interpreter_stack,
    "___any_autocast": torch._C._is_any_autocast_enabled,
    "___autocast": _autocast,
    "___default_dtype": torch.get_default_dtype,
    "___deterministic": lambda: (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ),
    **world_state.HELPERS,  # origins of objects found by path, dispatch modes, process groups
}


class GuardChecks:
    """The checks of one frame, rebuilt in this process.

    ``call(*args, **kwargs)`` binds like the frame's function and says whether the
    per-call guards hold; ``full`` checks every guard per call (used when the
    receiver is not fixed at load, and for ``guards="call"``); ``load_failures``
    evaluates the load-time guards once and names the ones that fail. Messages
    are made only on failure, from the guard's expression text.
    """

    __slots__ = ("call", "bind", "load_check", "receiver", "namespace", "_full", "_full_code", "_meta",
                 "_meta_json", "_defaults", "_decoded")

    def __init__(self, namespace: dict[str, Any], meta: list[dict[str, Any]] | None, receiver: str | None,
                 full_code: bytes | None = None, meta_json: bytes | None = None,
                 decoded: tuple[dict[str, Any], str] | None = None) -> None:
        self.call: Callable[..., bool] = namespace["___call_check"]
        self.bind: Callable[..., dict[str, Any]] = namespace["___bind"]
        self.load_check: Callable[[dict[str, Any]], int] = namespace["___load_check"]
        self._full: Callable[..., bool] | None = namespace.get("___full_check")
        self._full_code = full_code
        self._meta = meta if meta_json is None else None
        self._meta_json = meta_json
        self._defaults: tuple[Any, Any] | None = None
        self._decoded = decoded  # (code objects by blob name, this blob's): the full check decoded once
        self.receiver = receiver
        self.namespace = namespace

    @property
    def full(self) -> Callable[..., bool]:
        """Every guard per call; loaded on first use (``guards="call"``, an unfixed receiver)."""
        if self._full is None:
            code = _decoded_once(self._decoded, "#full",
                                 lambda: code_codec.loads_code(_inflate(self._full_code), verified=True))
            exec(code, self.namespace)  # noqa: S102 - ours, checksummed
            self._full = self.namespace["___full_check"]
            if self._defaults is not None:
                _bind_defaults(self._full, *self._defaults)
        return self._full

    @property
    def meta(self) -> list[dict[str, Any]]:
        """The guards' expressions and explanations: parsed only when one fails."""
        if self._meta is None:
            self._meta = json.loads(_inflate(self._meta_json))
        return self._meta

    def set_defaults(self, defaults: tuple[Any, ...] | None, kwdefaults: dict[str, Any] | None) -> None:
        """Bind like the live function: same positional and keyword-only defaults
        (plus the closure cells the checks read free variables from)."""
        self._defaults = (defaults, kwdefaults)
        for fn in (self.call, self._full, self.bind):
            if fn is not None:
                _bind_defaults(fn, defaults, kwdefaults)

    def load_holds(self, local: dict[str, Any]) -> bool:
        """Whether every load-time guard holds for ``local`` (the receiver, closure contents)."""
        try:
            return self.load_check(local) == -1
        except Exception:
            return False

    def load_failures(self, local: dict[str, Any]) -> list[str]:
        """The load-time guards that fail for ``local`` (the receiver, closure contents)."""
        if self.load_holds(local):
            return []
        return self.failures(local, ("load",)) or ["a load-time guard fails"]

    def failures(self, local: dict[str, Any], scopes: tuple[str, ...]) -> list[str]:
        """Descriptions of the guards of ``scopes`` that fail for the frame locals ``local``
        (slow path: ``guard_cold``)."""
        from .guard_cold import failures

        return failures(self, local, scopes)

    def call_failures(self, args: tuple[Any, ...], kwargs: dict[str, Any], full: bool) -> list[str]:
        """Per-call guards that fail for these arguments (for the log line; slow path)."""
        from .guard_cold import call_failures

        return call_failures(self, args, kwargs, full)


def _bind_defaults(fn: Any, defaults: tuple[Any, ...] | None, kwdefaults: dict[str, Any] | None) -> None:
    fn.__defaults__ = defaults
    merged = dict(fn.__kwdefaults__ or {})
    merged.update(kwdefaults or {})
    fn.__kwdefaults__ = merged or None


def receiver_locals(ref: str | None, value: Any) -> dict[str, Any]:
    """Frame locals that make ``ref`` evaluate to ``value`` (for load-time checks)."""
    if ref is None:
        return {}
    name = ref[3 : ref.index("]") - 1]  # L['name'] or L['name'][0]
    return {name: (value,) if ref.endswith("[0]") else value}


def receiver_value(ref: str | None, local_scope: dict[str, Any]) -> Any:
    if ref is None:
        return None
    return eval(ref, {}, {"L": local_scope})  # noqa: S307 - L[name] or L[name][0]


def build_checks(
    code_blob: bytes,
    consts: list[Any],
    meta: list[dict[str, Any]],
    scope: dict[str, Any],
    receiver: str | None,
    recv: Any = None,
    memo: dict[str, Any] | None = None,
    decoded: tuple[dict[str, Any], str] | None = None,
) -> GuardChecks:
    """Rebuild a frame's checks: decode constants, exec the stored check module
    with ``scope`` (the live module globals) as ``___G``; ``recv`` is the bound
    receiver a resume frame's receiver argument must be. ``decoded``: (code objects by
    blob name, this blob's name), so the loads of one program decode it once (``shared_load``).
    (``meta``: unused since format 3, the explanations travel in the blob.)"""
    namespace: dict[str, Any] = dict(HELPERS)
    namespace["___G"] = scope
    namespace["___recv"] = recv
    namespace.update(_decoded_once(decoded, "#consts", lambda: {
        f"___c{i}": value for i, value in enumerate(decode_consts(consts, {} if memo is None else memo))}))
    checks_code, full_code, meta_json = unpack_checks(code_blob)
    code = _decoded_once(decoded, "", lambda: code_codec.loads_code(checks_code, verified=True))  # sha256 checked
    exec(code, namespace)  # noqa: S102 - ours, checksummed
    return GuardChecks(namespace, None, receiver, full_code, meta_json, decoded)


def _decoded_once(decoded: tuple[dict[str, Any], str] | None, part: str, make: Callable[[], Any]) -> Any:
    """``make()`` (a part of a guards blob, decoded), kept under the blob's name + ``part`` in the
    memo of ``decoded`` = (memo, blob name) so the loads of one program decode it once; no memo: made."""
    if decoded is None:
        return make()
    memo, name = decoded
    value = memo.get(name + part)
    if value is None:
        value = memo[name + part] = make()
    return value


def decode_consts(consts: list[Any], memo: dict[Any, Any]) -> list[Any]:
    """A frame's constant table decoded, shared through ``memo`` by the program's frames
    (variants of one program share most constants), in one pass: classes, functions and
    modules named by path (nearly all of a table) are resolved here, each module looked up
    once, with the codec's checks; anything else, and any of those that does not resolve
    cleanly, by :func:`decode_const` (which then names the problem)."""
    out = []
    append = out.append
    modules: dict[str, Any] = {}
    for desc in consts:
        if type(desc) is dict and _KEY_TYPES.issuperset(map(type, desc.values())):
            key: Any = tuple(desc.items())  # names only: equal keys are equal descriptors
        else:  # numbers (1 == True == 1.0 as keys), nested descriptors: by their text
            key = repr(desc)
        value = memo.get(key, _MISSING)
        if value is _MISSING:
            value = _named(desc, modules)
            if value is _MISSING:
                value = decode_const(desc)
            memo[key] = value
        append(value)
    return out


_KEY_TYPES = frozenset({str, type(None)})
#: kind -> what the named object must be (as ``code_codec``'s decoders check it)
_NAMED_KINDS: dict[str, Callable[[Any], bool]] = {
    "class": lambda obj: isinstance(obj, type),
    "function": lambda obj: callable(obj) and not isinstance(obj, type),
}


def _named(desc: Any, modules: dict[str, Any]) -> Any:
    """``{"kind": "class"|"function", "module", "qualname"}`` or ``{"kind": "module", "name"}``
    resolved as ``code_codec.decode_value`` resolves it (an imported module, then attribute
    by attribute of an identifier path); ``_MISSING`` for anything else or anything that
    does not resolve, which the codec then decodes (or refuses, with its message)."""
    kind = desc.get("kind") if type(desc) is dict else None
    if kind == "module":
        module = desc.get("name")
        return _loaded(module, modules) if type(module) is str else _MISSING
    check = _NAMED_KINDS.get(kind)  # type: ignore[arg-type]
    module, qualname = desc.get("module"), desc.get("qualname")
    if check is None or type(module) is not str or type(qualname) is not str or "<locals>" in qualname:
        return _MISSING
    parts = qualname.split(".")
    obj = _loaded(module, modules) if all(map(str.isidentifier, parts)) else _MISSING
    for part in parts:
        if obj is _MISSING:
            return _MISSING
        obj = getattr(obj, part, _MISSING)
    return obj if obj is not _MISSING and check(obj) else _MISSING


def _loaded(module: str, modules: dict[str, Any]) -> Any:
    """An already imported module by name (what ``import_module`` returns for it), else _MISSING."""
    found = modules.get(module)
    if found is None:
        found = sys.modules.get(module)
        if found is None or not module or getattr(getattr(found, "__spec__", None), "_initializing", False):
            return _MISSING
        modules[module] = found
    return found


def decode_const(desc: Any) -> Any:
    """A constant of the check table: a codec descriptor, or a class/function named
    by path that may not be importable (then compared by name)."""
    if isinstance(desc, dict) and desc.get("kind") == "typename":
        return desc["name"]
    return code_codec.decode_value(desc)


#: what only capture, a failing guard or the tools use (``guard_cold``), on first use
_COLD_SIDE = frozenset({"pack_checks", "checks_meta", "short"})


def __getattr__(name: str) -> Any:
    if name in _COLD_SIDE:
        from . import guard_cold

        return getattr(guard_cold, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
