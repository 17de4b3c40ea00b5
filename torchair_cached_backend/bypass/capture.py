"""Capture, at cold start, what the loader needs to replay a function without Dynamo.

A Dynamo bytecode hook sees every frame Dynamo transforms. For frames whose
graphs came from ``npu_cached`` it records the transformed code, what each
Dynamo-installed global stands for, the frame's guards (``guard_capture``) and
the user code it traced, and merges the result into the function's *program*
entry beside the graph entries. Resume functions (graph breaks) are compiled
later, in frames of their own, and join the program's resume group for their
original code when they arrive.

Dynamo's globals (``__compiled_fn_3``, ``__resume_at_70_2``, ``__import_torch``...)
are numbered per process; the stored bytecode refers to them under names
derived from what they stand for (``___tcb_graph_<key>``, ``___tcb_mod_torch``...),
so replayed programs never collide with each other, with other processes'
programs or with a later ``torch.compile`` in the same module.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import re
import sys
import threading
import time
import types
from typing import Any

import torch

from .. import code_codec
from ..graph_load import CachedGraph
from ..logs import log
from .capture_hook import backend_options as _backend_options
from .capture_hook import ensure_installed  # noqa: F401  (re-exported)
from .code_names import global_names, renamed
from .guard_capture import capture_frame_guards, receiver_ref
from .guard_runtime import receiver_value
from .program import (
    PROGRAM_FORMAT,
    function_identity,
    merge_programs,
    program_key,
    program_store,
    target_identity,
    type_path,
    used_roots,
)
from .sources import RESUME_PREFIX, describe_traced, stale_sources, tensor_state
from .split_graph import Described, describe

_lock = threading.RLock()
#: (cache dir, program key) -> builder, for the programs this process is building
_builders: dict[tuple[str, str], ProgramBuilder] = {}
#: id(original resume code) -> (code, [(builder, origin, receiver)]): who waits for its compiled frames
_resume_owners: dict[int, tuple[types.CodeType, list[tuple[ProgramBuilder, str, str | None]]]] = {}

DYNAMO_PREFIXES = ("__compiled_fn", "__import_", "___module_", "__builtins_dict__", "__resume_at_")
#: (not ``_dynamo_static_input_type``: Dynamo itself sets it on parameters while tracing)
_TORCHAIR_TENSOR_ATTRS = ("dim_gears",)
_BY_ID = re.compile(r"_\d+_c\d+$")  # Dynamo's install_global_by_id names
#: id(transformed code) -> (code, builder, receiver name): recorded frames, to find who calls a compiled method
_out_codes: dict[int, tuple[types.CodeType, ProgramBuilder, str | None]] = {}  # id -> (code, builder, receiver ref)
_INTERNAL_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                  os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")
_EXTERNAL_UTILS = os.path.join("_dynamo", "external_utils.py")
#: bumped on every frame Dynamo transforms, so callers can skip re-checking when nothing compiled
generation = 0


class ProgramBuilder:
    """Accumulates the frames and variants of one function's program in this process."""

    def __init__(self, key: str, identity: dict[str, Any], cache_dir: str, compiler: str, fingerprint: str,
                 max_variants: int = 16) -> None:
        self.key = key
        self.max_variants = max_variants
        self.identity = identity
        self.fingerprint = fingerprint  # of the function's own (original) code
        self.cache_dir = cache_dir
        self.compiler = compiler
        self.frames: dict[str, dict[str, Any]] = {}
        self.files: dict[str, bytes] = {}
        self.variants: list[dict[str, Any]] = []
        self.resumes: dict[str, dict[str, Any]] = {}
        #: methods compiled on their own and called by this function ({"path": submodule, "attr": name})
        self.callees: list[dict[str, str]] = []
        #: Dynamo skipped this function's own frame (it runs as Python, its callees replayed)
        self.eager_root = False
        #: (caller's builder, this function's name): recorded frames that reach this function through a
        #: value ``load()`` cannot replace, noted as such once a frame of this program has a graph
        self.unreached_by: list[tuple[ProgramBuilder, str]] = []

    def program(self) -> dict[str, Any]:
        return {
            "callees": self.callees,
            "eager_root": self.eager_root,
            "format": PROGRAM_FORMAT,
            "function": self.identity,
            "fingerprint": self.fingerprint,
            "compiler": self.compiler,
            "frames": self.frames,
            "variants": self.variants,
            "resumes": self.resumes,
        }

    def publish(self) -> None:
        """Merge what this process captured into the stored program (under its lock)."""
        from ..environment import environment_factors

        try:
            store = program_store(self.cache_dir)
            with store.lock(self.key):
                entry = store.load(self.key)
                if entry is None and store.exists(self.key):
                    return  # stored but unreadable now (a storage fault): never replace it with less
                old = entry.manifest.get("program") if entry is not None else None
                old_files = entry.files if entry is not None else {}
                program, files = merge_programs(old, old_files, self.program(), self.files, self.max_variants,
                                                 used_roots(self.cache_dir, self.key))
                store.replace(self.key, files, {"versions": environment_factors(), "program": program})
        except Exception as exc:  # capture must never break the user's compile
            log.warning("npu_cached: could not save the replay program for %s: %s", self.identity["qualname"], exc)

    def variant_count(self) -> int:
        return len(self.variants)


