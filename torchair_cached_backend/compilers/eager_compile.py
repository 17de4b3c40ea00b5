"""The compile side of the ``eager`` inner compiler: a graph packaged as files.

The FX graph's Python code (plus its bytecode), its tensor constants, its
higher-order-op subgraphs and its globals as codec references; for training,
AOTAutograd's partitioned forward and backward and the plan that runs them.
:class:`~.eager.EagerCompiler` delegates here; a warm load never imports it.
"""

from __future__ import annotations

import builtins
import json
from typing import TYPE_CHECKING, Any

from .. import code_codec
from ..logs import warn_once
from . import pycode
from .base import Artifact, CompileResult
from .eager import _PLAIN_GLOBALS, BW, CONSTANTS, FW, SOURCE, SUBGRAPHS, EagerCompiler, _subgraph_prefix

if TYPE_CHECKING:
    import torch

    from ..options import BackendOptions


def compile_graph(compiler: EagerCompiler, gm: torch.fx.GraphModule, example_inputs: list[Any], options: BackendOptions) -> CompileResult:
    if options.custom_decompositions:
        warn_once("eager-decompositions", "npu_cached: the eager inner compiler runs Dynamo's graph as it is; "
                  "custom_decompositions apply with compiler='inductor' or 'torchair' only")
    try:
        files, refs = _package_graph(gm, "")
    except _Uncacheable as exc:
        return CompileResult(gm.forward, None, str(exc))
    return CompileResult(gm.forward, Artifact(files=files, meta={"globals": refs}))


