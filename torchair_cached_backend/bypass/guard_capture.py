"""Capture, at cold start, what Dynamo specialized a frame on, as checks another process can run.

Dynamo hands every guard of a frame to its guard builder as a source expression
(``L['self'].scale``, ``G['FLAG']``, ``L['x']``...) and a guard type. In the
bytecode hook (after tracing, before Dynamo builds its own guards) we read the
same guard set from the OutputGraph, evaluate each source against the frame's
locals and globals exactly as Dynamo does, and turn every guard into a Python
expression that means the same thing in a fresh process: identities become
import paths, code fingerprints or type names; values are stored through our
codec (JSON, never pickle). Shape guards come from the ShapeEnv as Python
expressions over input sizes and strides, global state (grad mode, autocast,
default dtype, deterministic algorithms, ...) is read directly.

The result is a small generated module (``___call_check`` / ``___full_check``
binding like the frame's function, one lambda per guard for messages) compiled
once here and marshalled with the code codec, plus a JSON table. Before it is
stored, the module is run here against the frame's own values: every guard must
hold, else the frame is marked unsupported (it then recompiles instead of being
replayed). When in doubt, rebuild.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import types
from collections.abc import Callable
from typing import Any

import torch

from .. import code_codec
from . import trace_mutations, world_state
from .guard_codegen import LOCAL_RE, Unsupported, self_test, signature_params, source_module, without_lines
from .guard_cold import pack_checks, short
from .guard_runtime import CHECKS_FORMAT, HELPERS, function_modes, unwrap_attribute
from .process_state import is_switch_module, process_state_reads

#: guard types that read process-global state, not a source
_STATE_GUARDS = {
    "GRAD_MODE", "DETERMINISTIC_ALGORITHMS", "GLOBAL_STATE", "TORCH_FUNCTION_STATE", "DEFAULT_DEVICE",
    "AUTOGRAD_SAVED_TENSORS_HOOKS",
    # the torch.func interpreter stack (no source name): every frame gets our own per-call check that no
    # transform is active, and frames traced inside one are not cached (``process_state``)
    "FUNCTORCH_STACK_MATCH",
}
#: guard types that compare a value (a switch read through them is checked per call: ``scope_of``)
_VALUE_KINDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH", "BOOL_MATCH", "NONE_MATCH"})
#: device types whose autocast state a frame records
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
_GLOBAL_RE = re.compile(r"(?<![\w\]'\"])G\[(['\"])([A-Za-z_][A-Za-z0-9_.]*)\1\]")


def receiver_ref(code: types.CodeType, local_scope: dict[str, Any]) -> str | None:
    """The source expression of the object a bound method or module forward is called
    on: the first argument of a function defined in a class body (``self``, ``cls``,
    ``this``...), or of any function whose first argument is a module or class, also
    when it arrives in ``*args`` (decorator wrappers: ``wrapper(*args, **kwargs)``)."""
    qualname = getattr(code, "co_qualname", code.co_name)
    tail = qualname.rsplit("<locals>.", 1)[-1]
    if code.co_argcount:
        first = code.co_varnames[0]
        if "." in tail or isinstance(local_scope.get(first), (torch.nn.Module, type)):
            return f"L[{first!r}]"
        return None
    if code.co_flags & 0x04:
        varargs = code.co_varnames[code.co_kwonlyargcount]
        values = local_scope.get(varargs)
        if isinstance(values, tuple) and values and isinstance(values[0], (torch.nn.Module, type)):
            return f"L[{varargs!r}][0]"
    return None


def friendly(name: str) -> str:
    """``L['self']._modules['sub'].k`` -> ``self.sub.k`` (for log lines)."""
    text = LOCAL_RE.sub(lambda m: m.group(2), name)
    text = _GLOBAL_RE.sub(lambda m: m.group(2), text)
    text = re.sub(r"\._(?:modules|parameters|buffers)\[(['\"])([^'\"]+)\1\]", r".\2", text)
    text = re.sub(r"___odict_getitem\(([^,]+), (['\"])([^'\"]+)\2\)", r"\1[\3]", text)
    return text


def _root(source: Any) -> Any:
    seen = 0
    while getattr(source, "base", None) is not None and seen < 64:
        source = source.base
        seen += 1
    return source


def _importable(obj: Any) -> bool:
    """Whether ``obj`` is reached again by its import path (a decorated function is not)."""
    try:
        return code_codec.decode_value(code_codec.encode_value(obj)) is obj
    except code_codec.CodecError:
        return False


def _is_library_function(fn: types.FunctionType) -> bool:
    from .sources import is_library_file

    return is_library_file(fn.__code__.co_filename)


class _Builder:
    """Turns one frame's guards into check expressions and a constant table."""

    def __init__(self, code: types.CodeType, receiver: str | None, rename: dict[str, str], resume: bool) -> None:
        # ``receiver`` is an L-form source expression (``L['self']``, ``L['args'][0]``)
        self.code = code
        self.receiver = receiver
        self.rename = rename
        self.resume = resume
        self.params = set(signature_params(code, False)[1])
        self.freevars = list(code.co_freevars)
        self.consts: list[Any] = []
        self._const_index: dict[str, int] = {}
        self.guards: list[dict[str, Any]] = []  # {"expr": L-form, "scope", "desc", "kind", "reader", "was"}
        self.uses_cells = False
        self.fingerprints: set[str] = set()  # code checked by a guard (no lookup by name needed)
        self.tensor_attrs: tuple[str, ...] = ()
        #: source names of attributes the frame assigns (``L['self'].k``): read per call
        self.mutated: tuple[str, ...] = ()
        #: (class const or source expression, attribute name) already checked for what it resolves to
        self._resolved_seen: set[tuple[str, str]] = set()
        #: (constant, literal of its origin, description) of objects found by import path
        self.origins: list[tuple[str, str, str]] = []
        #: a source name -> its value at capture (set by :func:`capture_guards`; None: not read)
        self.evaluate: Callable[[str], Any] | None = None

    # -- constants ------------------------------------------------------
    def const(self, value: Any) -> str:
        return self.const_desc(code_codec.encode_value(value))

    def const_desc(self, desc: Any) -> str:
        """One table slot per distinct constant (a model repeats the same classes and dtypes)."""
        key = json.dumps(desc, sort_keys=True)
        index = self._const_index.get(key)
        if index is None:
            self.consts.append(desc)
            index = self._const_index[key] = len(self.consts) - 1
        return f"___c{index}"

    def literal(self, value: Any) -> str | None:
        """Python source for a value whose repr reads back identically, else None."""
        t = type(value)
        if t in (int, str, bool) or value is None:
            return repr(value)
        if t is float and math.isfinite(value):
            return repr(value)
        if t is tuple and all(self.literal(v) is not None for v in value):
            return repr(value)
        return None

    def value_ref(self, value: Any) -> str:
        lit = self.literal(value)
        return lit if lit is not None else self.const(value)

    def class_ref(self, cls: type) -> tuple[str, str]:
        """(expression that is the class, or None) for identity; else a name test."""
        try:
            desc = code_codec.encode_value(cls)
            if code_codec.decode_value(desc) is cls:
                return "is", self.const_desc(desc)
        except code_codec.CodecError:
            pass
        return "name", repr(f"{cls.__module__}.{cls.__qualname__}")

    # -- sources --------------------------------------------------------
    def ref(self, name: str) -> str:
        """The L-form expression of a source, with Dynamo's globals renamed to ours."""

        def glob(m: re.Match[str]) -> str:
            return f"___G[{self.rename.get(m.group(2), m.group(2))!r}]"

        return _GLOBAL_RE.sub(glob, name)

    def scope_of(self, name: str, sources: list[Any], kind: str) -> str:
        roots = []
        for source in sources:
            root = _root(source)
            local = getattr(root, "local_name", None)
            if local is not None:
                if self._under_receiver(source):
                    roots.append("receiver")
                elif local in self.freevars and not self.resume:
                    roots.append("free")
                elif local in self.params or local in self.freevars:
                    roots.append("arg")
                else:
                    raise Unsupported(f"guard on frame local {local!r} that is not an argument")
            elif type(root).__name__ in ("GlobalSource", "GlobalWeakRefSource", "ImportSource"):
                roots.append("global")
            elif type(root).__name__ == "TorchFunctionModeStackSource":
                roots.append("arg")  # `with torch.device(...)` around a call changes it
            else:
                raise Unsupported(f"guard on {type(root).__name__} {name!r}")
        if "arg" in roots:
            return "call"
        if any(name == m or name.startswith((m + ".", m + "[")) for m in self.mutated):
            return "call"  # the frame itself assigns it (a growing KV-cache attribute): it changes between calls
        if kind in ("CONSTANT_MATCH", "BOOL_MATCH", "EQUALS_MATCH") and name.endswith(".training"):
            return "call"  # model.train()/eval() between calls must select another variant
        if kind in _VALUE_KINDS and self._reads_switch(sources[0]):
            return "call"  # a process-wide switch (``torch.backends.*``), flipped around calls as Dynamo sees
        return "load"

    def _reads_switch(self, source: Any) -> bool:
        """Whether ``source`` is an attribute of a module of process-wide switches (``process_state``)."""
        base = getattr(source, "base", None)
        if base is None or self.evaluate is None:
            return False
        try:
            return is_switch_module(self.evaluate(base.name))
        except Exception:  # noqa: BLE001 - an owner that cannot be read here is not a switch module
            return False

    def _under_receiver(self, source: Any) -> bool:
        seen = 0
        while source is not None and seen < 64:
            if self.receiver is not None and getattr(source, "name", None) == self.receiver:
                return True
            source = getattr(source, "base", None)
            seen += 1
        return False

    def add(self, expr: str, scope: str, desc: str, kind: str, reader: str | None = None, was: Any = None) -> None:
        if any(g["expr"] == expr for g in self.guards):
            return  # Dynamo often installs one check twice (EQUALS_MATCH + CONSTANT_MATCH)
        entry: dict[str, Any] = {"expr": expr, "scope": scope, "desc": desc, "kind": kind}
        if reader is not None:
            entry["reader"] = reader
            entry["was"] = was if kind == "TENSOR_MATCH" else short(was)
        self.guards.append(entry)

    # -- one guard ------------------------------------------------------
    def guard(self, guard: Any, value: Any, fakes: dict[str, Any]) -> None:
        kind = guard.create_fn_name()
        name = guard.name
        keywords = getattr(guard.create_fn, "keywords", None) or {}
        sources = [guard.originating_source]
        if kind == "DUPLICATE_INPUT":
            other = keywords["source_b"]
            sources.append(other)
            scope = self.scope_of(name, sources, kind)
            self.add(f"({self.ref(other.name)} is {self.ref(name)})", scope, f"{friendly(other.name)} is {friendly(name)}", kind)
            return
        scope = self.scope_of(name, sources, kind)
        e = self.ref(name)
        desc = friendly(name)
        if kind in ("CONSTANT_MATCH", "EQUALS_MATCH", "BOOL_MATCH", "NONE_MATCH"):
            self.add(self.equals(e, value), scope, f"{desc} == {short(value)}", kind, e, value)
        elif kind == "TYPE_MATCH":
            self.add(self.is_class(f"type({e})", type(value)), scope, f"type({desc}) is {type(value).__qualname__}", kind,
                     f"type({e})", type(value))
        elif kind in ("ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH", "BUILTIN_MATCH", "CLOSURE_MATCH", "NN_MODULE"):
            check = self.identity(e, value, desc)
            if "___code_fp(" in check:  # a user function: same code, wherever it now lives
                self.add(check, scope, f"{desc} (code of {getattr(value, '__qualname__', desc)})", kind)
                self.guards[-1]["edited"] = True
            else:
                self.add(check, scope, f"{desc} is the same {type(value).__name__}", kind, e, value)
        elif kind == "TENSOR_MATCH":
            self.add(self.tensor(e, value, fakes.get(name)), scope, f"{desc} (dtype, device, shape, stride)", kind,
                     f"___tmeta({e})", HELPERS["___tmeta"](value))
            self.guards[-1]["tensor"] = e
            if scope != "call" and _no_aliasing_source(guard.originating_source, value):
                self.guards[-1]["aliasing"] = True  # a buffer Dynamo checks for aliasing with the arguments per call
        elif kind in ("SEQUENCE_LENGTH", "EMPTY_NN_MODULE_HOOKS_DICT"):
            n = len(value)
            self.add(f"(len({e}) == {n})", scope, f"len({desc}) == {n}", kind, f"len({e})", n)
        elif kind == "TUPLE_ITERATOR_LEN":
            n = HELPERS["___tuple_iterator_len"](value)
            self.add(f"(type({e}) is {self.const(type(value))} and ___tuple_iterator_len({e}) == {n})", scope,
                     f"len({desc}) == {n}", kind)
        elif kind in ("DICT_KEYS_MATCH", "MAPPING_KEYS_CHECK", "DICT_VERSION"):
            if kind == "DICT_VERSION" and value is not torch.utils._pytree.SUPPORTED_NODES:
                raise Unsupported(f"DICT_VERSION guard on {desc} (a dict's version is not portable)")
            keys = tuple(dict.keys(value)) if isinstance(value, dict) else tuple(value.keys())
            getter = f"tuple(dict.keys({e}))" if isinstance(value, dict) else f"tuple({e}.keys())"
            self.add(f"({getter} == {self.value_ref(keys)})", scope, f"keys of {desc} == {short(keys)}", kind, getter, keys)
        elif kind in ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS", "SET_NOT_CONTAINS"):
            key = keywords["key"]
            neg = "not " if "NOT" in kind else ""
            self.add(f"({neg}({self.value_ref(key)} in {e}))", scope, f"{short(key)} {neg}in {desc}", kind)
        elif kind == "HASATTR":
            attr = keywords["attr"]
            neg = "" if hasattr(value, attr) else "not "
            self.add(f"({neg}hasattr({e}, {attr!r}))", scope, f"{neg}hasattr({desc}, {attr!r})", kind)
        elif kind == "NOT_PRESENT_IN_GENERIC_DICT":
            attr = keywords["attr"]
            self.add(f"(not ___dict_contains({attr!r}, {e}.__dict__))", scope, f"{attr!r} not set on {desc}", kind)
        elif kind == "FAKE_SCRIPT_TYPE_MATCH" and world_state.is_process_group(value):
            # Dynamo guards a process group's type and folds its rank and size into the graph
            self.state_check(e, scope, kind, "process group", desc, "___pg_state", world_state.process_group_state(value),
                             "rank, size, ranks, backend, name, description")
        elif kind == "FAKE_SCRIPT_TYPE_MATCH" and world_state.is_device_mesh(value):
            self.state_check(e, scope, kind, "device mesh", desc, "___mesh_state", world_state.device_mesh_state(value),
                             "ranks, shape, device, dim names, coordinate, groups")
        elif kind == "OPAQUE_OBJ_GUARD_FN_MATCH":
            from torch._library.opaque_object import get_opaque_obj_info

            info = get_opaque_obj_info(type(value))
            if info is not None and info.guard_fn is not None and not world_state.is_device_mesh(value):
                raise Unsupported(f"{kind} guard on {desc} (a {type(value).__qualname__})")
            # no guard function: Dynamo installs no check; a process group's or a device mesh's state is
            # checked above (the mesh's guard function is a part of it, plus a thread id)
        elif kind in ("NOT_NONE_MATCH", "WEAKREF_ALIVE"):
            self.add(f"({e} is not None)", scope, f"{desc} is not None", kind)
        else:
            raise Unsupported(f"{kind} guard on {desc}")

    def equals(self, e: str, value: Any) -> str:
        if value is None or type(value) is bool:
            return f"({e} is {value!r})"
        if type(value) is types.CodeType:
            return self.code_check(e, value)
        t = type(value)
        if t in (int, str) or (t is float and math.isfinite(value)):
            return f"(type({e}) is {t.__name__} and {e} == {value!r})"
        return f"___eq({e}, {self.const(value)})"

    def code_check(self, e: str, code: types.CodeType) -> str:
        fp = code_codec.code_fingerprint(code)
        self.fingerprints.add(fp)
        return f"(___code_fp({e}) == {fp!r})"

    def is_class(self, e: str, cls: type) -> str:
        how, ref = self.class_ref(cls)
        return f"({e} is {ref})" if how == "is" else f"(___tname({e}) == {ref})"

    def identity(self, e: str, value: Any, desc: str) -> str:
        if isinstance(value, type):
            how, ref = self.class_ref(value)
            if how == "is":
                self.origin(ref, value, desc)
            return f"({e} is {ref})" if how == "is" else f"(isinstance({e}, type) and ___tname({e}) == {ref})"
        if type(value) is types.FunctionType and not (_is_library_function(value) and _importable(value)):
            return self.code_check(f"{e}.__code__", value.__code__)
        if type(value) is types.CodeType:
            return self.code_check(e, value)
        try:
            ref = self.const(value)
        except code_codec.CodecError:
            try:  # an instance no name imports: the one a module binds at its top level
                ref = self.const_desc(code_codec.encode_global(value))
            except code_codec.CodecError as exc:
                raise Unsupported(
                    f"identity of {desc} (a {type(value).__qualname__}) cannot be checked in another process: {exc}"
                ) from exc
        if callable(value) and not isinstance(value, types.ModuleType):
            self.origin(ref, value, desc)
        return f"({e} is {ref})"

    def state_check(self, e: str, scope: str, kind: str, what: str, desc: str, reader: str, state: Any,
                    fields: str) -> None:
        """``reader(e) == state``: a process group or device mesh checked by its state (``fields``)."""
        lit = self.literal(state)
        if lit is None:
            raise Unsupported(f"{what} {desc} has a state that cannot be checked in another process")
        self.add(f"({reader}({e}) == {lit})", scope, f"{what} {desc} ({fields}) == {state}", kind, f"{reader}({e})", state)

    def origin(self, ref: str, value: Any, desc: str) -> None:
        """The object a constant finds by its import path is the one captured, not a
        replacement assigned there (``torch.nn.functional.silu = ...``): a stale graph
        (Inductor's kernels) would compute the original. Checked on the constant, once."""
        was = world_state.origin(value)
        lit = self.literal(was)
        if lit is not None and all(ref != r for r, _, _ in self.origins):
            self.origins.append((ref, lit, desc))

    def origin_check(self) -> None:
        """One check for every constant :meth:`origin` recorded: they never change once decoded,
        so it is evaluated once per load (memoized on the check namespace, also with
        ``guards="call"``); per call, the identity checks compare the live objects with them."""
        if not self.origins:
            return
        refs = ", ".join(r for r, _, _ in self.origins)
        lits = ", ".join(lit for _, lit, _ in self.origins)
        names = tuple(d for _, _, d in self.origins)
        reader = f"___origins_changed(({refs},), ({lits},), {names!r})"
        self.add(f"___once(lambda: not {reader})", "load", "each function or class found at its import path is the "
                 "one cached (not a replacement assigned there)", "ORIGIN", reader, [])

    def tensor(self, e: str, value: Any, fake: Any) -> str:
        if not isinstance(value, torch.Tensor):
            raise Unsupported(f"TENSOR_MATCH on a {type(value).__qualname__}")
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise Unsupported(f"tensor subclass {type(value).__qualname__}")
        shape = list(fake.shape) if fake is not None else list(value.shape)
        stride = list(fake.stride()) if fake is not None else list(value.stride())
        t = e if LOCAL_RE.fullmatch(e) else None
        name = t or "___t"
        parts = [
            f"type({e if t else f'(___t := {e})'}) is {self.const(type(value))}",
            f"{name}.dtype is {self.const(value.dtype)}",
            f"{name}.device == {self.const(value.device)}",
            f"{name}.requires_grad is {bool(value.requires_grad)}",
        ]
        if all(_static(d) for d in shape):
            parts.append(f"{name}.size() == {tuple(int(d) for d in shape)!r}")
        else:
            parts.append(f"{name}.dim() == {len(shape)}")
            parts.extend(f"{name}.size({i}) == {int(d)}" for i, d in enumerate(shape) if _static(d))
        if value.layout == torch.strided:
            if all(_static(s) for s in stride):
                parts.append(f"{name}.stride() == {tuple(int(s) for s in stride)!r}")
            else:
                parts.extend(f"{name}.stride({i}) == {int(s)}" for i, s in enumerate(stride) if _static(s))
        for attr in self.tensor_attrs:  # settings a compiler reads off the tensor (torchair's dim gears)
            setting = getattr(value, attr, None)
            ref = "None" if setting is None else self.const(setting)
            parts.append(f"getattr({name}, {attr!r}, None) == {ref}")
        return "(" + " and ".join(parts) + ")"

    def resolved_methods(self, objects: list[tuple[Any, Any]], traced: set[int]) -> None:
        """What ``obj.method(...)`` resolved to, for every traced method of a guarded object.

        Dynamo guards the resolved function; the traced-code check finds code where it was
        defined, which still exists unchanged when a method is monkeypatched onto the class,
        a base class is switched or a subclass adds an override. So for each guarded object
        (or class) and each attribute name whose definition along ``type(obj).__mro__`` is a
        function Dynamo traced, the resolved function is checked by its code and bound values
        (defaults, closure: a dataclass ``__init__``'s field defaults), which also covers
        generated code (``<string>``, an fx GraphModule's ``<eval_with_key>`` forward).
        """
        memo: dict[type, list[tuple[str, types.FunctionType]]] = {}
        for guard, value in objects:
            if guard.create_fn_name() not in ("TYPE_MATCH", "NN_MODULE", "ID_MATCH", "CLASS_MATCH"):
                continue
            is_class = isinstance(value, type)
            cls = value if is_class else type(value)
            if cls.__module__ == "builtins" or not hasattr(cls, "__mro__"):
                continue
            names = memo.get(cls)
            if names is None:
                names = memo[cls] = _traced_attributes(cls, traced)
            if not names:
                continue
            how, ref = self.class_ref(cls)
            e = self.ref(guard.name)
            if how == "is":  # the class itself is checked by identity: resolve on it, once per class
                owner, scope, label = ref, "load", f"{cls.__qualname__}"
            else:
                owner = e if is_class else f"type({e})"
                scope, label = self.scope_of(guard.name, [guard.originating_source], "TYPE_MATCH"), friendly(guard.name)
            for name, fn in names:
                if (owner, name) in self._resolved_seen:
                    continue
                self._resolved_seen.add((owner, name))
                digest = HELPERS["___fn_digest"](fn)
                self.fingerprints.add(code_codec.code_fingerprint(fn.__code__))
                where = getattr(fn, "__qualname__", name)
                self.add(f"(___fn_digest(___resolved({owner}, {name!r})) == {digest!r})", scope,
                         f"{label}.{name} resolves to {where} (its code and defaults)", "RESOLVED_METHOD")
                self.guards[-1]["edited"] = True

    def process_state(self, codes: list[types.CodeType], values: list[Any]) -> None:
        """Checks on process state the traced code read and Dynamo folded in unguarded."""
        reads = process_state_reads(codes, values)
        if reads.env_unnamed:
            raise Unsupported("the traced code reads an environment variable whose name is not a constant")
        if reads.dist:
            now = HELPERS["___dist"]()
            self.add(f"(___dist() == {now!r})", "load", f"process group (initialized, rank, world size) == {now}",
                     "PROCESS_STATE", "___dist()", now)
        if reads.matmul:
            flags = tuple(sorted(reads.matmul))
            now = HELPERS["___matmul"](flags)
            self.add(f"(___matmul({flags!r}) == {now!r})", "load",
                     f"torch.backends.cuda.matmul {dict(zip(flags, now, strict=True))}", "PROCESS_STATE",
                     f"___matmul({flags!r})", now)
        names = sorted(reads.env)
        if reads.hash_str:
            from .process_state import fixed_hash_seed

            if fixed_hash_seed() is None:
                raise Unsupported("the traced code calls hash(), randomized per process for a str (Dynamo folds "
                                  "its value in); set PYTHONHASHSEED to an integer to replay it")
            names = sorted(set(names) | {"PYTHONHASHSEED"})
        if names:
            values = HELPERS["___env"](tuple(names))
            self.add(f"(___env({tuple(names)!r}) == {values!r})", "load",
                     f"environment {dict(zip(names, values, strict=True))}", "PROCESS_STATE",
                     f"___env({tuple(names)!r})", values)

    def shape(self, expr: str) -> None:
        local_roots = {m.group(2) for m in LOCAL_RE.finditer(expr)}
        unknown = local_roots - self.params - set(self.freevars)
        if unknown:
            raise Unsupported(f"shape guard {expr!r} reads frame locals {sorted(unknown)} that are not arguments")
        receiver = LOCAL_RE.fullmatch(self.receiver or "")
        only_receiver = receiver is not None and local_roots <= {receiver.group(2)}
        scope = "load" if only_receiver or not local_roots else "call"
        self.add(f"({self.ref(expr)})", scope, friendly(expr), "SHAPE_ENV")

    def state(self, modes: tuple[Any, ...]) -> dict[str, Any]:
        """The process-global state the frame was traced under, as per-call and load checks
        (``modes``: the torch function mode stack as Dynamo saw it)."""
        grad = torch.is_grad_enabled()
        self.add(f"(___grad() is {grad})", "call", f"grad mode == {grad}", "GRAD_MODE", "___grad()", grad)
        enabled = {}
        for dev in _AUTOCAST_DEVICES:
            try:
                if torch.is_autocast_enabled(dev):
                    enabled[dev] = torch.get_autocast_dtype(dev)
            except Exception:  # a device type this build does not know
                continue
        if not enabled:
            self.add("(not ___any_autocast())", "call", "autocast is off", "GLOBAL_STATE", "___any_autocast()", False)
        for dev, dtype in enabled.items():
            self.add(f"(___autocast({dev!r}) == (True, {self.const(dtype)}))", "call", f"autocast({dev}, {dtype}) is on",
                     "GLOBAL_STATE", f"___autocast({dev!r})", (True, dtype))
        dflt = torch.get_default_dtype()
        self.add(f"(___default_dtype() is {self.const(dflt)})", "call", f"default dtype == {dflt}", "GLOBAL_STATE",
                 "___default_dtype()", dflt)
        det = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
        # per call, as Dynamo's global-state guard: ``use_deterministic_algorithms`` is switched in a
        # running process too, and a kernel lowered without it (Inductor, GE) must not serve it
        self.add(f"(___deterministic() == {det!r})", "call", f"deterministic algorithms == {det}", "DETERMINISTIC_ALGORITHMS",
                 "___deterministic()", det)
        # a torch.func transform (grad, vmap, jacrev...) wraps the tensors below the Python type: Dynamo's
        # tensor guards see it (dispatch keys) and compile the frame again inside the transform; the graphs
        # cached here were traced outside one, so inside one they are not replayed
        if torch._C._functorch.peek_interpreter_stack() is not None:
            raise Unsupported("traced inside a torch.func transform (grad, vmap, jacrev...)")
        self.add("(___functorch_stack() is None)", "call", "no torch.func transform is active", "FUNCTORCH_STACK_MATCH",
                 "___functorch_stack()", None)
        # Dynamo never compiles under a TorchDispatchMode (the call runs eagerly, through the mode)
        self.add("(not ___dispatch_len() or not ___user_dispatch_mode())", "call", "no torch dispatch mode is active", "DISPATCH_MODE",
                 "___user_dispatch_mode()", False)
        if not modes:
            self.add("(torch._C._len_torch_function_stack() == 0)", "call", "no torch function mode is active",
                     "TORCH_FUNCTION_STATE", "___tf_modes()", modes)
        else:  # e.g. torch.set_default_device(...): a DeviceContext mode whose device the graph holds
            self.add(f"(___tf_modes() == {self.value_ref(modes)})", "call", f"torch function modes == {modes}",
                     "TORCH_FUNCTION_STATE", "___tf_modes()", modes)
        return {"grad_enabled": grad, "autocast": {k: str(v) for k, v in enabled.items()}, "default_dtype": str(dflt)}


