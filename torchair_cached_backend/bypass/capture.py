"""Capture, at cold start, what the loader needs to replay a function without Dynamo.

A Dynamo bytecode hook sees every frame Dynamo transforms. For frames whose
graphs came from ``npu_cached`` it records the transformed code and what each
Dynamo-installed global stands for, and publishes a *program* entry beside the
graph entries. Resume functions (graph breaks) are compiled later, in frames of
their own; the program is updated when they arrive, and until then the
original resume code is kept so a replay runs it eagerly instead of failing.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

from ..logs import log
from . import code_codec
from .program import function_identity, program_key, program_store
from .signature import describe_args
from .sources import RESUME_PREFIX, describe_traced, tensor_state

_installed = False
_lock = threading.RLock()
#: (cache dir, program key) -> builder, for the programs this process is building. The
#: program key names the function, not the cache, so one function compiled into two
#: caches (two backends) has two builders.
_builders: dict[tuple[str, str], ProgramBuilder] = {}
#: id(original resume code) -> (code, [(builder, frame id, global name)])
_pending: dict[int, tuple[types.CodeType, list[tuple[ProgramBuilder, str, str]]]] = {}

DYNAMO_PREFIXES = ("__compiled_fn", "__import_", "___module_", "__builtins_dict__", "__resume_at_")


def ensure_installed() -> None:
    """Install the bytecode hook once per process; turn off Dynamo's runtime
    overhead recording so transformed code does not call into torch._dynamo."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        import torch._dynamo
        from torch._dynamo.convert_frame import register_bytecode_hook

        if hasattr(torch._dynamo.config, "record_runtime_overhead"):
            torch._dynamo.config.record_runtime_overhead = False
        register_bytecode_hook(_on_bytecode)
        _installed = True


class ProgramBuilder:
    """Accumulates the frames and variants of one function's program."""

    def __init__(self, key: str, identity: dict[str, Any], cache_dir: str, compiler: str, fingerprint: str = "") -> None:
        self.key = key
        self.identity = identity
        self.fingerprint = fingerprint  # of the function's own (original) code
        self.cache_dir = cache_dir
        self.compiler = compiler
        self.frames: dict[str, dict[str, Any]] = {}
        self.files: dict[str, bytes] = {}
        self.variants: list[dict[str, Any]] = []
        self.traced: dict[str, dict[str, Any]] = {}
        self.tensor_state: dict[str, Any] | None = None
        self.unsupported: str | None = None
        self.disabled = False  # cache_compile invalidated it (recompile)

    def new_frame_id(self) -> str:
        return f"f{len(self.frames)}"

    def manifest(self) -> dict[str, Any]:
        from ..environment import environment_factors

        return {
            "versions": environment_factors(),
            "program": {
                "function": self.identity,
                "fingerprint": self.fingerprint,
                "compiler": self.compiler,
                "frames": self.frames,
                "variants": self.variants,
                "traced": list(self.traced.values()),
                "tensor_state": self.tensor_state,
                "unsupported": self.unsupported,
            }
        }

    def publish(self) -> None:
        if self.disabled:
            return
        try:
            program_store(self.cache_dir).replace(self.key, self.files, self.manifest())
        except Exception as exc:  # capture must never break the user's compile
            log.warning("npu_cached: could not save the replay program for %s: %s", self.identity["qualname"], exc)


#: bumped on every frame Dynamo transforms, so callers can skip re-checking when nothing compiled
generation = 0


def builders_for(code: types.CodeType) -> list[ProgramBuilder]:
    """Programs this process built for ``code`` (used by cache_compile)."""
    qualname = getattr(code, "co_qualname", code.co_name)
    return [b for b in _builders.values() if b.identity["qualname"] == qualname]


def _find_compile_context(code: types.CodeType) -> tuple[Any, dict[str, Any] | None]:
    """Dynamo's OutputGraph for this frame and the frame's locals (the call's arguments)."""
    output = None
    frame_locals = None
    f = sys._getframe(2)
    while f is not None and (output is None or frame_locals is None):
        loc = f.f_locals
        if output is None and hasattr(loc.get("output"), "global_scope"):
            output = loc["output"]
        if frame_locals is None and f.f_code.co_name == "_compile" and loc.get("code") is code:
            frame_locals = loc.get("locals")
        f = f.f_back
    return output, frame_locals


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _our_graph(value: Any) -> Any:
    from ..backend import CachedGraph

    seen = 0
    while value is not None and seen < 8:
        if isinstance(value, CachedGraph):
            return value
        value = getattr(value, "__wrapped__", None)
        seen += 1
    return None


def _on_bytecode(code: types.CodeType, out_code: types.CodeType) -> None:
    try:
        with _lock:
            _record(code, out_code)
    except Exception as exc:  # never break Dynamo: the program is just not saved
        log.warning("npu_cached: bytecode capture failed for %s: %s: %s", code.co_name, type(exc).__name__, exc)
    return None


