"""The cold side of the ``inductor`` inner compiler: compile, capture, package.

Only a process that compiles imports this module (and Inductor with it): a warm
load needs only :mod:`.inductor` (the key factors and the loader) and
:mod:`.inductor_runtime`. Here Inductor's generated wrapper is captured through
an ``inner_compile`` hook, rewritten with :mod:`ast` so its kernels come from
the bundled ``.so`` files and its Inductor imports from :mod:`.inductor_runtime`,
and packaged with its kernel libraries, constants and (when needed)
AOTAutograd's runtime metadata into an :class:`~.base.Artifact`.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import inductor_runtime as rt
from . import pycode
from .base import Artifact, CompileResult
from .inductor import AOT_META_FILE, BW_PREFIX, CONSTANTS_FILE, FORMAT_VERSION, FW_PREFIX, WRAPPER_FILE
from .stored_tensors import save_tensors

if TYPE_CHECKING:
    from ..options import BackendOptions

#: Inductor imports of the wrapper header that the runtime provides itself
#: (``None``: the import is only needed by the code we drop)
_SHIMMED_IMPORTS: dict[tuple[str, str], str | None] = {
    ("torch._inductor.hooks", "run_intermediate_hooks"): "run_intermediate_hooks",
    ("torch._inductor.utils", "maybe_profile"): "maybe_profile",
    ("torch._inductor.codegen.memory_planning", "_align"): "align",
    ("torch._inductor.async_compile", "AsyncCompile"): None,
    ("torch._inductor.select_algorithm", "extern_kernels"): "extern_kernels",
}
#: debug helpers at the end of every wrapper; they import torch._dynamo/_inductor
_DEBUG_FUNCS = {"get_args", "benchmark_compiled_module"}
#: modules searched (in order) for a builtin extern kernel's public name
_BUILTIN_HOMES = (
    "torch",
    "torch._C._nn",
    "torch._C._VariableFunctions",
    "torch.nn.functional",
    "torch._C._linalg",
    "torch._C._special",
    "torch._C._fft",
)
_PRIVATE_TORCH = ("torch._inductor", "torch._dynamo")
_PRIVATE_REF = re.compile(r"(?<![\w.])torch\.(_inductor|_dynamo)\b")


class Uncacheable(Exception):
    """The graph compiled fine but cannot be stored faithfully; message says why."""


class _Capture:
    """What our ``inner_compile`` hook saw for one Inductor compile."""

    __slots__ = ("output", "fw_metadata", "is_inference", "num_inputs", "fakify_first_call", "cudagraphs", "graph",
                 "is_backward")

    def __init__(
        self, output: Any, fw_metadata: Any, is_inference: bool, num_inputs: int, fakify_first_call: bool, cudagraphs: bool,
        graph: Any = None, is_backward: bool = False,
    ) -> None:
        self.output = output
        self.fw_metadata = fw_metadata
        self.is_inference = is_inference
        self.num_inputs = num_inputs
        self.fakify_first_call = fakify_first_call
        self.cudagraphs = cudagraphs
        #: the graph Inductor lowered (after freezing: holds the frozen parameters)
        self.graph = graph
        self.is_backward = is_backward


class _Rewritten:
    """The rewritten wrapper source and what it refers to."""

    __slots__ = ("source", "kernels", "externs", "inductor_imports", "constants")

    def __init__(self, source: str) -> None:
        self.source = source
        self.kernels: list[str] = []
        #: module-level ``name = None`` placeholders Inductor fills with constants
        self.constants: list[str] = []
        self.externs: set[str] = set()
        self.inductor_imports: list[str] = []


def compile_inference(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    options: BackendOptions,
) -> CompileResult:
    """Compile with ``compile_fx`` while capturing what the artifact needs.

    The AOTAutograd cache is disabled for this compile: on a hit it would skip
    ``inner_compile`` and we would never see the generated wrapper.
    """
    fn, captures, disable_amp = _compile_capturing(gm, example_inputs, options, training=False)
    try:
        artifact = _package(captures, example_inputs, disable_amp)
    except Uncacheable as e:
        return CompileResult(fn=fn, artifact=None, reason=str(e))
    except Exception as e:  # packaging must never break a compile that worked
        return CompileResult(fn=fn, artifact=None, reason=f"cannot package Inductor output: {e!r}")
    return CompileResult(fn=fn, artifact=artifact)


def compile_training(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    options: BackendOptions,
    load: Callable[[Artifact, BackendOptions], Callable[..., Any]],
) -> CompileResult:
    """A graph that needs autograd: ``compile_fx``'s own AOTAutograd route (its
    decompositions, joint-graph passes and min-cut partitioner), with the backward
    compiled now instead of at the first ``backward()``, so both wrappers (and their
    kernels) go into one artifact with the plan :mod:`.autograd_runtime` runs them
    with. The cold process runs what a warm one loads."""
    from .autograd_runtime import TrainingUnsupported, describe

    fn, captures, disable_amp = _compile_capturing(gm, example_inputs, options, training=True)
    if len(captures) == 1 and captures[0].is_inference:
        # AOTAutograd found no output to differentiate and compiled an inference graph
        try:
            return CompileResult(fn=fn, artifact=_package(captures, example_inputs, disable_amp))
        except Uncacheable as e:
            return CompileResult(fn=fn, artifact=None, reason=str(e))
    try:
        forward = [c for c in captures if not c.is_backward and not c.is_inference]
        backward = [c for c in captures if c.is_backward]
        if len(forward) != 1 or len(backward) != 1 or len(captures) != 2:
            raise Uncacheable(f"Inductor produced {len(forward)} forward and {len(backward)} backward graphs "
                              "(expected one of each)")
        fw, bw = forward[0], backward[0]
        _check_plain_inputs(example_inputs)
        plan = describe(fw.fw_metadata, len(example_inputs), fw.num_inputs, _num_outputs(fw.graph), bw.num_inputs)
        files: dict[str, bytes] = {}
        parts: dict[str, Any] = {}
        for prefix, cap in ((FW_PREFIX, fw), (BW_PREFIX, bw)):
            part_files, parts[prefix] = _package_wrapper(cap, prefix)
            files.update(part_files)
        meta = {
            "format": FORMAT_VERSION,
            "training": plan,
            "disable_amp": bool(disable_amp),
            "parts": parts,
            "lean": all(p["lean"] for p in parts.values()),
            "threads": _compiled_threads(),
            "num_inputs": len(example_inputs),
        }
        json.dumps(meta)
        artifact = Artifact(files=files, meta=meta)
    except (Uncacheable, TrainingUnsupported) as e:
        return CompileResult(fn=fn, artifact=None, reason=str(e))
    except Exception as e:  # packaging must never break a compile that worked
        return CompileResult(fn=fn, artifact=None, reason=f"cannot package Inductor output: {e!r}")
    return CompileResult(fn=load(artifact, options), artifact=artifact)


def _package(captures: list[_Capture], example_inputs: list[Any], disable_amp: bool) -> Artifact:
    if not captures:
        raise Uncacheable("Inductor produced no compiled graph to store")
    if len(captures) > 1 or not captures[0].is_inference:
        raise Uncacheable("graph needs autograd (forward+backward); only inference graphs are cached")
    cap = captures[0]
    if cap.num_inputs != len(example_inputs):
        raise Uncacheable(
            f"AOTAutograd changed the inputs ({len(example_inputs)} -> {cap.num_inputs}: "
            "deduplicated/synthetic-base/frozen/token args)"
        )
    _check_compiled(cap)
    plan = _runtime_plan(cap, example_inputs, disable_amp)
    files, meta = _package_wrapper(cap, "")
    if plan["aot_runtime"]:
        files[AOT_META_FILE] = pickle.dumps(cap.fw_metadata)
    blockers = list(plan["aot_reasons"]) + meta["lean_blockers"]
    meta.update(
        lean=not blockers, lean_blockers=blockers, aot_runtime=plan["aot_runtime"], runtime=plan["runtime"],
        num_inputs=len(example_inputs),
    )
    json.dumps(meta)  # fail here, not in the store, if something is not JSON-able
    return Artifact(files=files, meta=meta)



# --------------------------------------------------------------------- rewrite
def rewrite_wrapper(source: str) -> _Rewritten:
    """Make Inductor's wrapper loadable without Inductor.

    ``X = async_compile.cpp_pybinding(...)`` becomes ``X = _load_kernel("X")``;
    the async-compile plumbing, shimmed imports and debug helpers are dropped.
    Line-based edits keep everything else (comments included) byte-identical.
    Raises :class:`Uncacheable` for kernels we cannot bundle (Triton, ...).
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    out = _Rewritten(source="")
    edits: dict[int, tuple[int, str]] = {}  # first line -> (last line, replacement)

    def replace(node: ast.stmt, text: str) -> None:
        edits[node.lineno] = (node.end_lineno or node.lineno, text)

    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(_PRIVATE_TORCH):
            known = all((node.module, a.name) in _SHIMMED_IMPORTS for a in node.names) and all(
                (a.asname or a.name) == (_SHIMMED_IMPORTS[(node.module or "", a.name)] or a.name) for a in node.names
            )
            if known:
                replace(node, "")
            else:
                out.inductor_imports.append(node.module or "")
        elif isinstance(node, ast.Import) and any(a.name.startswith(_PRIVATE_TORCH) for a in node.names):
            out.inductor_imports.extend(a.name for a in node.names)
        elif _is_async_compile_stmt(node):
            kernel = _pybinding_target(node)
            if kernel is None:
                raise Uncacheable(f"unsupported kernel kind in wrapper: {ast.unparse(node)[:80]!r} (e.g. Triton)")
            if kernel:
                out.kernels.append(kernel)
                replace(node, f"{kernel} = _load_kernel({kernel!r})\n")
            else:
                replace(node, "")
        elif isinstance(node, ast.FunctionDef) and node.name in _DEBUG_FUNCS:
            replace(node, "")
        elif _is_main_guard(node):
            replace(node, "")
        elif _is_constant_placeholder(node):
            out.constants.append(node.targets[0].id)  # type: ignore[attr-defined]

    pieces: list[str] = []
    i = 1
    while i <= len(lines):
        if i in edits:
            last, text = edits[i]
            pieces.append(text)
            i = last + 1
        else:
            pieces.append(lines[i - 1])
            i += 1
    out.source = "".join(pieces)

    new_tree = ast.parse(out.source)
    for sub in ast.walk(new_tree):
        if isinstance(sub, ast.Name) and sub.id == "async_compile":
            raise Uncacheable("wrapper uses async_compile outside kernel definitions")
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "extern_kernels":
            out.externs.add(sub.attr)
    if _PRIVATE_REF.search(out.source):
        out.inductor_imports.append("torch._inductor/torch._dynamo (inline reference)")
    return out