def _traced_attributes(cls: type, traced: set[int]) -> list[tuple[str, types.FunctionType]]:
    """(name, resolved function) for the attributes of ``cls`` whose resolved
    definition (or a function it wraps) is code Dynamo traced."""
    out = []
    seen: set[str] = set()
    for klass in cls.__mro__:
        for name, raw in list(vars(klass).items()):
            if name in seen:
                continue
            seen.add(name)
            fn = unwrap_attribute(raw)
            if not isinstance(fn, types.FunctionType):
                continue
            inner, depth = fn, 0
            while depth < 8:
                if id(inner.__code__) in traced:
                    out.append((name, fn))
                    break
                inner = getattr(inner, "__wrapped__", None)
                if not isinstance(inner, types.FunctionType):
                    break
                depth += 1
    return out


def _mutated_sources(output: Any) -> tuple[str, ...]:
    """Source names of what this frame changes that existed before it: the attributes it assigns
    (``L['self'].k``), the globals it assigns (``G['CALLS']``: Dynamo files a root frame's
    ``global CALLS; CALLS += 1`` under the global's own source) and the containers it changes in
    place (``L['self'].log`` appended to, a global dict set: ``trace_mutations`` kept them). A guard
    on any of them is checked per call: the frame's next call sees the value its last call left."""
    side_effects = getattr(output, "side_effects", None)
    mutations = getattr(side_effects, "store_attr_mutations", None) or {}
    out = []
    for var, attrs in list(mutations.items()):
        name = trace_mutations.source_name(var)
        if name is None:  # an object the frame creates itself has no source a guard could name
            continue
        out.extend(f"{name}.{attr}" for attr in attrs)
        source = getattr(var, "source", None)
        if type(source).__name__ == "GlobalSource" and getattr(source, "global_name", None) in attrs:
            out.append(name)  # the root frame's ``global CALLS; CALLS = ...``: filed as attribute CALLS of G['CALLS']
        module = getattr(var, "value", None)
        if isinstance(module, types.ModuleType):  # a module's global, read under any name bound to it
            scope = getattr(output, "global_scope", None) or {}
            aliases = [k for k, v in list(scope.items()) if v is module and k != name]
            out.extend(f"G[{alias!r}].{attr}" for alias in aliases for attr in attrs)
    in_place = getattr(side_effects, trace_mutations.ATTR, ())
    if side_effects is not None and getattr(side_effects, "id_to_variable", None):  # not cleared yet
        in_place += trace_mutations.modified_sources(side_effects)
    if trace_mutations.UNKNOWN[0] in in_place:
        raise Unsupported("the frame changes an object in place that no guard can name")
    return tuple(out) + tuple(in_place)