def _take_pending(code: types.CodeType, cache_dir: str | None) -> list[tuple[ProgramBuilder, str, str]]:
    """The program slots waiting for this resume code, for the cache its graphs went to
    (one function compiled by two backends has one resume code, compiled once per backend)."""
    entry = _pending.get(id(code))
    if entry is None or entry[0] is not code:
        return []
    mine = [p for p in entry[1] if cache_dir is None or p[0].cache_dir == cache_dir]
    rest = [p for p in entry[1] if not (cache_dir is None or p[0].cache_dir == cache_dir)]
    if rest:
        _pending[id(code)] = (code, rest)
    else:
        del _pending[id(code)]
    return mine


def _record(code: types.CodeType, out_code: types.CodeType) -> None:
    global generation
    generation += 1
    output, frame_locals = _find_compile_context(code)
    if output is None:
        return
    scope = output.global_scope
    names = sorted(n for n in _names(out_code) if n.startswith(DYNAMO_PREFIXES))
    graphs = {n: _our_graph(scope.get(n)) for n in names if n.startswith("__compiled_fn")}
    if any(g is None for g in graphs.values()):
        _pending.pop(id(code), None)
        return  # another backend's graph: not ours to replay
    first = next(iter(graphs.values()), None)
    waiting = _take_pending(code, first.options.cache_dir if first is not None and first.options else None)
    if not graphs and not waiting:
        return
    uncached = [n for n, g in graphs.items() if not g.cached]
    if waiting:
        for builder, slot_frame, slot_name in waiting:
            fid = _add_frame(builder, code, out_code, scope, names, graphs, output)
            builder.frames[slot_frame]["globals"][slot_name] = {"kind": "resume", "frame": fid}
            if uncached:
                builder.unsupported = f"graph in resume frame {code.co_name} is not cacheable"
            builder.publish()
        return
    if code.co_name.startswith(RESUME_PREFIX):
        return  # a resume function nobody waits for (e.g. recompiled alone): never replayed as a root
    options = first.options
    if options is None:
        return
    identity = function_identity(code, scope.get("__name__"))
    fingerprint = code_codec.code_fingerprint(code)
    key = program_key(identity, fingerprint, first.compiler)
    builder = _builders.get((options.cache_dir, key))
    if builder is None:
        builder = ProgramBuilder(key, identity, options.cache_dir, first.compiler, fingerprint)
        _builders[(options.cache_dir, key)] = builder
    if uncached:
        builder.unsupported = "a graph of this function is not cacheable (needs autograd or the compiler declined)"
    fid = _add_frame(builder, code, out_code, scope, names, graphs, output)
    arg_names = list(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])
    values = tuple((frame_locals or {}).get(n) for n in arg_names)
    is_method = bool(arg_names) and arg_names[0] == "self"
    if is_method and builder.tensor_state is None:
        builder.tensor_state = tensor_state(values[0])
    static_dims: dict[str, list[Any]] = {}
    for g in graphs.values():
        static_dims.update(g.input_dims)
    import torch

    builder.identity["is_method"] = is_method
    builder.identity["varargs"] = bool(code.co_flags & (0x04 | 0x08))
    skip = 1 if is_method else 0  # the replayed function gets ``self`` bound, not checked
    builder.variants.append(
        {
            "root": fid,
            "grad_enabled": torch.is_grad_enabled(),
            "arg_names": arg_names[skip:],
            "signature": describe_args(arg_names[skip:], values[skip:], static_dims),
        }
    )
    builder.publish()


def _add_frame(
    builder: ProgramBuilder,
    code: types.CodeType,
    out_code: types.CodeType,
    scope: dict[str, Any],
    names: list[str],
    graphs: dict[str, Any],
    output: Any,
) -> str:
    fid = builder.new_frame_id()
    blob = f"{fid}.code"
    builder.files[blob] = code_codec.dumps_code(out_code)
    traced = list(getattr(output, "traced_code", []) or []) + [code]
    for item in describe_traced(traced, code.co_filename, scope.get("__name__")):
        builder.traced.setdefault(f"{item['file']}:{item['qualname']}", item)
    descs: dict[str, Any] = {}
    for name in names:
        value = scope.get(name)
        if name in graphs:
            descs[name] = {"kind": "graph", "key": graphs[name].key, "compiler": graphs[name].compiler}
        elif name.startswith("__builtins_dict__"):
            descs[name] = {"kind": "builtins"}
        elif isinstance(value, types.ModuleType):
            descs[name] = {"kind": "module", "name": value.__name__}
        elif name.startswith("__resume_at_") and isinstance(value, types.FunctionType):
            orig_blob = f"{fid}.{name}.orig.code"
            builder.files[orig_blob] = code_codec.dumps_code(value.__code__)
            descs[name] = {"kind": "resume_eager", "code": orig_blob, "name": value.__name__}
            if value.__closure__:
                builder.unsupported = f"resume function {name} has a closure"
            entry = _pending.setdefault(id(value.__code__), (value.__code__, []))
            entry[1].append((builder, fid, name))
        else:
            try:
                descs[name] = {"kind": "value", "value": code_codec.encode_value(value)}
            except Exception as exc:
                builder.unsupported = f"Dynamo global {name}={value!r} cannot be saved: {exc}"
    builder.frames[fid] = {"code": blob, "co_name": out_code.co_name, "globals": descs}
    return fid