def _is_async_compile_stmt(node: ast.stmt) -> bool:
    """Statements of the async-compile plumbing: creation, kernels, wait, del."""
    if isinstance(node, ast.Delete):
        return any(isinstance(t, ast.Name) and t.id == "async_compile" for t in node.targets)
    if isinstance(node, ast.Assign):
        if any(isinstance(t, ast.Name) and t.id == "async_compile" for t in node.targets):
            return True
        value = node.value
    elif isinstance(node, ast.Expr):
        value = node.value
    else:
        return False
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and isinstance(value.func.value, ast.Name)
        and value.func.value.id == "async_compile"
    )


def _pybinding_target(node: ast.stmt) -> str | None:
    """Kernel name for ``X = async_compile.cpp_pybinding(...)``; "" for plumbing; None if unsupported."""
    if isinstance(node, ast.Delete):
        return ""
    assert isinstance(node, (ast.Assign, ast.Expr))
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "async_compile" for t in node.targets):
        return ""  # async_compile = AsyncCompile()
    call = node.value
    assert isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
    if isinstance(node, ast.Expr):
        return "" if call.func.attr == "wait" else None
    if call.func.attr != "cpp_pybinding" or len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
        return None
    return node.targets[0].id


def _is_constant_placeholder(node: ast.stmt) -> bool:
    """``_frozen_param3 = None`` / ``_tensor_constant0 = None``: a constant set after load."""
    return (
        isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
        and node.value.value is None
    )


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    return isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"


