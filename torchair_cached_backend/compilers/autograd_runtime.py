"""A light autograd runtime for cached training graphs (forward + backward).

A graph that needs autograd is compiled as AOTAutograd's partitioned forward and
backward. What AOTAutograd's runtime does around those two compiled functions, for
the graphs we cache, is small: run the forward inside one ``torch.autograd.Function``,
keep what it saves for the backward (tensors, with or without version-counter check,
and symints), mark the outputs that need no gradient, and on backward feed the
compiled backward ``[*symints, *saved tensors, *tangents]`` with each tangent in the
layout the backward was traced with. :func:`describe` turns AOTAutograd's metadata
into a JSON *plan* at compile time - or raises :class:`TrainingUnsupported` naming
what this runtime does not rebuild (aliased outputs, input mutations applied outside
the graph, tensor subclasses, effect tokens, functionalized RNG, compiled autograd's
backward state...): such graphs are compiled uncached, never served wrong.
:func:`build` makes the callable from a plan and the two compiled functions.

This module is on the warm path: it imports neither torch._dynamo nor
torch._functorch's AOTAutograd (``describe`` only reads attributes of the metadata
object it is handed).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .inductor_runtime import mark_dynamic

#: bump when the plan's meaning changes
PLAN_FORMAT = 1

_NON_ALIAS = "non_alias"
_UNSAFE_VIEW = "unsafe_view_alias"


class TrainingUnsupported(Exception):
    """AOTAutograd's metadata shows something this runtime does not rebuild; message says what."""


def _memory_format(meta: Any) -> dict[str, Any]:
    """A tangent's expected layout as JSON: static size+stride, or a memory format."""
    fmt = getattr(meta, "memory_format", None)
    if fmt is None:
        raise TrainingUnsupported("a tangent has no recorded layout")
    if fmt.memory_format is not None:
        return {"memory_format": str(fmt.memory_format).replace("torch.", "")}
    if fmt.size is None or fmt.stride is None:
        raise TrainingUnsupported("a tangent's layout is neither a memory format nor a static size/stride")
    if not all(isinstance(d, int) for d in list(fmt.size) + list(fmt.stride)):
        raise TrainingUnsupported("a tangent's static layout has symbolic sizes")
    return {"size": [int(d) for d in fmt.size], "stride": [int(s) for s in fmt.stride]}