def compile_training(
    compiler: EagerCompiler, gm: torch.fx.GraphModule, example_inputs: list[Any], options: BackendOptions
) -> CompileResult:
    """AOTAutograd's partitioned forward and backward (default min-cut partitioner, no
    decompositions: ``aot_eager``'s route), each stored as FX Python code, plus the plan
    :mod:`.autograd_runtime` runs them with. The cold process runs the stored pair too."""
    import torch
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._guards import TracingContext

    if options.custom_decompositions:
        warn_once("eager-decompositions", "npu_cached: the eager inner compiler runs Dynamo's graph as it is; "
                  "custom_decompositions apply with compiler='inductor' or 'torchair' only")
    parts: dict[str, Any] = {}

    def fw_compiler(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        parts["forward"] = graph
        parts["meta"] = getattr(TracingContext.try_get(), "fw_metadata", None)
        return make_boxed_func(graph.forward)

    def bw_compiler(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        parts["backward"] = graph
        return make_boxed_func(graph.forward)

    # no donated buffers: an eager backward never reuses saved tensors' memory, and without
    # donation backward(retain_graph=True) works as it does in eager
    with functorch_config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True,
                                donated_buffer=False):
        fn = aot_module_simplified(
            gm, example_inputs, fw_compiler=fw_compiler, bw_compiler=bw_compiler,
            partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True,
        )
    from .autograd_runtime import TrainingUnsupported, describe

    if "forward" in parts and "backward" not in parts and _no_output_needs_grad(parts["meta"]):
        # AOTAutograd found nothing to differentiate and compiled an inference graph: the
        # Dynamo graph as Python, run under grad mode, is exactly that
        return compiler.compile(gm, example_inputs, options)
    try:
        if "forward" not in parts or "backward" not in parts:
            raise _Uncacheable("AOTAutograd did not produce a forward and a backward graph")
        fw, bw = parts["forward"], parts["backward"]
        plan = describe(parts["meta"], len(example_inputs), _placeholders(fw), _outputs(fw), _placeholders(bw))
        files: dict[str, bytes] = {}
        refs: dict[str, Any] = {}
        for prefix, graph in ((FW, fw), (BW, bw)):
            part_files, refs[prefix] = _package_graph(graph, prefix)
            files.update(part_files)
    except (_Uncacheable, TrainingUnsupported) as exc:
        return CompileResult(fn, None, str(exc))
    disable_amp = torch._C._is_any_autocast_enabled()
    artifact = Artifact(files=files, meta={"part_globals": refs, "training": plan, "disable_amp": disable_amp})
    return CompileResult(compiler.load(artifact, options), artifact)


class _Uncacheable(Exception):
    pass


def _no_output_needs_grad(meta: Any) -> bool:
    return meta is not None and not any(o.requires_grad for o in meta.output_info)


def _placeholders(graph: Any) -> int:
    return sum(1 for n in graph.graph.nodes if n.op == "placeholder")


def _outputs(graph: Any) -> int:
    out = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    value = out.args[0]
    return len(value) if isinstance(value, (list, tuple)) else 1


def _package_graph(gm: Any, prefix: str) -> tuple[dict[str, bytes], dict[str, Any]]:
    """``gm``'s Python code (+ bytecode) and its tensor constants as files named with
    ``prefix``, and its globals as codec references; :class:`_Uncacheable` says why not."""
    import torch

    code = gm.graph.python_code(root_module="self")
    refs: dict[str, Any] = {}
    for name, value in code.globals.items():
        if name in _PLAIN_GLOBALS or name in vars(builtins):
            continue
        try:  # the same safe codec the bytecode uses: by import name, never pickle
            refs[name] = code_codec.encode_value(value)
        except code_codec.CodecError as exc:
            raise _Uncacheable(f"graph global {name} cannot be found in a fresh process: {exc}") from exc
    constants = {}
    files: dict[str, bytes] = {}
    subgraphs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            raise _Uncacheable(f"graph calls submodule {node.target!r}")
        if node.op == "get_attr":
            target = str(node.target)
            value = gm
            for part in target.split("."):
                value = getattr(value, part)
            if isinstance(value, torch.fx.GraphModule) and target not in subgraphs:
                subgraphs[target] = _package_subgraph(value, target, prefix, files)
                continue
            if isinstance(value, torch.fx.GraphModule):
                continue
            if not isinstance(value, torch.Tensor):
                raise _Uncacheable(f"graph attribute {target!r} is not a tensor")
            if _read_by_identity(value) and not _frozen(gm, target, node):
                raise _Uncacheable(
                    f"graph attribute {target!r} is a tensor of the process's own that Dynamo reads by identity "
                    "(an optimizer's parameter, a static address): a stored copy would go stale")
            constants[target] = value.detach()
    if subgraphs:
        files[prefix + SUBGRAPHS] = json.dumps(subgraphs, sort_keys=True).encode()
    files[prefix + SOURCE] = code.src.encode()
    pycode.precompile(files, prefix + SOURCE, f"<npu_cached eager graph {prefix}{SOURCE}>")
    if constants:
        from .stored_tensors import save_tensors

        files[prefix + CONSTANTS] = save_tensors(constants)
    return files, refs


def _read_by_identity(value: Any) -> bool:
    """A graph attribute that is live state, not a constant Dynamo made while tracing: a parameter
    (an optimizer's, installed by identity), a tensor marked with a static address, or any attribute
    when Dynamo installs free tensors (globals, closures) as attributes. The graph updates or reads
    the process's own tensor; a copy stored in ``constants.pt`` would be changed or read instead."""
    import torch
    from torch._dynamo import config as dynamo_config
    from torch._dynamo.utils import get_static_address_type

    return (isinstance(value, torch.nn.Parameter) or get_static_address_type(value) is not None
            or bool(getattr(dynamo_config, "install_free_tensors", False)))


def _frozen(gm: Any, target: str, node: Any) -> bool:
    """A module's parameter held as a constant under Inductor's ``freezing`` (the user's promise that
    weights do not change; the loader compares its value with the live module's,
    ``key_graph.module_tensor_factors``), which the graph itself never changes in place."""
    from torch._dynamo.utils import is_parameter_freezing

    from ..key_graph import module_tensor_names

    return (is_parameter_freezing() and target in module_tensor_names(gm)
            and not any(_mutates(user, node) for user in node.users))


def _mutates(user: Any, node: Any) -> bool:
    """Whether ``user`` may write ``node`` in place: an in-place method or operator taking it
    (a schema that says so, or a trailing underscore where there is none; any ``operator.i*``).
    Direct uses only: a view of the parameter changed in place is not seen (under ``freezing``,
    the user's promise covers it, as it does for Inductor's folded weights)."""
    if user.op == "call_method":
        return str(user.target).endswith("_") and user.args[:1] == (node,)
    schema = getattr(user.target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    name = getattr(user.target, "__name__", "")
    if getattr(user.target, "__module__", None) in ("_operator", "operator"):  # x[i] = v, x += v
        return name in ("setitem", "delitem") or name.startswith("i")
    return name.endswith("_") or "out" in user.kwargs


def _package_subgraph(sub: Any, target: str, prefix: str, files: dict[str, bytes]) -> dict[str, Any]:
    """A higher-order op's subgraph (a branch of ``torch.cond``, a checkpointed body):
    packaged like the graph itself under its own prefix; its globals returned."""
    import torch

    if not target.isidentifier():
        raise _Uncacheable(f"graph attribute {target!r} is a nested subgraph")
    if "_checkpoint_context_fn" in sub.meta:  # selective checkpointing: a policy we cannot store
        raise _Uncacheable(f"subgraph {target!r} carries a checkpoint context_fn")
    for node in sub.graph.nodes:  # rebuilt at load by tracing its code, which a nested op defeats
        if node.op == "get_attr" and isinstance(getattr(sub, str(node.target), None), torch.fx.GraphModule):
            raise _Uncacheable(f"subgraph {target!r} nests another higher-order op")
    sub_files, refs = _package_graph(sub, _subgraph_prefix(prefix, target))
    files.update(sub_files)
    return refs