# --------------------------------------------------------------- inspection
def _runtime_plan(cap: _Capture, example_inputs: list[Any], disable_amp: bool) -> dict[str, Any]:
    """Decide how much of AOTAutograd's inference runtime a loaded graph needs.

    The wrapper's ``call`` alone is equivalent when: no effect tokens, no tensor
    subclasses, no functionalized RNG, inputs passed through unchanged (checked by
    the caller), every output a fresh tensor (no alias of an input/intermediate),
    and every input mutation applied inside the graph. The leftovers (grad off,
    autocast off, version bumps, dynamic-dim tags, grad-mode replay) are small
    and replayed by :func:`inductor_runtime.lean_callable`. Anything else keeps
    AOTAutograd's real ``RuntimeWrapper`` (``aot_runtime``) or is uncacheable.
    """
    meta = cap.fw_metadata
    if meta is None:
        raise Uncacheable("no AOTAutograd metadata in the tracing context")
    if meta.tokens:
        raise Uncacheable("graph uses effect tokens (side-effectful ops)")
    if getattr(meta, "is_rng_op_functionalized", False) or getattr(meta, "num_graphsafe_rng_states", 0):
        raise Uncacheable("graph uses functionalized RNG state")
    if cap.fakify_first_call:
        raise Uncacheable("tracing context asks to fakify the first call")
    for m in list(meta.subclass_inp_meta) + list(meta.subclass_fw_graph_out_meta):
        if not isinstance(m, int) and type(m).__name__ != "PlainTensorMeta":
            raise Uncacheable("graph has tensor-subclass inputs or outputs")
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and type(x) not in (torch.Tensor, torch.nn.Parameter):
            raise Uncacheable(f"input of type {type(x).__name__} (tensor subclass)")

    reasons: list[str] = []
    if meta.num_intermediate_bases:
        reasons.append("outputs alias graph intermediates")
    kinds = {o.output_type.name for o in meta.output_info}
    if kinds - {"non_alias"}:
        reasons.append(f"outputs alias inputs/intermediates ({', '.join(sorted(kinds - {'non_alias'}))})")
    if meta.num_mutated_inp_runtime_indices:
        reasons.append("input mutations applied outside the graph (metadata or non-kept mutation)")

    bump: list[int] = []
    if meta.keep_input_mutations:
        bump = [int(i) for i in meta.mutated_graph_handled_indices_seen_by_autograd]
    dyn: list[list[Any]] = []
    if getattr(meta, "dynamic_outputs", False):
        dyn = [[i, sorted(o.dynamic_dims)] for i, o in enumerate(meta.output_info) if o.dynamic_dims is not None]
    return {
        "aot_runtime": bool(reasons),
        "aot_reasons": reasons,
        "runtime": {
            "disable_amp": bool(disable_amp),
            "bump_version": bump,
            "dynamic_dims": dyn,
            "grad_enabled_mutation": meta.grad_enabled_mutation,
        },
    }