def adopt_resume(cache_dir: str, key: str, program: dict[str, Any], group: dict[str, Any], origin: str,
                 code: types.CodeType, code_blob: bytes, receiver: str | None, max_variants: int) -> None:
    """A warm start compiles a continuation no cached variant fits (``code``, the
    original resume code it loaded): its frame joins the stored program's group."""
    with _lock:
        builder = _builders.get((cache_dir, key))
        if builder is None:
            builder = ProgramBuilder(key, program["function"], cache_dir, program["compiler"], program["fingerprint"],
                                     max_variants)
            _builders[(cache_dir, key)] = builder
        if origin not in builder.resumes:
            builder.files[group["code"]] = code_blob
            builder.resumes[origin] = {"code": group["code"], "name": group["name"],
                                       "factory": bool(group.get("factory")), "frames": []}
        owners = _resume_owners.setdefault(id(code), (code, []))
        if owners[0] is code and all(b is not builder or o != origin for b, o, _ in owners[1]):
            owners[1].append((builder, origin, receiver if _receiver_passed(receiver, code) else None))



def note_python_resume(code: types.CodeType) -> None:
    """Dynamo ran the continuation ``code`` (a resume function of a recorded frame) and compiled
    nothing in it: no graph, no transformed code, so no frame joins its group. The group says
    so, and a warm start runs it as Python as Dynamo did, instead of handing it to Dynamo again
    (a trace for nothing, and Dynamo's first use in the process: ~0.4 s)."""
    with _lock:
        owners = _resume_owners.get(id(code))
        if owners is None or owners[0] is not code:
            return
        noted = []
        for builder, origin, _ in owners[1]:
            group = builder.resumes.get(origin)
            if group is not None and not group["frames"] and not group.get("python"):
                group["python"] = True
                noted.append(builder)
    for builder in {id(b): b for b in noted}.values():
        builder.publish()


def _builder_for(identity: dict[str, Any], fingerprint: str, compiler: str, options: Any) -> ProgramBuilder:
    """The builder of the program ``identity`` names in this process (made on first use)."""
    key = program_key(identity, fingerprint, compiler, options)
    builder = _builders.get((options.cache_dir, key))
    if builder is None:
        builder = ProgramBuilder(key, identity, options.cache_dir, compiler, fingerprint,
                                 getattr(options, "max_variants", 16))
        _builders[(options.cache_dir, key)] = builder
    return builder

def builders_for(code: types.CodeType) -> list[ProgramBuilder]:
    """Programs this process built for ``code`` (used by cache_compile)."""
    qualname = getattr(code, "co_qualname", code.co_name)
    return [b for b in _builders.values() if b.identity["qualname"] == qualname]


def _find_output(code: types.CodeType) -> Any:
    """Dynamo's OutputGraph for the frame being compiled (a local of its tracer frames)."""
    f = sys._getframe(2)
    while f is not None:
        candidate = f.f_locals.get("output")
        if hasattr(candidate, "global_scope") and hasattr(candidate, "guards"):
            return candidate
        f = f.f_back
    return None


def _our_graph(value: Any) -> CachedGraph | None:
    seen = 0
    while value is not None and seen < 8:
        if isinstance(value, CachedGraph):
            return value
        value = getattr(value, "__wrapped__", None)
        seen += 1
    return None


