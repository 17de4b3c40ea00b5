"""The graph's own key factors: what only a compile computes (see ``key``).

The graph (every node, constants by value, subgraphs recursively), its inputs, the
functions and user operators it calls by reference, training's extra factors and
per-call global state; :func:`compute_key` joins them with ``key.context_factors``.
A warm load never imports this module (it re-checks the context and the recorded
call targets only).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from . import key as keys
from .fingerprint import callable_digest, describe_value, qualified_name
from .key import canonical_json, digest

if TYPE_CHECKING:
    import torch

    from .compilers.base import InnerCompiler
    from .options import BackendOptions

def _describe_value(value: Any) -> Any:
    """Describe a node argument without process-specific parts (ids, addresses)."""
    import torch
    import torch.fx

    if isinstance(value, torch.fx.Node):
        return f"%{value.name}"
    if isinstance(value, (list, tuple)):
        return [_describe_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe_value(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return {"tensor": tensor_meta(value)}
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    if callable(value) or isinstance(value, type):
        return qualified_name(value)
    return repr(value)


def _sym(x: Any) -> Any:
    return x if isinstance(x, int) else str(x)


def tensor_meta(t: Any) -> dict[str, Any]:
    """dtype / shape / stride / device / requires_grad, symbolic dims as strings."""
    return {
        "dtype": str(t.dtype),
        "shape": [_sym(d) for d in t.shape],
        "stride": [_sym(s) for s in t.stride()] if t.layout == _strided() else None,
        "device": str(t.device),
        "requires_grad": bool(t.requires_grad),
    }


def _strided() -> Any:
    import torch

    return torch.strided


def graph_factors(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """Normalized description of the graph: every node's op, target and args.

    Constant tensors reached by ``get_attr`` are baked into the compiled code,
    so their *values* are hashed too; a ``get_attr`` or ``call_module`` of a
    GraphModule (the branches of ``torch.cond``, the body of ``while_loop``,
    ``invoke_subgraph``...) is hashed recursively.
    """
    import torch

    nodes = []
    constants: dict[str, str] = {}
    subgraphs: dict[str, Any] = {}
    for node in gm.graph.nodes:
        nodes.append(
            [node.op, node.name, _describe_value(node.target), _describe_value(node.args),
             _describe_value(node.kwargs)]
        )
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        value = _fetch_attr(gm, target)
        if isinstance(value, torch.fx.GraphModule):
            subgraphs[target] = digest(graph_factors(value))
        elif isinstance(value, torch.Tensor):
            constants[target] = tensor_digest(value)
        elif isinstance(value, torch.nn.Module):
            subgraphs[target] = _module_factors(value)
        elif value is not None:
            constants[target] = canonical_json(describe_value(value))
    out: dict[str, Any] = {"nodes": nodes, "constants": constants}
    if subgraphs:
        out["subgraphs"] = subgraphs
    targets = call_target_factors(gm)
    if targets:
        out["call_targets"] = {name: t["digest"] for name, t in targets.items()}
    return out


#: operator namespaces whose kernels come with torch (their version is in every key)
_TORCH_OP_NAMESPACES = frozenset({
    "aten", "prims", "quantized", "_quantized", "rngprims", "higher_order", "inductor", "debugprims",
    "_c10d_functional", "c10d_functional", "_dtensor", "profiler", "_test", "mkldnn", "mkl", "onednn",
    "quantized_decomposed", "_inductor_test", "fbgemm", "prim", "_operator", "torchvision",
})


def call_target_factors(gm: Any) -> dict[str, dict[str, Any]]:
    """What a graph calls *by reference* that a compiler compiles *by content*, each
    described by what it computes (the graph names them only, so an edit would
    otherwise hit the stale artifact):

    * a Python function a ``call_function`` node calls (``torch._dynamo.allow_in_graph``
      helpers): its code, defaults and closure contents (installed libraries' functions
      count by the library's version, as traced code does);
    * a method a ``call_method`` node calls on a tensor: what torch.Tensor resolves it to
      (``key.tensor_method_description``: a function a user set there, by its content);
    * an operator of a user namespace with a ``CompositeImplicitAutograd`` kernel (a
      ``torch.library`` op implemented in Python, which AOTAutograd / Inductor trace
      through): the operations its kernel runs on meta tensors of the node's inputs.

    ``{name: {"kind", ..., "digest"}}``; the bypass loader re-describes them in the
    warm process (:func:`stale_call_targets`) before replaying the graph."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_method" and isinstance(node.target, str):  # what torch.Tensor resolves it to
            name = f"torch.Tensor.{node.target}"
            if name not in out:
                out[name] = {"kind": "tensor_method", "method": node.target,
                             "digest": digest(keys.tensor_method_description(node.target))}
            continue
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
            described = _describe_op(target, node)
        else:
            described = _describe_function(target)
        if described is not None:
            out[described.pop("name")] = described
    return out


def _describe_function(fn: Any) -> dict[str, Any] | None:
    import types

    from .bypass.sources import is_library_file

    inner = getattr(fn, "__wrapped__", fn)
    code = getattr(inner, "__code__", None)
    if not isinstance(fn, types.FunctionType) or not isinstance(code, types.CodeType):
        return None
    if is_library_file(code.co_filename) and not code.co_filename.startswith("<"):
        return None
    name = qualified_name(fn)
    return {"name": name, "kind": "function", "module": getattr(fn, "__module__", None),
            "qualname": getattr(fn, "__qualname__", None), "digest": digest(function_description(fn))}


def function_description(fn: Any) -> Any:
    """A called function by its code, bound values and the globals its code reads
    (Dynamo guards none of it: it never looks inside an ``allow_in_graph`` helper)."""
    import types

    from .fingerprint import describe_callable, describe_value

    code = fn.__code__
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    scope = getattr(fn, "__globals__", {})
    read = {n: describe_value(scope[n]) for n in sorted(names) if n in scope and not n.startswith("__")}
    return {"callable": describe_callable(fn), "globals": read}


def _overload(target: Any) -> Any:
    import torch

    if isinstance(target, torch._ops.OpOverloadPacket):
        names = target.overloads()
        return getattr(target, "default" if "default" in names else names[0]) if names else None
    return target


def _describe_op(target: Any, node: Any) -> dict[str, Any] | None:
    import torch

    op = _overload(target)
    if op is None or op.namespace in _TORCH_OP_NAMESPACES:
        return None
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return None  # an opaque kernel: the compiled graph calls it at run time (the live one)
    args = [_meta_arg(a) for a in node.args]
    kwargs = {k: _meta_arg(v) for k, v in node.kwargs.items()}
    return {"name": f"op:{op}", "kind": "op", "op": op.name(), "overload": op._overloadname, "args": args, "kwargs": kwargs,
            "digest": _decomposition_digest(op, args, kwargs)}


def _meta_arg(value: Any) -> Any:
    """A node argument as data a meta tensor can be rebuilt from (sizes: their hints)."""
    import torch
    import torch.fx

    if isinstance(value, torch.fx.Node):
        value = value.meta.get("example_value", value.meta.get("val"))
        if isinstance(value, torch.Tensor):
            return {"meta_tensor": [str(value.dtype).replace("torch.", ""), [_hint(d) for d in value.shape],
                                    [_hint(s) for s in value.stride()]]}
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return _hint(value)
        return {"unknown": type(value).__qualname__}
    if isinstance(value, (list, tuple)):
        return [_meta_arg(v) for v in value]
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    return {"repr": _describe_value(value)}


def _hint(d: Any) -> Any:
    if isinstance(d, (int, float, bool)):
        return d
    node = getattr(d, "node", None)
    hint = getattr(node, "hint", None)
    return hint if hint is not None else str(d)


def _decomposition_digest(op: Any, args: list[Any], kwargs: dict[str, Any]) -> str:
    """Digest of the operations ``op``'s CompositeImplicitAutograd kernel runs on meta
    tensors shaped like its inputs (what a compiler that traces through it compiles)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[Any] = []

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            calls.append([str(func), _describe_value([a for a in args if not isinstance(a, torch.Tensor)]),
                          _describe_value({k: v for k, v in (kwargs or {}).items() if not isinstance(v, torch.Tensor)})])
            return func(*args, **(kwargs or {}))

    def build(value: Any) -> Any:
        if isinstance(value, dict) and "meta_tensor" in value:
            dtype, shape, stride = value["meta_tensor"]
            if not all(isinstance(d, int) for d in shape + stride):
                raise ValueError("symbolic size without a hint")
            return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device="meta")
        if isinstance(value, list):
            return [build(v) for v in value]
        if isinstance(value, dict):
            raise ValueError(f"argument {value} cannot be rebuilt")
        return value

    try:
        real_args = [build(a) for a in args]
        real_kwargs = {k: build(v) for k, v in kwargs.items()}
        with _Record():
            op.decompose(*real_args, **real_kwargs)
        return digest(calls)
    except Exception as exc:  # noqa: BLE001 - described as undescribable: the key still changes with its name
        return digest({"undescribable": f"{type(exc).__name__}: {exc}"})


def tensor_digest(t: Any) -> str:
    """sha256 of a tensor's values (its bytes, in logical order)."""
    import torch

    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def _module_factors(module: Any) -> dict[str, Any]:
    """A plain submodule a graph calls: its structure and its tensors by value."""
    tensors = {name: tensor_digest(t) for name, t in list(module.named_parameters()) + list(module.named_buffers())}
    return {"module": repr(module), "tensors": tensors}


def module_tensor_factors(gm: Any, graph: dict[str, Any]) -> dict[str, str]:
    """``{fqn: value digest}`` of the module parameters/buffers the graph holds as
    constants (Dynamo does so under Inductor's ``freezing``, where they are folded
    into the kernels): the loader compares them with the live module's, so a new
    checkpoint never runs with the old values. ``fqn`` is relative to the frame's
    root module, as Dynamo's ``dynamo_flat_name_to_original_fqn`` records it."""
    names = module_tensor_names(gm)
    return {str(names[t]): d for t, d in graph["constants"].items() if t in names}


def module_tensor_names(gm: Any) -> dict[str, str]:
    """``{graph attribute: fqn}`` of the module parameters/buffers ``gm`` holds as attributes:
    those :func:`module_tensor_factors` puts in the key, compared with the live module at load."""
    return getattr(gm, "meta", {}).get("dynamo_flat_name_to_original_fqn") or {}


def _fetch_attr(gm: Any, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


#: attributes torchair reads from an input tensor and compiles into the graph
_INPUT_ATTRS = ("dim_gears", "_dynamo_static_input_type")


def input_factors(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> list[Any]:
    """Input metadata, taking symbolic shapes from the placeholders' fake values.

    Besides the tensor metadata: whether an input is a parameter (Inductor's
    freezing and torchair's frozen parameters compile parameters as constants),
    and the per-tensor settings torchair compiles in (``set_dim_gears``)."""
    import torch

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: list[Any] = []
    for i, value in enumerate(example_inputs):
        fake = placeholders[i].meta.get("example_value") if i < len(placeholders) else None
        source = fake if isinstance(fake, torch.Tensor) else value
        if isinstance(value, torch.Tensor):
            meta = tensor_meta(source)
            meta["requires_grad"] = bool(value.requires_grad)
            if isinstance(value, torch.nn.Parameter):
                meta["parameter"] = True
            for attr in _INPUT_ATTRS:
                found = getattr(value, attr, None)
                if found is not None:
                    meta[attr] = describe_value(found)
            out.append(meta)
        elif isinstance(value, torch.SymInt) or isinstance(fake, torch.SymInt):
            out.append({"symint": str(fake if fake is not None else value)})
        else:
            out.append({"value": _describe_value(value)})
    tensors = [value for value in example_inputs if isinstance(value, torch.Tensor)]
    groups = keys.storage_groups(tensors)
    if groups != tuple(range(len(tensors))):  # inputs sharing memory: compiled for that sharing
        out.append({"storage_groups": list(groups)})
    return out


def runtime_state_factors() -> dict[str, Any]:
    """Global state that changes a traced graph or its artifact and that a program
    can change between two calls: grad mode, autocast (every device type where it
    is on, with its dtype, and the weight-cast cache), the default dtype, and
    deterministic algorithms. Top-level key factors; checked per call by the bypass
    (about 1 us: each is one C call)."""
    import torch

    return {
        "grad_enabled": torch.is_grad_enabled(),
        "autocast": autocast_state(),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": deterministic_state(),
    }


def autocast_state() -> dict[str, Any] | None:
    """``None`` when autocast is off everywhere, else ``{device: dtype, ..., "cache": bool}``."""
    import torch

    if not torch._C._is_any_autocast_enabled():
        return None
    state: dict[str, Any] = {
        device: str(torch.get_autocast_dtype(device))
        for device in torch._C._autocast_supported_devices()
        if torch.is_autocast_enabled(device)
    }
    state["cache"] = torch.is_autocast_cache_enabled()
    return state


def deterministic_state() -> str | list[Any]:
    """``"off"``, or what ``torch.use_deterministic_algorithms`` set (Inductor lowers
    some ops differently; torchair passes it to GE as ``ge.deterministic``)."""
    import torch

    if not torch.are_deterministic_algorithms_enabled():
        return "off"
    import torch.utils.deterministic

    return ["on", bool(torch.is_deterministic_algorithms_warn_only_enabled()),
            bool(torch.utils.deterministic.fill_uninitialized_memory)]


#: bump when what a training entry holds (forward + backward + plan) changes meaning
TRAINING_FORMAT = 1


def training_factors(gm: torch.fx.GraphModule, compiler: InnerCompiler | None = None) -> dict[str, Any]:
    """What changes AOTAutograd's joint graph and its partition, beyond the graph and its
    inputs (whose ``requires_grad`` and parameter-ness are in ``inputs``) and the grad mode /
    autocast / deterministic state (top-level factors). Audited against AOTAutograd's own
    cache key (``torch/_functorch/_aot_autograd/autograd_cache.py``; docs/training-key.md):

    * ``functorch_config``: every ``torch._functorch.config`` value the user overrode
      (activation-memory budget and its estimator/solver, recompute bans, donated buffers,
      functionalized RNG, tangent-stride guessing...), callables by code;
    * ``annotations``: the nodes' ``custom`` annotations (``region_activation_memory_budget``
      lives there, and ``fx.traceback.annotate`` tags the partitioner may read);
    * ``checkpoint_context_fns``: selective activation checkpointing policies (the
      ``context_fn`` of ``torch.utils.checkpoint``) by code and bound values;
    * ``partitioner``: which partitioner the inner compiler uses (fixed per compiler
      version, named so a reader sees it)."""
    from .compilers.inductor import _config_overrides

    annotations = {}
    context_fns = []
    for module in gm.modules():
        if not hasattr(module, "graph"):
            continue
        for node in module.graph.nodes:
            custom = node.meta.get("custom")
            if custom:
                annotations[node.name] = describe_value(custom)
        context_fn = getattr(module, "meta", {}).get("_checkpoint_context_fn")
        if context_fn is not None:
            context_fns.append(callable_digest(context_fn))
    out: dict[str, Any] = {
        "format": TRAINING_FORMAT,
        "partitioner": getattr(compiler, "partitioner", "min_cut_rematerialization"),
        "functorch_config": _config_overrides("torch._functorch.config"),
    }
    if annotations:
        out["annotations"] = annotations
    if context_fns:
        out["checkpoint_context_fns"] = context_fns
    return out


def compute_key(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    compiler: InnerCompiler,
    options: BackendOptions,
    grad_enabled: bool,
    training: bool = False,
) -> tuple[str, dict[str, Any]]:
    """Return ``(key, factors)``; ``factors`` is the readable form of the key.

    Top-level keys besides :func:`context_factors` and :func:`runtime_state_factors`:
    ``grad_enabled``, ``graph``, ``inputs``, ``training`` (graphs that need autograd, see
    :func:`training_factors`), ``module_tensors`` (see
    :func:`module_tensor_factors`) and ``registries`` (a compiler's registries that
    cost too much to scan at every warm load, e.g. torchair's user GE converters;
    that compiler's ``load`` re-checks the ones its artifact used instead).
    """
    factors = keys.context_factors(compiler, options)
    factors.update(runtime_state_factors())
    factors["grad_enabled"] = grad_enabled
    graph = graph_factors(gm)
    factors["graph"] = digest(graph)
    factors["inputs"] = input_factors(gm, example_inputs)
    targets = call_target_factors(gm)
    if targets:  # also readable beside the graph digest: the bypass loader re-checks them
        factors["call_targets"] = targets
    tensors = module_tensor_factors(gm, graph)
    if tensors:
        factors["module_tensors"] = tensors
    registries = getattr(compiler, "registry_factors", None)
    if registries is not None:
        factors["registries"] = registries(options)
    if training:
        factors["training"] = training_factors(gm, compiler)
    return digest(factors), factors