#: file-name prefixes of a training artifact's forward and backward wrappers



def _compile_capturing(
    gm: Any, example_inputs: list[Any], options: BackendOptions, training: bool
) -> tuple[Any, list[_Capture], bool]:
    """``compile_fx`` with an ``inner_compile`` that records each graph Inductor compiles
    (AOTAutograd cache off, so none is skipped; for training, the backward compiled now)."""
    import torch._functorch.config as functorch_config
    from torch._guards import TracingContext
    from torch._inductor import compile_fx as cfx

    captures: list[_Capture] = []

    def inner_compile(graph: torch.fx.GraphModule, inputs: list[Any], **kwargs: Any) -> Any:
        ctx = TracingContext.try_get()
        out = cfx.compile_fx_inner(graph, inputs, **kwargs)
        captures.append(
            _Capture(
                output=out,
                fw_metadata=getattr(ctx, "fw_metadata", None),
                is_inference=bool(kwargs.get("is_inference", False)),
                num_inputs=len(inputs),
                fakify_first_call=bool(getattr(ctx, "fakify_first_call", False)),
                cudagraphs=bool(kwargs.get("cudagraphs")),
                graph=graph,
                is_backward=bool(kwargs.get("is_backward", False)),
            )
        )
        return out

    disable_amp = torch._C._is_any_autocast_enabled()
    kwargs: dict[str, Any] = {"inner_compile": inner_compile}
    if options.custom_decompositions:
        from torch._inductor.decomposition import select_decomp_table

        kwargs["decompositions"] = {**select_decomp_table(), **options.custom_decompositions}
    patch: dict[str, Any] = {"enable_autograd_cache": False}
    if training:
        # the backward is compiled now, not at the first backward(); and without donated buffers
        # (saved tensors' memory reused by the backward): torch.compile drops them when its first
        # backward retains the graph, which a backward compiled in advance cannot know, so
        # backward(retain_graph=True) works at every step
        patch.update(force_non_lazy_backward_lowering=True, donated_buffer=False)
    with functorch_config.patch(**patch):
        fn = cfx.compile_fx(gm, example_inputs, **kwargs)
    return fn, captures, disable_amp