def on_bytecode(code: types.CodeType, out_code: types.CodeType) -> None:
    """Dynamo transformed ``code`` (called through ``capture_hook``)."""
    try:
        with _lock:
            _record(code, out_code)
    except Exception as exc:  # never break Dynamo: the program is just not saved
        log.warning("npu_cached: bytecode capture failed for %s: %s: %s", code.co_name, type(exc).__name__, exc)
    return None


def _dynamo_globals(out_code: types.CodeType, output: Any) -> list[str]:
    """Globals Dynamo installed that the transformed code or the guards refer to."""
    installed = set(getattr(output, "installed_globals", ()) or ())
    referenced = global_names(out_code)
    for guard in output.guards or ():
        referenced.update(re.findall(r"G\[['\"]([A-Za-z_][A-Za-z0-9_]*)['\"]\]", guard.name or ""))
    return sorted(n for n in referenced if n in installed or n.startswith(DYNAMO_PREFIXES) or _BY_ID.search(n))


def _record(code: types.CodeType, out_code: types.CodeType) -> None:
    global generation
    generation += 1
    output = _find_output(code)
    if output is None:
        return
    scope = output.global_scope
    names = _dynamo_globals(out_code, output)
    graphs: dict[str, Any] = {}
    for n in names:
        if n.startswith("__compiled_fn") and n in scope:  # ours, or the DDP optimizer's split of ours
            graphs[n] = _our_graph(scope[n]) or describe(scope[n], _our_graph)
    if any(g is None for g in graphs.values()):
        return  # another backend's graph: not ours to replay
    owners = _resume_owners.get(id(code))
    if owners is not None and owners[0] is code:
        first = next(iter(graphs.values()), None)
        for builder, origin, receiver in list(owners[1]):
            if first is not None and first.options is not None and first.options.cache_dir != builder.cache_dir:
                continue  # this compile of the resume code belongs to another backend's cache
            fid = _add_frame(builder, code, out_code, output, names, graphs, receiver, resume_of=origin)
            _out_codes[id(out_code)] = (out_code, builder, receiver)
            group = builder.resumes[origin]
            if fid not in group["frames"]:
                group["frames"].append(fid)
            builder.publish()
            if graphs:  # a graph after the break of a function its callers cannot reach: now worth saying
                for caller, name in builder.unreached_by:
                    _note_unreached(caller, name)
        return
    if code.co_name.startswith(RESUME_PREFIX):
        return  # a resume function nobody waits for
    if graphs:
        first = next(iter(graphs.values()))
        options, compiler = first.options, first.compiler
    elif any(n.startswith("__resume_at_") for n in names):
        # no graph before the first graph break (a forward that starts with a print): ours if
        # the frame was compiled by npu_cached; its resume functions hold the graphs
        options = _backend_options(getattr(output, "compiler_fn", None))
        compiler = options.resolved_compiler() if options is not None else None
    else:
        return  # nothing of ours
    if options is None:
        return
    local_scope = getattr(output, "local_scope", None) or {}
    wrapped = _wrap_inline_target(code, local_scope)
    wrapper = None
    if wrapped is not None:  # file it under what it wraps, as load(model) looks it up
        func, bound, kind = wrapped
        receiver, wrapper = None, {"kind": kind}
        identity = target_identity(func, bound)
        fingerprint = code_codec.code_fingerprint(func.__code__)
    else:
        receiver = receiver_ref(code, local_scope)
        bound = receiver_value(receiver, local_scope)
        if receiver is not None and not _is_receiver(code, bound, scope):
            receiver, bound = None, None  # a staticmethod: its first argument is no receiver
        identity = function_identity(code, scope.get("__name__"), type_path(bound))
        fingerprint = code_codec.code_fingerprint(code)
    builder = _builder_for(identity, fingerprint, compiler, options)
    fid = _add_frame(builder, code, out_code, output, names, graphs, receiver, resume_of=None, wrapper=wrapper)
    _out_codes[id(out_code)] = (out_code, builder, receiver)
    if all(v["root"] != fid for v in builder.variants):
        builder.variants.append(
            {"root": fid, "tensor_state": tensor_state(bound), "created": round(time.time(), 3)}
        )
    builder.publish()
    if wrapper is None:
        _note_caller(code, bound, options, compiler, builder if not graphs else None)


