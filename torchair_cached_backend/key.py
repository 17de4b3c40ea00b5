"""The graph-level cache key: every factor that can change a compiled result.

Factors are kept as a readable dict (stored beside each entry so a miss can be
explained factor by factor); the key is the sha256 of their canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from .environment import environment_factors

if TYPE_CHECKING:
    import torch

    from .compilers.base import InnerCompiler
    from .options import BackendOptions

#: bump when the on-disk layout or artifact meaning changes
FORMAT_VERSION = 1


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def digest(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def qualified_name(obj: Any) -> str:
    """A process-independent name for a node target or callable (never an id)."""
    import torch

    if isinstance(obj, str):
        return obj
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"op:{obj}"
    module = getattr(obj, "__module__", None) or type(obj).__module__
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if qualname is None:
        return f"{type(obj).__module__}.{type(obj).__qualname__}"
    return f"{module}.{qualname}"


def function_digest(fn: Any) -> str:
    """Digest of a Python callable's code (for decompositions, custom passes).

    The same fingerprint the bypass uses for traced sources (bytecode and
    constants, not source text, so REPL functions work too); builtins and C
    functions digest by name.
    """
    fn = getattr(fn, "__wrapped__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return qualified_name(fn)
    from .bypass.code_codec import code_fingerprint

    return code_fingerprint(code)


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
    so their *values* are hashed too.
    """
    import torch

    nodes = []
    constants = {}
    for node in gm.graph.nodes:
        nodes.append(
            [node.op, node.name, _describe_value(node.target), _describe_value(node.args),
             _describe_value(node.kwargs)]
        )
        if node.op == "get_attr":
            value = _fetch_attr(gm, str(node.target))
            if isinstance(value, torch.Tensor):
                data = value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                constants[str(node.target)] = hashlib.sha256(data).hexdigest()
    return {"nodes": nodes, "constants": constants}


def _fetch_attr(gm: Any, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def input_factors(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> list[Any]:
    """Input metadata, taking symbolic shapes from the placeholders' fake values."""
    import torch

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: list[Any] = []
    for i, value in enumerate(example_inputs):
        fake = placeholders[i].meta.get("example_value") if i < len(placeholders) else None
        source = fake if isinstance(fake, torch.Tensor) else value
        if isinstance(value, torch.Tensor):
            meta = tensor_meta(source)
            meta["requires_grad"] = bool(value.requires_grad)
            out.append(meta)
        elif isinstance(value, torch.SymInt) or isinstance(fake, torch.SymInt):
            out.append({"symint": str(fake if fake is not None else value)})
        else:
            out.append({"value": _describe_value(value)})
    return out


def decomposition_factors(decomps: dict[Any, Any] | None) -> dict[str, str] | None:
    if not decomps:
        return None
    return {str(op): function_digest(fn) for op, fn in sorted(decomps.items(), key=lambda kv: str(kv[0]))}


def compute_key(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    compiler: InnerCompiler,
    options: BackendOptions,
    grad_enabled: bool,
) -> tuple[str, dict[str, Any]]:
    """Return ``(key, factors)``; ``factors`` is the readable form of the key."""
    from .torchair_config import config_snapshot

    graph = graph_factors(gm)
    factors = {
        "format": FORMAT_VERSION,
        "graph": digest(graph),
        "inputs": input_factors(gm, example_inputs),
        "compiler": compiler.name,
        "compiler_factors": compiler.hash_factors(options),
        "config": config_snapshot(options.config),
        "ge_cache": options.ge_cache,
        "decompositions": decomposition_factors(options.custom_decompositions),
        "grad_enabled": grad_enabled,
        "environment": environment_factors(),
    }
    return digest(factors), factors


def explain_difference(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable list of factor paths that differ between two factor dicts."""
    diffs: list[str] = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        path = f"{prefix}{name}"
        if isinstance(a, dict) and isinstance(b, dict):
            diffs.extend(explain_difference(a, b, path + "."))
        elif a != b:
            diffs.append(f"{path}: {a!r} -> {b!r}")
    return diffs
