"""Dynamo's DDP optimizer's split graphs, described and rebuilt without FX.

Under ``DistributedDataParallel`` Dynamo's DDP optimizer splits a frame's graph at
bucket boundaries and compiles each piece with our backend; the frame then calls
an outer ``GraphModule`` that calls the pieces (each in a small wrapper that may
unwrap a one-element tuple). The capture describes that outer graph as plain
steps naming which cached graph each piece is; the loader rebuilds it as a
:class:`SplitGraph` over the cached graphs. Only the shapes the DDP optimizer
makes are accepted (inputs, calls of pieces, tuple indexing, one output);
anything else is not described, so the frame is not replayed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..graph_load import CachedGraph

_DDP_MODULE = "torch._dynamo.backends.distributed"


class Described:
    """What the capture records for one split graph, with the duck-typed fields
    (``options``, ``compiler``, ``cached``, ``reason``) it reads off a graph."""

    def __init__(self, steps: list[Any], parts: dict[str, tuple[CachedGraph, bool]]) -> None:
        self.steps = steps
        self.parts = parts
        graphs = [g for g, _ in parts.values()]
        self.options = graphs[0].options
        self.compiler = graphs[0].compiler
        self.cached = all(g.cached for g in graphs)
        self.reason = next((g.reason for g in graphs if not g.cached), None)

    def descriptor(self) -> dict[str, Any]:
        return {
            "kind": "split",
            "steps": self.steps,
            "parts": {name: {"key": g.key, "compiler": g.compiler, "unwrap": unwrap}
                      for name, (g, unwrap) in sorted(self.parts.items())},
        }


def describe(value: Any, our_graph: Callable[[Any], CachedGraph | None]) -> Described | None:
    """The description of ``value`` if it is a DDP-optimizer split graph whose pieces are
    all ours (``our_graph`` finds our graph behind a piece), else None."""
    import torch.fx

    seen = 0
    while value is not None and seen < 8 and not isinstance(value, torch.fx.GraphModule):
        value = getattr(value, "__wrapped__", None) or getattr(value, "_orig_mod", None)
        seen += 1
    if not isinstance(value, torch.fx.GraphModule):
        return None
    steps: list[Any] = []
    parts: dict[str, tuple[CachedGraph, bool]] = {}
    for node in value.graph.nodes:
        if node.op == "placeholder" and not node.args:
            steps.append(["input", node.name])
        elif node.op == "call_module" and not node.kwargs:
            piece = value.get_submodule(node.target)
            graph = our_graph(getattr(piece, "submod", None))
            unwrap = getattr(piece, "unwrap_singleton_tuple", None)
            if graph is None or not isinstance(unwrap, bool) or type(piece).__module__ != _DDP_MODULE:
                return None
            parts[node.target] = (graph, unwrap)
            steps.append(["call", node.name, node.target, [_arg(a) for a in node.args]])
        elif (node.op == "call_function" and node.target is operator.getitem and not node.kwargs
              and len(node.args) == 2 and isinstance(node.args[0], torch.fx.Node) and isinstance(node.args[1], int)):
            steps.append(["item", node.name, node.args[0].name, node.args[1]])
        elif node.op == "output" and len(node.args) == 1:
            steps.append(["output", _arg(node.args[0])])
        else:
            return None
    names = {name for name, _ in value.named_children()}
    if not parts or names != set(parts) or sum(s[0] == "output" for s in steps) != 1:
        return None
    return Described(steps, parts)


def _arg(arg: Any) -> Any:
    import torch.fx

    if isinstance(arg, torch.fx.Node):
        return {"node": arg.name}
    if isinstance(arg, (tuple, list)):
        return {"tuple" if isinstance(arg, tuple) else "list": [_arg(a) for a in arg]}
    if arg is None or isinstance(arg, (bool, int)):
        return arg
    raise ValueError(f"unsupported argument {type(arg).__name__} in a split graph")


class SplitGraph:
    """Runs a described split graph over loaded graphs (``parts``: name -> (fn, unwrap))."""

    def __init__(self, steps: list[Any], parts: dict[str, tuple[Callable[..., Any], bool]]) -> None:
        self.inputs = [s[1] for s in steps if s[0] == "input"]
        self.body = [s for s in steps if s[0] in ("call", "item")]
        self.output = next(s[1] for s in steps if s[0] == "output")
        self.parts = parts
        for step in self.body:
            if step[0] == "call" and step[2] not in parts:
                raise ValueError(f"split graph calls {step[2]}, which it does not hold")

    def __call__(self, *args: Any) -> Any:
        if len(args) != len(self.inputs):
            raise TypeError(f"split graph takes {len(self.inputs)} inputs, got {len(args)}")
        env = dict(zip(self.inputs, args, strict=True))
        for step in self.body:
            if step[0] == "call":
                fn, unwrap = self.parts[step[2]]
                out = fn(*[_value(a, env) for a in step[3]])
                if unwrap and isinstance(out, (tuple, list)):
                    out = out[0]
                env[step[1]] = out
            else:
                env[step[1]] = operator.getitem(env[step[2]], step[3])
        return _value(self.output, env)


def _value(arg: Any, env: dict[str, Any]) -> Any:
    if isinstance(arg, dict):
        if "node" in arg:
            return env[arg["node"]]
        if "tuple" in arg:
            return tuple(_value(a, env) for a in arg["tuple"])
        return [_value(a, env) for a in arg["list"]]
    return arg