def _static(d: Any) -> bool:
    if isinstance(d, int):
        return True
    node = getattr(d, "node", None)
    return node is not None and bool(getattr(node, "is_constant", lambda: False)())


def _shape_guard_exprs(output: Any) -> list[str]:
    """Dynamo's symbolic-shape guards for this frame, as Python over input sizes/strides."""
    shape_env = getattr(output, "shape_env", None)
    tracked = getattr(shape_env, "tracked_fakes", None) if shape_env is not None else None
    if not tracked:
        return []
    helpers = shape_env.produce_guards_verbose(
        [a.fake for a in tracked],
        [a.source for a in tracked],
        input_contexts=[a.symbolic_context for a in tracked],
        equalities_inputs=None,
        source_ref=lambda source: source.name,
        ignore_static=True,
        langs=("python",),
    )
    return list(helpers[0].exprs)


def _fake_tensors(output: Any) -> dict[str, Any]:
    shape_env = getattr(output, "shape_env", None)
    tracked = getattr(shape_env, "tracked_fakes", None) or []
    fakes = {}
    for item in tracked:
        if isinstance(item.fake, torch.Tensor):
            fakes[item.source.name] = item.fake
    return fakes


class FrameGuards:
    """What capture stores for one frame's guards (JSON part + compiled check module)."""

    __slots__ = ("blob", "consts", "meta", "state", "unsupported", "receiver", "uses_cells", "fingerprints", "digest")

    def __init__(self) -> None:
        self.blob: bytes | None = None
        self.consts: list[Any] = []
        self.meta: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {}
        self.unsupported: str | None = None
        self.receiver: str | None = None
        self.uses_cells = False
        self.fingerprints: set[str] = set()
        self.digest = ""  # of the generated checks' source: part of the frame's identity

    def json(self, blob_name: str | None) -> dict[str, Any]:
        return {
            "format": CHECKS_FORMAT,
            "code": blob_name,
            "consts": self.consts,
            # the guards' explanations travel in the blob (read only when one fails); an
            # unreplayable frame has no blob and keeps them here, for `readable_cache`
            "meta": [] if self.blob is not None else self.meta,
            "state": self.state,
            "receiver": self.receiver,
            "uses_cells": self.uses_cells,
            "unsupported": self.unsupported,
        }