def describe(
    meta: Any, num_inputs: int, fw_num_inputs: int, fw_num_outputs: int, bw_num_inputs: int
) -> dict[str, Any]:
    """The JSON plan for AOTAutograd metadata ``meta`` (a ``ViewAndMutationMeta``) of a
    graph with ``num_inputs`` flat inputs whose compiled forward takes ``fw_num_inputs``
    and returns ``fw_num_outputs`` values, and whose backward takes ``bw_num_inputs``;
    raises :class:`TrainingUnsupported`."""
    if meta is None:
        raise TrainingUnsupported("no AOTAutograd metadata in the tracing context")
    if fw_num_inputs != num_inputs:
        raise TrainingUnsupported(
            f"AOTAutograd changed the forward's inputs ({num_inputs} -> {fw_num_inputs}: "
            "deduplicated/synthetic-base/RNG-seed/token args)")
    if meta.tokens or getattr(meta, "num_backward_tokens", 0):
        raise TrainingUnsupported("graph uses effect tokens (side-effectful ops)")
    if getattr(meta, "is_rng_op_functionalized", False) or getattr(meta, "num_graphsafe_rng_states", 0):
        raise TrainingUnsupported("graph uses functionalized RNG state (torch._functorch.config.functionalize_rng_ops)")
    for m in list(meta.subclass_inp_meta) + list(meta.subclass_fw_graph_out_meta) + list(meta.subclass_tangent_meta):
        if not isinstance(m, int) and type(m).__name__ != "PlainTensorMeta":
            raise TrainingUnsupported("graph has tensor-subclass inputs, outputs or tangents")
    if meta.num_mutated_inp_runtime_indices:
        raise TrainingUnsupported("input mutations applied outside the graph (e.g. in-place on an input "
                                  "that requires grad, or a metadata mutation)")
    if getattr(meta, "indices_of_inputs_that_requires_grad_with_mutations_in_bw", None):
        raise TrainingUnsupported("the backward mutates inputs that require grad")
    if meta.num_intermediate_bases:
        raise TrainingUnsupported("outputs alias graph intermediates")
    if getattr(meta, "num_opaque_objects_saved_for_bw", 0):
        raise TrainingUnsupported("the forward saves opaque objects for the backward")
    if len(meta.input_info) != num_inputs:
        raise TrainingUnsupported(f"metadata describes {len(meta.input_info)} inputs, the graph has {num_inputs}")
    outputs = []
    for i, o in enumerate(meta.output_info):
        kind = o.output_type.name
        if kind not in (_NON_ALIAS, _UNSAFE_VIEW):
            raise TrainingUnsupported(f"output {i} is {kind.replace('_', ' ')} (an alias this runtime does not rebuild)")
        if not issubclass(o.raw_type, torch.Tensor) and o.requires_grad:
            raise TrainingUnsupported(f"output {i} requires grad but is not a tensor")
        outputs.append({
            "requires_grad": bool(o.requires_grad),
            "tangent": bool(issubclass(o.raw_type, torch.Tensor) and o.requires_grad_for_backward),
            "unsafe_view": kind == _UNSAFE_VIEW,
            "dynamic_dims": sorted(o.dynamic_dims) if getattr(meta, "dynamic_outputs", False)
            and o.dynamic_dims is not None else None,
        })
    tangents = [i for i, o in enumerate(outputs) if o["tangent"]]
    if len(meta.subclass_tangent_meta) != len(tangents):
        raise TrainingUnsupported(
            f"{len(meta.subclass_tangent_meta)} traced tangents for {len(tangents)} differentiable outputs")
    num_symints = int(meta.num_symints_saved_for_bw or 0)
    num_no_vc = int(meta.num_tensors_saved_with_no_vc_check or 0)
    num_forward = int(meta.num_forward)
    if num_forward != len(outputs):
        raise TrainingUnsupported(f"forward returns {num_forward} values for {len(outputs)} outputs")
    num_saved = fw_num_outputs - num_forward - num_no_vc - num_symints
    if num_saved < 0:
        raise TrainingUnsupported(f"the forward returns {fw_num_outputs} values, fewer than its outputs and saved values")
    plan = {
        "format": PLAN_FORMAT,
        "num_inputs": num_inputs,
        "outputs": outputs,
        "tangents": tangents,
        "tangent_layouts": [_memory_format(m) for m in meta.subclass_tangent_meta],
        "num_forward": num_forward,
        "num_fw_outputs": fw_num_outputs,
        "num_saved": num_saved,
        "num_saved_no_vc": num_no_vc,
        "num_symints": num_symints,
        "bump_version": [int(i) for i in meta.mutated_graph_handled_indices_seen_by_autograd]
        if meta.keep_input_mutations else [],
        "grad_enabled_mutation": meta.grad_enabled_mutation,
        "deterministic": getattr(meta, "deterministic", None),
        "donated_buffers": bool(getattr(meta, "bw_donated_idxs", None)),
        "inputs_require_grad": [bool(i.requires_grad) for i in meta.input_info],
    }
    expected_bw = num_symints + num_saved + num_no_vc + len(tangents)
    if bw_num_inputs != expected_bw:
        raise TrainingUnsupported(f"the backward takes {bw_num_inputs} inputs, expected {expected_bw} "
                                  "(symints + saved tensors + tangents)")
    return plan


