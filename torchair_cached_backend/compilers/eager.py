"""The ``eager`` inner compiler: the FX graph's own Python code, stored as source.

It is the reference for correctness and the floor for warm-start time: loading
is one ``exec`` of a few hundred lines, with nothing else imported.
"""

from __future__ import annotations

import builtins
import math
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import code_codec
from ..logs import warn_once
from . import pycode
from .base import Artifact, CompileResult

if TYPE_CHECKING:
    import torch

    from ..options import BackendOptions

SOURCE = "graph.py"
CONSTANTS = "constants.pt"


_PLAIN_GLOBALS = {"inf": math.inf, "nan": math.nan}


class _Holder:
    """Stands in for ``self`` in the generated ``forward``: holds get_attr constants."""


class EagerCompiler:
    name = "eager"

    def hash_factors(self, options: BackendOptions) -> dict[str, Any]:
        return {"codegen": "fx-python-v1"}

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any], options: BackendOptions) -> CompileResult:
        import torch

        if options.custom_decompositions:
            warn_once("eager-decompositions", "npu_cached: the eager inner compiler runs Dynamo's graph as it is; "
                      "custom_decompositions apply with compiler='inductor' or 'torchair' only")
        code = gm.graph.python_code(root_module="self")
        refs: dict[str, Any] = {}
        for name, value in code.globals.items():
            if name in _PLAIN_GLOBALS or name in vars(builtins):
                continue
            try:  # the same safe codec the bytecode uses: by import name, never pickle
                refs[name] = code_codec.encode_value(value)
            except code_codec.CodecError as exc:
                return CompileResult(gm.forward, None, f"graph global {name} cannot be found in a fresh process: {exc}")
        constants = {}
        for node in gm.graph.nodes:
            if node.op == "call_module":
                return CompileResult(gm.forward, None, f"graph calls submodule {node.target!r}")
            if node.op == "get_attr":
                value = gm
                for part in str(node.target).split("."):
                    value = getattr(value, part)
                if not isinstance(value, torch.Tensor):
                    return CompileResult(gm.forward, None, f"graph attribute {node.target!r} is not a tensor")
                constants[str(node.target)] = value.detach()
        files = {SOURCE: code.src.encode()}
        pycode.precompile(files, SOURCE, f"<npu_cached eager graph {SOURCE}>")
        if constants:
            from .stored_tensors import save_tensors

            files[CONSTANTS] = save_tensors(constants)
        return CompileResult(gm.forward, Artifact(files=files, meta={"globals": refs}))

    def load(self, artifact: Artifact, options: BackendOptions) -> Callable[..., Any]:
        namespace: dict[str, Any] = dict(_PLAIN_GLOBALS)
        for name, ref in artifact.meta.get("globals", {}).items():
            namespace[name] = code_codec.decode_value(ref)
        exec(pycode.load_code(artifact.files, SOURCE, f"<npu_cached eager graph {SOURCE}>"), namespace)
        forward = namespace["forward"]
        holder = _Holder()
        if CONSTANTS in artifact.files:
            from .stored_tensors import load_tensors  # real tensors even inside Dynamo's fake mode

            constants = load_tensors(artifact.files[CONSTANTS])
            for target, tensor in constants.items():
                *parents, leaf = target.split(".")
                obj: Any = holder
                for part in parents:
                    if not hasattr(obj, part):
                        setattr(obj, part, _Holder())
                    obj = getattr(obj, part)
                setattr(obj, leaf, tensor)
        return types.MethodType(forward, holder)