def _wrap_inline_target(code: types.CodeType, local_scope: dict[str, Any]) -> tuple[Any, Any, str] | None:
    """For Dynamo's ``wrap_inline`` frame (``torch.compile`` of a module or function whose
    own code Dynamo skips: torch.nn built-ins, forwards under ``@torch.no_grad()``...):
    (function, receiver, kind) of what it wraps, else None."""
    if code.co_name != "inner" or code.co_freevars != ("fn",) or not code.co_filename.endswith(_EXTERNAL_UTILS):
        return None
    target = local_scope.get("fn")
    if isinstance(target, torch.nn.Module) and isinstance(type(target).forward, types.FunctionType):
        return type(target).forward, target, "module"
    if isinstance(target, types.MethodType) and isinstance(target.__func__, types.FunctionType):
        if not isinstance(target.__self__, type):
            return target.__func__, target.__self__, "method"
    if isinstance(target, types.FunctionType):
        return target, None, "function"
    return None


def _internal(filename: str) -> bool:
    """Frames of torch (Dynamo, nn.Module's call machinery) and of this package."""
    return filename.startswith(_INTERNAL_DIRS)


def _method_name(cls: type, code: types.CodeType) -> str | None:
    """The attribute of ``cls`` whose function runs ``code`` (``forward``, a helper method)."""
    for klass in cls.__mro__:
        for name, attr in vars(klass).items():
            if getattr(getattr(attr, "__func__", attr), "__code__", None) is code and not isinstance(
                    attr, (staticmethod, classmethod)):
                return name
    return None


def _wrapped_method(cls: type, code: types.CodeType) -> tuple[str, list[tuple[str, types.FunctionType]],
                                                                types.FunctionType] | None:
    """(method name, (free variable, function it holds) down to it, wrapper) of a decorator's
    wrapper in ``cls`` whose closure holds, through at most :data:`_CELL_DEPTH` wrappers, the
    function running ``code`` (transformers' GPT-2: ``forward`` is ``can_return_tuple``'s
    wrapper, its cell ``func`` ``deprecate_kwarg``'s, whose cell ``func`` the decorated
    forward); class dicts and cells only, never a user's attribute code."""
    for klass in cls.__mro__:
        for name, attr in vars(klass).items():
            if type(attr) is types.FunctionType and attr.__closure__:
                chain = _cell_chain(attr, code, _CELL_DEPTH)
                if chain:
                    return name, chain, attr
    return None


#: how many decorator wrappers :func:`_wrapped_method` looks through
_CELL_DEPTH = 4


def _cell_chain(fn: types.FunctionType, code: types.CodeType, depth: int) -> list[tuple[str, types.FunctionType]] | None:
    for free, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if type(value) is not types.FunctionType:
            continue
        if value.__code__ is code:
            return [(free, value)]
        if depth > 1 and value.__closure__:
            rest = _cell_chain(value, code, depth - 1)
            if rest:
                return [(free, value), *rest]
    return None


def _original_code(code: types.CodeType) -> types.CodeType:
    """``code``, or the code Dynamo transformed into it (with no graph it behaves the same)."""
    from torch._dynamo.utils import orig_code_map

    return orig_code_map.get(code) or code


def _above_wrappers(f: Any, wrapper: types.FunctionType, chain: list[tuple[str, types.FunctionType]]
                   ) -> tuple[Any, types.FunctionType, list[tuple[str, types.FunctionType]]]:
    """Up from ``f`` (the wrapped method's caller) through the inner wrappers of ``chain``
    (each the caller's frame, running that wrapper's code or Dynamo's transformed code of
    it): (the outermost wrapper's frame, ``wrapper``, ``chain``), or, when Dynamo compiled an
    inner wrapper's frame (a program of its own: transformers' ``can_return_tuple`` under
    ``deprecate_kwarg``), (that frame, that wrapper, the rest of the chain below it): the
    wrapped method is its callee. The frame is None when the stack is not the chain's."""
    for k in range(len(chain) - 1, 0, -1):
        fn = chain[k - 1][1]
        if f is None or _original_code(f.f_code) is not fn.__code__:
            return None, wrapper, chain
        if _recorded(f) is not None:
            return f, fn, chain[k:]
        f = f.f_back
    return f, wrapper, chain