def capture_frame_guards(
    output: Any,
    code: types.CodeType,
    receiver: str | None,
    rename: dict[str, str],
    renamed_values: dict[str, Any],
    resume: bool,
    tensor_attrs: tuple[str, ...] = (),
) -> FrameGuards:
    """The guards Dynamo installed for the frame ``code`` is being compiled for.
    ``tensor_attrs``: attributes of input tensors the frame's graphs were compiled with."""
    result = FrameGuards()
    result.receiver = receiver
    builder = _Builder(code, receiver, rename, resume)
    builder.tensor_attrs = tensor_attrs
    local_scope = dict(getattr(output, "local_scope", None) or {})
    global_scope = dict(getattr(output, "global_scope", None) or {})
    global_scope.update(renamed_values)
    eval_ns = dict(HELPERS)
    eval_ns["___G"] = global_scope
    # Dynamo pops the torch function modes while it compiles: read them as it saw them
    modes = list(getattr(output, "torch_function_mode_stack", None) or [])
    capture_ns = {"___get_torch_function_mode_stack_at": modes.__getitem__, "___tf_modes": lambda: function_modes(modes)}
    eval_ns.update(capture_ns)
    builder.evaluate = lambda name: eval(builder.ref(name), eval_ns, {"L": local_scope})  # noqa: S307 - Dynamo's source
    traced = [c for c in getattr(output, "traced_code", None) or () if isinstance(c, types.CodeType)] + [code]
    try:
        fakes = _fake_tensors(output)
        builder.mutated = _mutated_sources(output)
        objects: list[tuple[Any, Any]] = []
        for guard in sorted(output.guards or (), key=lambda g: g.sort_key()):
            kind = guard.create_fn_name()
            if kind in _STATE_GUARDS or kind == "SHAPE_ENV":
                continue
            if kind == "FSDP_TRAINING_STATE":
                raise Unsupported("FSDP training state guard")
            try:
                value = eval(builder.ref(guard.name), eval_ns, {"L": local_scope})  # noqa: S307 - Dynamo's source expression
            except Exception as exc:
                if kind in ("HASATTR",):
                    value = None
                else:
                    what = friendly(guard.name) if guard.name else f"Dynamo's {kind} guard (it names no source)"
                    raise Unsupported(f"cannot read {what} ({type(exc).__name__}: {exc})") from exc
            builder.guard(guard, value, fakes)
            objects.append((guard, value))
        builder.resolved_methods(objects, {id(c) for c in traced})
        builder.origin_check()
        builder.process_state(traced, [value for _, value in objects])
        for expr in _shape_guard_exprs(output):
            builder.shape(expr)
        result.state = builder.state(function_modes(modes))
        _distinct_tensor_args(builder, local_scope)
        call_params, defs = signature_params(code, with_cells=False)
        source = source_module(builder, call_params, defs)
        if builder.uses_cells:
            call_params, defs = signature_params(code, with_cells=True)
            source = source_module(builder, call_params, defs)
        result.digest = hashlib.sha256("".join(source).encode()).hexdigest()
        compiled = (without_lines(compile(source[0], f"<npu_cached guards {code.co_name}>", "exec")),
                    without_lines(compile(source[1], f"<npu_cached full guard {code.co_name}>", "exec")))
        self_test(compiled, builder, code, local_scope, global_scope, receiver, capture_ns)
        result.meta = [{k: v for k, v in g.items() if k != "tensor"} for g in builder.guards]
        result.blob = pack_checks(code_codec.dumps_code(compiled[0]), code_codec.dumps_code(compiled[1]),
                                  result.meta)
    except (Unsupported, code_codec.CodecError) as exc:
        result.unsupported = str(exc)
    except Exception as exc:  # never break Dynamo's compile: this frame is just not replayed
        result.unsupported = f"guard capture failed: {type(exc).__name__}: {exc}"
    result.consts = builder.consts
    if not result.meta:
        result.meta = [{k: v for k, v in g.items() if k != "tensor"} for g in builder.guards]
    result.uses_cells = builder.uses_cells
    result.fingerprints = builder.fingerprints
    return result