def _check_compiled(cap: _Capture) -> None:
    """What makes calling a captured wrapper's ``call`` equal to calling Inductor's output."""
    from torch._inductor import config as inductor_config
    from torch._inductor.output_code import CompiledFxGraph

    cg = cap.output
    if not isinstance(cg, CompiledFxGraph):
        raise Uncacheable(f"Inductor returned {type(cg).__name__}, not a CompiledFxGraph")
    if cap.cudagraphs:
        raise Uncacheable("CUDA graphs are enabled (mode='reduce-overhead'); not reproducible from the wrapper")
    if inductor_config.cpp_wrapper:
        raise Uncacheable("inductor cpp_wrapper mode is not supported")
    if not cg.source_code:
        raise Uncacheable("compiled graph has no Python wrapper source")
    if getattr(cg, "inputs_to_check", ()):
        raise Uncacheable("graph needs runtime input realignment (GPU)")
    if getattr(cg, "_wrap_compiled_regions", False):
        raise Uncacheable("wrap_inductor_compiled_regions is enabled")
    if getattr(cg, "opaque_value_type_classes", None):
        raise Uncacheable("graph uses opaque value types")


def _check_plain_inputs(example_inputs: list[Any]) -> None:
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and type(x) not in (torch.Tensor, torch.nn.Parameter):
            raise Uncacheable(f"input of type {type(x).__name__} (tensor subclass)")


def _num_outputs(graph: Any) -> int:
    out = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    value = out.args[0]
    return len(value) if isinstance(value, (list, tuple)) else 1