def _note_caller(code: types.CodeType, bound: Any, options: Any, compiler: str,
                 graphless: ProgramBuilder | None = None) -> None:
    """Record a compiled method (a submodule's forward, a helper) in the program of the
    frame that called it at run time, so a warm start installs its replay there:

    * the caller is Dynamo's transformed code of a recorded frame (the callee ran at a
      graph break of the caller: a ``print``/``.item()`` inside a layer), also through frames
      in which Dynamo compiled nothing (they run as Python at warm too: transformers'
      ``GradientCheckpointingLayer.__call__``, a decorator's wrapper);
    * or the caller is the very frame ``torch.compile`` was asked to compile, which
      Dynamo skipped (a graph break inside a loop over layers): its program says so
      (``eager_root``), and the warm start runs it as Dynamo did, its callees replayed.
    """
    if isinstance(bound, type):
        return
    attr = _method_name(type(bound), code) if bound is not None else None
    chain = wrapper = None
    f = sys._getframe(2)
    while f is not None and _internal(f.f_code.co_filename):
        f = f.f_back
    if bound is not None and attr is None:  # a decorated method's own function, called by its wrapper
        found = _wrapped_method(type(bound), code)
        if found is None:  # a function taking a module first (transformers' attention functions)
            owner = _recorded(f) if f is not None else None
            if owner is not None:
                _note_unreached(owner[1], code.co_qualname, graphless)
            return
        attr, chain, wrapper = found
    if chain is not None:  # up through the inner wrappers to the outermost one (or one with a program)
        f, wrapper, chain = _above_wrappers(f, wrapper, chain)
    if f is None:
        return
    if bound is None:  # a module-level function, called by its global name from a recorded frame
        _note_global_caller(f, code, graphless)
        return
    found_caller = _recorded_caller(f)
    if found_caller is None:
        return  # plain code calling a compiled method: nobody to attach it to
    g, builder, ref = found_caller
    recv = receiver_value(ref, g.f_locals) if ref is not None else None
    if recv is None or not _is_receiver(g.f_code, recv, g.f_globals):
        return
    path = _module_path(recv, bound)
    if path is None:  # a method of an object that is no submodule (a cache's): load() cannot install it
        if builder is not None and g is f:
            _note_unreached(builder, code.co_qualname, graphless)
        return
    caller = g.f_code
    if wrapper is not None:
        if g is f:  # the wrapper's own frame: its own program (or its frame Dynamo skipped) calls it through its cell
            if builder is None:
                caller = _original_code(caller)  # Dynamo's no-graph transformed code of the wrapper
            if path != "" or (caller is not wrapper.__code__ if builder is None else
                              builder.fingerprint != code_codec.code_fingerprint(wrapper.__code__)):
                return
        elif path == "" or _original_code(f.f_code) is not wrapper.__code__:
            return  # a submodule's wrapper, run as Python under the recorded caller: installed on the submodule
    if builder is None:
        identity = function_identity(caller, g.f_globals.get("__name__"), type_path(recv))
        fingerprint = code_codec.code_fingerprint(caller)
        builder = _builder_for(identity, fingerprint, compiler, options)
        builder.eager_root = True
    elif path == "" and chain is None and attr == _method_name(type(recv), caller):
        return
    callee: dict[str, Any] = {"path": path, "attr": attr}
    if chain is not None:
        callee["cell"] = [free for free, _ in chain]
    if callee not in builder.callees:
        builder.callees.append(callee)
        builder.publish()


#: how many frames Dynamo compiled nothing in :func:`_recorded_caller` looks through
_PYTHON_HOPS = 8


def _recorded(f: Any) -> tuple[types.CodeType, ProgramBuilder, str | None] | None:
    """``_out_codes``' entry for the frame ``f`` when it runs Dynamo's transformed code of a recorded frame."""
    owner = _out_codes.get(id(f.f_code))
    return owner if owner is not None and owner[0] is f.f_code else None


def _recorded_caller(f: Any) -> tuple[Any, ProgramBuilder | None, str | None] | None:
    """(frame, its program's builder, receiver ref) of the nearest frame at or above ``f`` that
    is a recorded frame (Dynamo's transformed code of a frame with a program), or the frame
    ``torch.compile`` was asked to compile which Dynamo skipped (builder None: an eager root);
    frames between (run as Python: Dynamo compiled nothing in them) and torch's own are passed.
    None when neither is found within :data:`_PYTHON_HOPS` frames."""
    for _ in range(_PYTHON_HOPS):
        owner = _recorded(f)
        if owner is not None:
            return f, owner[1], owner[2]
        g = f.f_back
        while g is not None and _internal(g.f_code.co_filename):
            if g.f_code.co_filename.endswith(_EVAL_FRAME):
                return f, None, receiver_ref(f.f_code, f.f_locals)
            g = g.f_back
        if g is None:
            return None
        f = g
    return None