def _no_aliasing_source(source: Any, value: Any) -> bool:
    """Whether Dynamo's no-aliasing guard covers this tensor source: every guarded tensor but a
    ``Parameter`` or a tensor of a built-in ``torch.nn`` module (``skip_no_tensor_aliasing_guards_on_parameters``),
    so a module's own buffer too: an argument that *is* that buffer was compiled for as one input."""
    from torch._dynamo import config
    from torch._dynamo.source import is_from_unspecialized_builtin_nn_module_source

    if getattr(config, "skip_no_tensor_aliasing_guards_on_parameters", True) and (
            type(value) is torch.nn.Parameter or is_from_unspecialized_builtin_nn_module_source(source)):
        return False
    return type(source).__name__ != "NumpyTensorSource"


def _distinct_tensor_args(builder: _Builder, local_scope: dict[str, Any]) -> None:
    """Dynamo compiles assuming distinct argument tensors (and the module buffers it checks with
    them, :func:`_no_aliasing_source`) are distinct objects."""
    seen: dict[int, tuple[str, Any]] = {}
    for entry in builder.guards:
        if entry["kind"] != "TENSOR_MATCH" or (entry["scope"] != "call" and not entry.get("aliasing")):
            continue
        expr = entry["tensor"]
        try:
            value = eval(expr, dict(HELPERS), {"L": local_scope})  # noqa: S307 - our own expression
        except Exception:
            continue
        seen.setdefault(id(value), (expr, value))
    refs = [expr for expr, _ in seen.values()]
    if len(refs) > 1:
        builder.add(f"(len({{{', '.join(f'id({r})' for r in refs)}}}) == {len(refs)})", "call",
                    "tensor arguments (and buffers) are distinct objects", "NO_TENSOR_ALIASING")
        # which of them share memory (views of one tensor): the graph was compiled for this sharing. A
        # frame changing one in place read the other as the cold call's sharing had it (AOTAutograd
        # guards a sharing it saw, not its absence): x.mul_(2) then y, y a view of x, replayed unshared
        pattern = HELPERS["___storages"](*(value for _, value in seen.values()))
        builder.add(f"(___storages({', '.join(refs)}) == {pattern!r})", "call",
                    f"tensor arguments share memory as they did (groups {pattern})", "STORAGE_SHARING")