def _package_wrapper(cap: _Capture, prefix: str) -> tuple[dict[str, bytes], dict[str, Any]]:
    """One compiled graph's rewritten wrapper, kernel libraries and constants, as files
    (wrapper and constants named with ``prefix``; kernels by content digest, so the
    forward and backward of a training graph share a library they both call) and the
    metadata :func:`_load_from` reads."""
    _check_compiled(cap)
    cg = cap.output
    rewritten = rewrite_wrapper(cg.source_code)
    files: dict[str, bytes] = {prefix + WRAPPER_FILE: rewritten.source.encode()}
    pycode.precompile(files, prefix + WRAPPER_FILE, prefix + WRAPPER_FILE)
    module_globals = _wrapper_globals(cg)
    kernels: dict[str, list[str]] = {}
    paths = {kname: _kernel_path(module_globals.get(kname), kname) for kname in rewritten.kernels}
    blobs = _stripped_libraries(sorted(set(paths.values())))
    for kname, path in paths.items():
        blob = blobs[path]
        digest = hashlib.sha256(blob).hexdigest()[:24]
        fname = f"k_{digest}.so"
        files[fname] = blob
        kernels[kname] = [fname, digest]

    extern_refs: dict[str, str] = {}
    unresolved: list[str] = []
    if rewritten.externs:
        from torch._inductor.select_algorithm import extern_kernels

        for ename in sorted(rewritten.externs):
            ref = reference_of(getattr(extern_kernels, ename, None))
            if ref is None:
                unresolved.append(ename)
            else:
                extern_refs[ename] = ref

    constants = _constant_values(cg, cap.graph)
    undeclared = sorted(set(rewritten.constants) - set(constants))
    if undeclared:
        raise Uncacheable(f"wrapper reads constants Inductor did not hand over: {undeclared[:5]}")
    if constants:
        files[prefix + CONSTANTS_FILE] = save_tensors(constants)
    blockers = [f"extern kernel {n} lives in torch._inductor" for n in unresolved]
    blockers += [f"wrapper imports {m}" for m in rewritten.inductor_imports]
    meta = {
        "format": FORMAT_VERSION,
        "lean": not blockers,
        "lean_blockers": blockers,
        "needs_inductor": bool(unresolved or rewritten.inductor_imports),
        "aot_runtime": False,
        "runtime": None,
        "kernels": kernels,
        "externs": extern_refs,
        "constants": prefix + CONSTANTS_FILE in files,
        "constant_names": sorted(rewritten.constants),
        "threads": _compiled_threads(cg.source_code),
    }
    return files, meta


def _stripped_libraries(paths: list[str]) -> dict[str, bytes]:
    """The bytes of each kernel library at ``paths``, without its debug sections.

    Inductor builds kernels with ``-g``: debug info is over half of each ``.so``, and
    every warm start reads, verifies, copies and maps those bytes. ``strip
    --strip-debug`` (binutils, present wherever Inductor's C++ compiler links) drops
    only non-loaded sections (code, data and symbol tables stay), run once per graph on
    private copies; where it is missing or fails, the libraries are stored as built."""
    blobs: dict[str, bytes] = {}
    for path in paths:
        with open(path, "rb") as f:
            blobs[path] = f.read()
    strip = shutil.which("strip")
    if not paths or strip is None:
        return blobs
    with tempfile.TemporaryDirectory(prefix="tcb_strip_") as tmp:
        copies = [os.path.join(tmp, f"{i}.so") for i in range(len(paths))]
        for path, copy in zip(paths, copies, strict=True):
            with open(copy, "wb") as f:
                f.write(blobs[path])
        try:
            done = subprocess.run([strip, "--strip-debug", *copies], capture_output=True, timeout=120).returncode == 0
        except (OSError, subprocess.SubprocessError):
            done = False
        if not done:
            return blobs
        for path, copy in zip(paths, copies, strict=True):
            with open(copy, "rb") as f:
                stripped = f.read()
            if stripped[:4] == b"\x7fELF" and 0 < len(stripped) <= len(blobs[path]):
                blobs[path] = stripped
    return blobs


def _wrapper_globals(cg: Any) -> dict[str, Any]:
    """Globals of the loaded wrapper module, where resolved kernel callables live."""
    fn = cg.current_callable
    func = getattr(fn, "__func__", None)
    if func is not None and hasattr(func, "__globals__"):
        return func.__globals__
    runner = getattr(cg, "compiled_fn_runner", None)
    if runner is not None:
        mod = sys.modules.get(type(runner).__module__)
        if mod is not None:
            return vars(mod)
    from torch._inductor.codecache import PyCodeCache

    return vars(PyCodeCache.load(cg.source_code))