def _module_path(recv: Any, bound: Any) -> str | None:
    """``bound``'s path under ``recv`` ("" for ``recv`` itself), None when not a submodule."""
    if recv is bound:
        return ""
    if isinstance(recv, torch.nn.Module):
        return next((name for name, mod in recv.named_modules() if mod is bound and name), None)
    return None


def _note_global_caller(f: Any, code: types.CodeType, graphless: ProgramBuilder | None) -> None:
    owner = _recorded(f)
    if owner is None:
        return
    caller = f.f_code
    for name in caller.co_names:
        value = f.f_globals.get(name)
        if getattr(value, "__code__", None) is code:
            callee = {"global": name}
            if callee not in owner[1].callees:
                owner[1].callees.append(callee)
                owner[1].publish()
            return
    _note_unreached(owner[1], code.co_qualname, graphless)  # called through a registry or a local variable


def _note_unreached(builder: ProgramBuilder, name: str, graphless: ProgramBuilder | None = None) -> None:
    """A function compiled as a frame of its own that the recorded frame calls through a value
    ``load()`` cannot replace (a registry dict, a local variable, an object that is no
    submodule): its warm start runs it as Python, so the program says so and it is counted.
    ``graphless``: the function's own program, whose first frame has no graph: noted once a
    frame after its break has one (a getter that logs, in which Dynamo compiled nothing, runs
    as Python under every route: nothing to say)."""
    if graphless is not None:
        if (builder, name) not in graphless.unreached_by:
            graphless.unreached_by.append((builder, name))
        return
    callee = {"unreached": name}
    if callee not in builder.callees:
        builder.callees.append(callee)
        builder.publish()


