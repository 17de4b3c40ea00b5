"""The ``eager`` inner compiler: the FX graph's own Python code, stored as source.

It is the reference for correctness and the floor for warm-start time: loading
is one ``exec`` of a few hundred lines, with nothing else imported.
"""

from __future__ import annotations

import builtins
import importlib
import io
import math
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import pycode
from .base import Artifact, CompileResult

if TYPE_CHECKING:
    import torch

    from ..options import BackendOptions

SOURCE = "graph.py"
CONSTANTS = "constants.pt"


def global_reference(value: Any) -> dict[str, str] | None:
    """How to find ``value`` again in a fresh process (module + qualname), or None."""
    if isinstance(value, types.ModuleType):
        return {"module": value.__name__, "qualname": ""}
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if value is type(None):
        return {"module": "builtins", "qualname": "type(None)"}
    if module and qualname and "<locals>" not in qualname and "<lambda>" not in qualname:
        try:
            if resolve_reference({"module": module, "qualname": qualname}) is value:
                return {"module": module, "qualname": qualname}
        except Exception:
            pass
    # torch ops (OpOverload/OpOverloadPacket) print as torch.ops.<ns>.<name>[.<overload>]
    text = str(value)
    if text.startswith("aten.") or type(value).__name__ in ("OpOverload", "OpOverloadPacket"):
        name = getattr(value, "_qualified_op_name", None) or text
        ref = {"module": "torch", "qualname": "ops." + name.replace("::", ".")}
        overload = getattr(value, "_overloadname", None)
        if overload and not ref["qualname"].endswith("." + overload):
            ref["qualname"] += "." + overload
        try:
            if resolve_reference(ref) is value:
                return ref
        except Exception:
            return None
    return None


def resolve_reference(ref: dict[str, str]) -> Any:
    if ref["module"] == "builtins" and ref["qualname"] == "type(None)":
        return type(None)
    obj: Any = importlib.import_module(ref["module"])
    for part in filter(None, ref["qualname"].split(".")):
        obj = getattr(obj, part)
    return obj


_PLAIN_GLOBALS = {"inf": math.inf, "nan": math.nan}


class _Holder:
    """Stands in for ``self`` in the generated ``forward``: holds get_attr constants."""


class EagerCompiler:
    name = "eager"

    def hash_factors(self, options: BackendOptions) -> dict[str, Any]:
        return {"codegen": "fx-python-v1"}

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any], options: BackendOptions) -> CompileResult:
        import torch

        code = gm.graph.python_code(root_module="self")
        refs: dict[str, Any] = {}
        for name, value in code.globals.items():
            if name in _PLAIN_GLOBALS or name in vars(builtins):
                continue
            ref = global_reference(value)
            if ref is None:
                return CompileResult(
                    gm.forward, None, f"graph global {name}={value!r} cannot be found by name in a fresh process"
                )
            refs[name] = ref
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
            buf = io.BytesIO()
            torch.save(constants, buf)
            files[CONSTANTS] = buf.getvalue()
        return CompileResult(gm.forward, Artifact(files=files, meta={"globals": refs}))

    def load(self, artifact: Artifact, options: BackendOptions) -> Callable[..., Any]:
        namespace: dict[str, Any] = dict(_PLAIN_GLOBALS)
        for name, ref in artifact.meta.get("globals", {}).items():
            namespace[name] = resolve_reference(ref)
        exec(pycode.load_code(artifact.files, SOURCE, f"<npu_cached eager graph {SOURCE}>"), namespace)
        forward = namespace["forward"]
        holder = _Holder()
        if CONSTANTS in artifact.files:
            import torch

            constants = torch.load(io.BytesIO(artifact.files[CONSTANTS]), weights_only=True)
            for target, tensor in constants.items():
                *parents, leaf = target.split(".")
                obj: Any = holder
                for part in parents:
                    if not hasattr(obj, part):
                        setattr(obj, part, _Holder())
                    obj = getattr(obj, part)
                setattr(obj, leaf, tensor)
        return types.MethodType(forward, holder)