def _layout_fixer(layout: dict[str, Any]) -> Callable[[Any], Any]:
    if "memory_format" in layout:
        fmt = getattr(torch, layout["memory_format"])

        def to_format(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and not t.is_contiguous(memory_format=fmt):
                return t.contiguous(memory_format=fmt)
            return t

        return to_format
    size, stride = tuple(layout["size"]), tuple(layout["stride"])

    def to_strides(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or (t.shape == size and t.stride() == stride):
            return t
        out = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device, layout=t.layout)
        out.copy_(t)
        return out

    return to_strides


def build(
    forward: Callable[[list[Any]], Any], backward: Callable[[list[Any]], Any], plan: dict[str, Any], disable_amp: bool,
) -> Callable[..., list[Any]]:
    """The graph callable: ``fn(*flat_inputs) -> list of outputs``, differentiable.

    ``forward`` / ``backward`` are boxed (take one list, may clear it), as Inductor's
    wrappers and AOTAutograd's compiled functions are."""
    if plan.get("format") != PLAN_FORMAT:
        raise ValueError(f"training plan format {plan.get('format')!r}, expected {PLAN_FORMAT}")
    num_inputs = int(plan["num_inputs"])
    num_forward = int(plan["num_forward"])
    num_no_vc = int(plan["num_saved_no_vc"])
    outputs = plan["outputs"]
    non_diff = tuple(i for i, o in enumerate(outputs) if not o["requires_grad"])
    unsafe_views = tuple(i for i, o in enumerate(outputs) if o["unsafe_view"])
    tangents = tuple(int(i) for i in plan["tangents"])
    fixers = [_layout_fixer(layout) for layout in plan["tangent_layouts"]]
    dyn_dims = [(i, set(o["dynamic_dims"])) for i, o in enumerate(outputs) if o["dynamic_dims"] is not None]
    bump = tuple(int(i) for i in plan["bump_version"])
    grad_after = plan["grad_enabled_mutation"]
    deterministic = plan["deterministic"]
    donated = bool(plan["donated_buffers"])
    num_fw_outputs = int(plan["num_fw_outputs"])
    saved_end = num_forward + int(plan["num_saved"])
    keep_graph = torch._C._autograd._get_current_graph_task_keep_graph
    disable_autocast = torch._C._DisableAutocast

    def run_boxed(fn: Callable[[list[Any]], Any], args: list[Any]) -> list[Any]:
        if disable_amp:
            with disable_autocast():
                out = fn(args)
        else:
            out = fn(args)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    class CachedTrainingGraph(torch.autograd.Function):
        """One call of a cached training graph (its forward; backward on demand)."""

        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:  # type: ignore[override]
            # what a gradient taken with create_graph=True depends on (weakly: no input outlives its use)
            ctx.diff_inputs = [weakref.ref(a) for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            outs = run_boxed(forward, list(args))
            if len(outs) != num_fw_outputs:
                raise RuntimeError(f"cached forward returned {len(outs)} values, expected {num_fw_outputs}")
            # saved views are detached (as AOTAutograd does): their bases stay free
            ctx.save_for_backward(*[t.detach() if t._is_view() else t for t in outs[num_forward:saved_end]])
            no_vc = outs[saved_end:saved_end + num_no_vc]
            ctx.no_vc = [t.detach() if t._is_view() else t for t in no_vc]
            ctx.symints = outs[saved_end + num_no_vc:]
            returns = outs[:num_forward]
            for i in unsafe_views:
                returns[i] = torch.ops.aten._unsafe_view(returns[i], returns[i].shape)
            ctx.mark_non_differentiable(*[returns[i] for i in non_diff if isinstance(returns[i], torch.Tensor)])
            return tuple(returns)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            if torch.is_grad_enabled():  # create_graph=True: the cached backward is not differentiable
                with torch.no_grad():
                    out = _backward(ctx, grads)
                inputs = [t for t in (ref() for ref in ctx.diff_inputs) if t is not None]
                return _undifferentiable(out, [*inputs, *(g for g in grads if isinstance(g, torch.Tensor))])
            return _backward(ctx, grads)

    def _backward(ctx: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        if deterministic is False and torch.are_deterministic_algorithms_enabled():
            raise RuntimeError("this cached backward was compiled with torch.use_deterministic_algorithms(False) "
                               "but runs with it on; compile it again under deterministic algorithms")
        if donated and keep_graph():
            raise RuntimeError(
                "this cached backward reuses saved buffers (Inductor's donated buffers), which needs "
                "backward(retain_graph=False, create_graph=False); or set "
                "torch._functorch.config.donated_buffer=False before compiling")
        args: list[Any] = [*ctx.symints, *ctx.saved_tensors, *ctx.no_vc]
        for j, i in enumerate(tangents):
            g = grads[i]
            args.append(fixers[j](g))
        out = run_boxed(backward, args)
        if len(out) != num_inputs:
            raise RuntimeError(f"cached backward returned {len(out)} gradients for {num_inputs} inputs")
        return tuple(out)

    apply = CachedTrainingGraph.apply
    increment_version = torch.autograd.graph.increment_version
    enable_grad = torch.enable_grad

    def run(*args: Any) -> list[Any]:
        if len(args) != num_inputs:
            raise TypeError(f"cached training graph takes {num_inputs} inputs, got {len(args)}")
        if bump:
            increment_version(tuple(args[i] for i in bump))
        with enable_grad():
            outs = list(apply(*args))
        for i, dims in dyn_dims:
            mark_dynamic(outs[i], dims)
        if grad_after is not None:
            torch._C._set_grad_enabled(grad_after)
        return outs

    run.plan = plan  # type: ignore[attr-defined]
    return run


class _NoDoubleBackward(torch.autograd.Function):
    """Gradients computed under ``create_graph=True``: usable as values, but differentiating
    them again raises (as ``torch.compile``'s does) instead of silently returning zeros. They
    hang off everything the true gradient depends on (the forward's inputs that require grad,
    the incoming gradients), so a derivative with respect to any of them reaches this node:
    ``autograd.grad`` prunes a graph to the paths it needs (``allow_unused=True`` gave None)."""

    @staticmethod
    def forward(ctx: Any, count: int, *args: Any) -> Any:  # type: ignore[override]
        return tuple(g.clone() if isinstance(g, torch.Tensor) else g for g in args[count:])

    @staticmethod
    def backward(ctx: Any, *args: Any) -> Any:
        raise RuntimeError(
            "npu_cached: double backward through a cached training graph is not supported (as with torch.compile); "
            "compute higher-order gradients outside the compiled region")


def _undifferentiable(grads: tuple[Any, ...], depends_on: list[torch.Tensor]) -> tuple[Any, ...]:
    tensors = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    if not tensors:
        return grads
    anchors = [torch.empty(0, requires_grad=True), *(t for t in depends_on if t.requires_grad)]
    wrapped = _NoDoubleBackward.apply(len(anchors), *anchors, *[grads[i] for i in tensors])
    out = list(grads)
    for i, g in zip(tensors, wrapped, strict=True):
        out[i] = g
    return tuple(out)