def _is_receiver(code: types.CodeType, value: Any, scope: dict[str, Any]) -> bool:
    """Whether ``value`` (the first argument) is what the function is bound to: a
    module or class (forwards, decorator wrappers, classmethods), or an instance
    whose class defines this code as a method, not as a staticmethod (the class is
    found by the code's qualified name in its module, else in ``value``'s type)."""
    import torch

    if isinstance(value, (torch.nn.Module, type)):
        return True
    *owner, name = getattr(code, "co_qualname", code.co_name).split(".")
    classes: list[Any] = list(type(value).__mro__)
    if owner and "<locals>" not in owner:
        obj: Any = scope.get(owner[0])
        for part in owner[1:]:
            obj = getattr(obj, part, None)
        if isinstance(obj, type):
            classes = [obj, *classes]
    for cls in classes:
        attr = cls.__dict__.get(name)
        if attr is not None and getattr(getattr(attr, "__func__", attr), "__code__", None) is code:
            return not isinstance(attr, staticmethod)
    return True  # not found by name (e.g. assigned under another name): as before


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _sanitize(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", text)[:40]


def _resume_code(value: Any) -> tuple[types.CodeType | None, bool]:
    """The original resume code behind a Dynamo resume global: the function itself,
    or (for frames with free variables) the factory that makes it from cells."""
    if not isinstance(value, types.FunctionType):
        return None, False
    if value.__code__.co_name.startswith(RESUME_PREFIX):
        return value.__code__, False
    cells = dict(zip(value.__code__.co_freevars, value.__closure__ or (), strict=False))
    inner = cells.get("code")
    if inner is not None and isinstance(inner.cell_contents, types.CodeType):
        return inner.cell_contents, True
    return None, False


def _describe_global(
    builder: ProgramBuilder, name: str, value: Any, graphs: dict[str, Any], receiver: str | None
) -> tuple[str, dict[str, Any]]:
    """(our name, descriptor) for one Dynamo-installed global."""
    if isinstance(graphs.get(name), Described):
        desc = graphs[name].descriptor()
        return f"___tcb_split_{_digest(desc)[:24]}", desc
    if name in graphs:
        g = graphs[name]
        return f"___tcb_graph_{g.key[:24]}", {"kind": "graph", "key": g.key, "compiler": g.compiler}
    if value is builtins.__dict__ or name.startswith("__builtins_dict__"):
        return "___tcb_builtins", {"kind": "builtins"}
    if isinstance(value, types.ModuleType):
        return f"___tcb_mod_{_sanitize(value.__name__)}_{_digest(value.__name__)[:8]}", {"kind": "module", "name": value.__name__}
    resume, factory = _resume_code(value)
    if resume is not None:
        origin = code_codec.code_fingerprint(resume)[:24]
        if origin not in builder.resumes:
            blob = f"resume-{origin}.code"
            builder.files[blob] = code_codec.dumps_code(resume)
            builder.resumes[origin] = {"code": blob, "name": resume.co_name, "factory": factory, "frames": []}
        owners = _resume_owners.setdefault(id(resume), (resume, []))
        if owners[0] is resume and all(b is not builder or o != origin for b, o, _ in owners[1]):
            owners[1].append((builder, origin, receiver if _receiver_passed(receiver, resume) else None))
        return f"___tcb_resume_{origin}", {"kind": "resume", "origin": origin, "factory": factory}
    desc = {"kind": "value", "value": code_codec.encode_value(value)}
    return f"___tcb_val_{_digest(desc)[:24]}", desc


def _receiver_passed(receiver: str | None, resume: types.CodeType) -> bool:
    """Whether a resume function receives the root's receiver under the same name."""
    if receiver is None:
        return False
    name = receiver.split("'")[1]
    return name in resume.co_varnames[: resume.co_argcount]


def _add_frame(
    builder: ProgramBuilder,
    code: types.CodeType,
    out_code: types.CodeType,
    output: Any,
    names: list[str],
    graphs: dict[str, Any],
    receiver: str | None,
    resume_of: str | None,
    wrapper: dict[str, str] | None = None,
) -> str:
    scope = output.global_scope
    unsupported: list[str] = []
    rename: dict[str, str] = {}
    descs: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for name in names:
        value = scope.get(name)
        try:
            new, desc = _describe_global(builder, name, value, graphs, receiver)
        except code_codec.CodecError as exc:
            unsupported.append(f"Dynamo global {name} cannot be saved: {exc}")
            continue
        rename[name] = new
        descs[new] = desc
        values[new] = value
    uncached = [g for g in graphs.values() if not g.cached]
    for reason in dict.fromkeys(g.reason or "the compiler declined it" for g in uncached):
        unsupported.append(f"a graph of this frame is not cached: {reason}")
    # torchair compiles a tensor's dim gears (set_dim_gears) into the graph: another setting is another graph
    attrs = _TORCHAIR_TENSOR_ATTRS if any(g.compiler == "torchair" for g in graphs.values()) else ()
    guards = capture_frame_guards(output, code, receiver, rename, values, resume=resume_of is not None,
                                  tensor_attrs=attrs)
    if guards.unsupported:
        unsupported.append(guards.unsupported)
    traced = describe_traced(list(getattr(output, "traced_code", []) or []) + [code], code.co_filename,
                             scope.get("__name__"))
    traced = [t for t in traced if t.get("fingerprint") not in guards.fingerprints]
    if resume_of is None:  # the root's own code is in the program key (also a class defined in a function)
        own = (getattr(code, "co_qualname", code.co_name), code_codec.code_fingerprint(code))
        traced = [t for t in traced if (t.get("qualname"), t.get("fingerprint")) != own]
    for item in traced:
        if "fingerprint" in item and stale_sources([item]):  # the load-time check would fail at once
            unsupported.append(
                f"{item['qualname']} ({item['file']}) was traced but cannot be found again by name to check it for "
                "edits (define it at module or class level)"
            )
    renamed_code = renamed(out_code, rename)
    code_blob = code_codec.dumps_code(renamed_code)
    frame = {
        "co_name": out_code.co_name,
        "globals": descs,
        "resume_of": resume_of,
        "traced": traced,
        "unsupported": "; ".join(unsupported) or None,
    }
    if wrapper is not None:
        frame["wrapper"] = wrapper
    fid = _digest([code_codec.code_fingerprint(renamed_code), descs, resume_of, traced, guards.digest, guards.consts,
                   frame["unsupported"], wrapper])[:20]
    builder.files[f"{fid}.code"] = code_blob
    guards_blob = None
    if guards.blob is not None:
        guards_blob = f"{fid}.guards"
        builder.files[guards_blob] = guards.blob
    frame["code"] = f"{fid}.code"
    frame["guards"] = guards.json(guards_blob)
    builder.frames[fid] = frame
    if frame["unsupported"]:
        log.info("npu_cached: frame %s of %s will not be replayed: %s", out_code.co_name,
                 builder.identity["qualname"], frame["unsupported"])
    return fid