def _kernel_path(kernel: Any, name: str) -> str:
    """The ``.so`` a resolved cpp_pybinding kernel was loaded from."""
    path = getattr(getattr(kernel, "__self__", None), "__file__", None)
    if not path or not os.path.isfile(path):
        raise Uncacheable(f"cannot locate the compiled library of kernel {name}")
    return path


def reference_of(obj: Any) -> str | None:
    """A ``"module:attr.path"`` that resolves back to ``obj`` without torch._inductor.

    Covers aten/custom op overloads and torch builtins (``torch.addmm`` ...) and
    importable Python functions outside torch._inductor/_dynamo; None otherwise.
    """
    if obj is None:
        return None
    candidates: list[str] = []
    if isinstance(obj, torch._ops.OpOverload):
        candidates.append(f"torch:ops.{obj.namespace}.{obj._opname}.{obj._overloadname}")
    elif isinstance(obj, torch._ops.OpOverloadPacket):
        candidates.append(f"torch:ops.{obj._qualified_op_name.replace('::', '.')}")
    else:
        name = getattr(obj, "__name__", None)
        if name:
            for home in _BUILTIN_HOMES:
                mod = sys.modules.get(home)
                if mod is not None and getattr(mod, name, None) is obj:
                    candidates.append(f"{home}:{name}")
                    break
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if module and qualname and "<" not in qualname and not module.startswith(_PRIVATE_TORCH):
            candidates.append(f"{module}:{qualname}")
    for ref in candidates:
        try:
            if rt.resolve_ref(ref) is obj:
                return ref
        except (ImportError, AttributeError):
            continue
    return None


def _constant_values(cg: Any, graph: Any) -> dict[str, Any]:
    """Every constant the wrapper reads, as real tensors: Inductor's own constants and,
    with ``freezing``, the frozen (possibly folded / prepacked) parameters, which Inductor
    keeps on the lowered graph instead of in the compiled graph."""
    values = dict(cg.constants or {})
    for name, orig in (getattr(cg, "frozen_param_names", None) or {}).items():
        value = getattr(graph, orig, None) if graph is not None else None
        if not isinstance(value, torch.Tensor):
            raise Uncacheable(f"frozen parameter {name} ({orig}) is not on the lowered graph")
        values[name] = value
    return {name: _storable(name, value) for name, value in values.items()}


def _storable(name: str, t: Any) -> torch.Tensor:
    """``t`` detached, copied when it views a larger storage (torch.save writes whole
    storages); Uncacheable when it has no storage to write (MKL/oneDNN-packed weights)."""
    if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta:
        raise Uncacheable(f"constant {name} is a {type(t).__name__}, not a plain tensor with data")
    try:
        nbytes = t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        nbytes = -1
    if t.is_mkldnn or nbytes < 0:
        raise Uncacheable(
            f"frozen constant {name} is a prepacked (MKL/oneDNN) weight, which cannot be stored; "
            "set torch._inductor.config.cpp.weight_prepack = False to cache frozen graphs"
        )
    t = t.detach()
    return t.clone() if nbytes > t.numel() * t.element_size() else t


def _compiled_threads(source: str | None = None) -> int | None:
    """The thread count Inductor's C++ kernels were specialized for: per-thread
    reduction buffers are sized by it and, when it equals the CPU count, the team is
    a plain ``omp parallel`` (as large as the running process's thread count), so the
    loader pins every call to it. None when no kernel in ``source`` (the wrapper,
    which holds the kernels' C++) uses OpenMP: nothing to pin, any thread count runs it."""
    from torch._inductor.utils import parallel_num_threads

    if source is not None and "#pragma omp" not in source and "omp_get_" not in source:
        return None
    return int(parallel_num_threads())
