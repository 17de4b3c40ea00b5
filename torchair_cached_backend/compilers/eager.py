"""The ``eager`` inner compiler: the FX graph's own Python code, stored as source.

It is the reference for correctness and the floor for warm-start time: loading
is one ``exec`` of a few hundred lines, with nothing else imported. Training graphs
store AOTAutograd's partitioned forward and backward (``fw.graph.py``, ``bw.graph.py``),
run by :mod:`.autograd_runtime`. Packaging a graph (the compile side) is
``eager_compile``; this module is what a warm load runs.
"""

from __future__ import annotations

import json
import math
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import code_codec
from . import load_code

if TYPE_CHECKING:
    import torch

    from ..options import BackendOptions
    from . import Artifact
    from .base import CompileResult

SOURCE = "graph.py"
CONSTANTS = "constants.pt"
#: the higher-order-op subgraphs a graph passes by attribute (``cond_true_0``, ``wrap_body_0``):
#: JSON ``{attribute: globals}``, each subgraph's files under ``prefix + "sub." + attribute + "."``
SUBGRAPHS = "subgraphs.json"


_PLAIN_GLOBALS = {"inf": math.inf, "nan": math.nan}


class _Holder:
    """Stands in for ``self`` in the generated ``forward``: holds get_attr constants."""


class EagerCompiler:
    name = "eager"

    def hash_factors(self, options: BackendOptions) -> dict[str, Any]:
        return {"codegen": "fx-python-v1"}


    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any], options: BackendOptions) -> CompileResult:
        """The graph's own Python code (``eager_compile``: a warm load never compiles)."""
        from .eager_compile import compile_graph

        return compile_graph(self, gm, example_inputs, options)

    def compile_training(
        self, gm: torch.fx.GraphModule, example_inputs: list[Any], options: BackendOptions
    ) -> CompileResult:
        """AOTAutograd's partitioned forward and backward as FX Python code (``eager_compile``)."""
        from .eager_compile import compile_training

        return compile_training(self, gm, example_inputs, options)

    def load(self, artifact: Artifact, options: BackendOptions) -> Callable[..., Any]:
        plan = artifact.meta.get("training")
        if plan is None:
            return _load_graph(artifact.files, "", _namespace(artifact.meta.get("globals", {})))
        from .autograd_runtime import build

        refs = artifact.meta["part_globals"]
        forward = _boxed(_load_graph(artifact.files, FW, _namespace(refs[FW])))
        backward = _boxed(_load_graph(artifact.files, BW, _namespace(refs[BW])))
        return build(forward, backward, plan, bool(artifact.meta.get("disable_amp")))


def _namespace(refs: dict[str, Any]) -> dict[str, Any]:
    namespace: dict[str, Any] = dict(_PLAIN_GLOBALS)
    for name, ref in refs.items():
        namespace[name] = code_codec.decode_value(ref)
    return namespace


#: file-name prefixes of a training artifact's forward and backward graphs
FW, BW = "fw.", "bw."


def _boxed(fn: Callable[..., Any]) -> Callable[[list[Any]], Any]:
    def boxed(args: list[Any]) -> Any:
        return fn(*args)

    return boxed


def _subgraph_prefix(prefix: str, target: str) -> str:
    return f"{prefix}sub.{target}."


def _load_graph(files: dict[str, bytes], prefix: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    forward = _exec_forward(files, prefix, namespace)
    holder = _Holder()
    for target, tensor in _constants(files, prefix).items():
        *parents, leaf = target.split(".")
        obj: Any = holder
        for part in parents:
            if not hasattr(obj, part):
                setattr(obj, part, _Holder())
            obj = getattr(obj, part)
        setattr(obj, leaf, tensor)
    for target, module in _subgraph_modules(files, prefix).items():
        setattr(holder, target, module)
    return types.MethodType(forward, holder)


def _exec_forward(files: dict[str, bytes], prefix: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    exec(load_code(files, prefix + SOURCE, f"<npu_cached eager graph {prefix}{SOURCE}>"), namespace)
    return namespace["forward"]


def _constants(files: dict[str, bytes], prefix: str) -> dict[str, Any]:
    if prefix + CONSTANTS not in files:
        return {}
    from .stored_tensors import load_tensors  # real tensors even inside Dynamo's fake mode

    return load_tensors(files[prefix + CONSTANTS])


def _subgraph_modules(files: dict[str, bytes], prefix: str) -> dict[str, Any]:
    """The stored subgraphs as real ``GraphModule``s: higher-order ops need one (checkpoint
    runs it through ``fx.Interpreter``), so each one's code is traced back into a graph,
    as FX itself does when it unpickles a GraphModule."""
    if prefix + SUBGRAPHS not in files:
        return {}
    import torch

    modules = {}
    for target, refs in json.loads(files[prefix + SUBGRAPHS]).items():
        sub_prefix = _subgraph_prefix(prefix, target)
        forward = _exec_forward(files, sub_prefix, _namespace(refs))
        root = type(target, (torch.nn.Module,), {"forward": forward})()
        for name, tensor in _constants(files, sub_prefix).items():
            *parents, leaf = name.split(".")
            owner: Any = root
            for part in parents:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            setattr(owner, leaf, tensor)
        modules[target] = torch.fx.GraphModule(root, torch.fx.Tracer().trace(root), class_name=target)
    return modules
