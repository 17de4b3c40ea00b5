"""Staleness checks that replace guards: the code Dynamo traced, and the module's tensors.

At capture we fingerprint every user code object Dynamo traced or inlined
(torch's own code is covered by the torch version in the key). At load we find
the live code object again by file and qualified name and compare: an edited
``forward`` or helper is a miss and a rebuild, never stale code replayed.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

from .code_codec import code_fingerprint


def _torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__))


#: Dynamo names the code it generates for graph-break continuations this way
RESUME_PREFIX = "torch_dynamo_resume_in"


def _is_library_code(code: types.CodeType) -> bool:
    filename = os.path.abspath(code.co_filename)
    return filename.startswith(_torch_dir() + os.sep) or code.co_filename.startswith("<")


def _is_generated(code: types.CodeType) -> bool:
    """Dynamo's resume functions: generated from the traced function (whose own
    fingerprint covers them), never findable in the live module."""
    return code.co_name.startswith(RESUME_PREFIX)


def _module_for_file(filename: str) -> str | None:
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and os.path.abspath(path) == os.path.abspath(filename):
            return name
    return None


def describe_traced(
    codes: list[types.CodeType], root_file: str | None = None, root_module: str | None = None
) -> list[dict[str, Any]]:
    """Fingerprints of the user code objects among ``codes`` (deduplicated).

    Code in the root frame's own file belongs to the root frame's module, even
    when that module's ``__file__`` is not the file (a script exec'd in ``__main__``).
    """
    seen: set[int] = set()
    out = []
    for code in codes:
        if id(code) in seen or _is_library_code(code) or _is_generated(code):
            continue
        seen.add(id(code))
        out.append(
            {
                "file": code.co_filename,
                "module": root_module
                if root_module is not None and code.co_filename == root_file
                else _module_for_file(code.co_filename),
                "qualname": getattr(code, "co_qualname", code.co_name),
                "fingerprint": code_fingerprint(code),
            }
        )
    return out


def find_live_code(module_name: str | None, qualname: str) -> types.CodeType | None:
    """The code object called ``qualname`` in ``module_name`` as it is now."""
    if not module_name:
        return None
    module = sys.modules.get(module_name)
    if module is None:
        try:
            import importlib

            module = importlib.import_module(module_name)
        except Exception:
            return None
    obj: Any = module
    parts = qualname.split(".")
    code: types.CodeType | None = None
    i = 0
    while i < len(parts):
        part = parts[i]
        if part == "<locals>" and code is not None:
            inner = parts[i + 1] if i + 1 < len(parts) else None
            code = next((c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == inner), None)
            if code is None:
                return None
            i += 2
            continue
        if code is not None:
            return None
        obj = getattr(obj, part, None)
        if obj is None:
            return None
        obj = getattr(obj, "__func__", obj)
        obj = _unwrap(obj)
        if isinstance(obj, types.FunctionType):
            code = obj.__code__
        i += 1
    if code is None and isinstance(obj, types.FunctionType):
        code = obj.__code__
    return code


def _unwrap(obj: Any) -> Any:
    while hasattr(obj, "__wrapped__") and isinstance(obj.__wrapped__, types.FunctionType):
        obj = obj.__wrapped__
    return obj


def stale_sources(recorded: list[dict[str, Any]]) -> list[str]:
    """Descriptions of recorded sources whose live code differs (empty: all fresh)."""
    stale = []
    for item in recorded:
        live = find_live_code(item.get("module"), item["qualname"])
        if live is None:
            stale.append(f"{item['qualname']} ({item['file']}) can no longer be found")
        elif code_fingerprint(live) != item["fingerprint"]:
            stale.append(f"{item['qualname']} ({item['file']}) was edited")
    return stale


def tensor_state(obj: Any) -> dict[str, list[Any]] | None:
    """Names, shapes, dtypes and devices of a module's parameters and buffers."""
    import torch

    if not isinstance(obj, torch.nn.Module):
        return None
    state = {}
    for prefix, tensors in (("param:", obj.named_parameters()), ("buffer:", obj.named_buffers())):
        for name, t in tensors:
            state[prefix + name] = [list(t.shape), str(t.dtype), str(t.device)]
    return state


def tensor_state_difference(old: dict[str, list[Any]], new: dict[str, list[Any]]) -> list[str]:
    diffs = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            diffs.append(f"{name} is gone")
        elif name not in old:
            diffs.append(f"{name} is new")
        elif old[name] != new[name]:
            diffs.append(f"{name}: {old[name]} -> {new[name]}")
    return diffs
