"""Staleness checks beside the guards: the code Dynamo traced, and the module's tensors.

At capture we fingerprint every user code object Dynamo traced or inlined; code
of installed libraries (site-packages, the standard library, torch itself) is
recorded by its distribution's version instead, so a library upgrade rebuilds
and an unchanged library costs nothing at load. At load we find the live user
code object again by module and qualified name and compare: an edited
``forward`` or helper is a miss and a rebuild, never stale code replayed.
The capture side (``describe_traced``, ``is_library_file``) is ``sources_capture``.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from typing import Any

from ..code_codec import code_fingerprint

#: Dynamo names the code it generates for graph-break continuations this way
RESUME_PREFIX = "torch_dynamo_resume_in"


def _imported(name: str) -> Any:
    """The module ``name``, imported if it is not yet (None if it cannot be)."""
    module = sys.modules.get(name)
    if module is None:
        try:
            import importlib

            module = importlib.import_module(name)
        except Exception:
            return None
    return module


#: the standard library's directory (``os`` lives there) and how its modules' version reads
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_PYTHON = f"python {sys.version_info[0]}.{sys.version_info[1]}"


def library_version(package: str) -> str | None:
    """The version of an importable top-level package, without importlib.metadata where possible."""
    module = _imported(package)
    if module is None:
        return None
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    file = getattr(module, "__file__", None) or ""
    if package in sys.stdlib_module_names and (not file or os.path.abspath(file).startswith(_STDLIB)):
        return _PYTHON  # the interpreter's own (inspect, functools: BERT's forward traces inspect)
    from .sources_capture import _library_roots, is_library_file  # a package without __version__: rare

    if is_library_file(file) and os.path.abspath(file).startswith(tuple(
        r for r in _library_roots() if "site-packages" in r or "dist-packages" in r
    )):
        try:
            from importlib import metadata

            return metadata.version(package)
        except Exception:
            return None
    return _PYTHON  # standard library


def find_live_code(module_name: str | None, qualname: str) -> types.CodeType | None:
    """The code object called ``qualname`` in ``module_name`` as it is now."""
    module = _imported(module_name) if module_name else None
    if module is None:
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
        if isinstance(obj, property):
            obj = obj.fget
        elif isinstance(obj, functools.cached_property):
            obj = obj.func
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
        if "library" in item:
            now = library_version(item["library"])
            if now != item.get("version"):
                stale.append(f"library {item['library']} {item.get('version')} -> {now}")
            continue
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
    module = torch.nn.Module
    cls = type(obj)
    if (cls.named_parameters is not module.named_parameters or cls.named_buffers is not module.named_buffers
            or cls._named_members is not module._named_members):
        pairs = (("param:", obj.named_parameters()), ("buffer:", obj.named_buffers()))
    else:  # what those two walks yield, from one walk of the submodules (the warm path: ~2x faster)
        modules = list(obj.named_modules())
        pairs = (("param:", _members(modules, "_parameters")), ("buffer:", _members(modules, "_buffers")))
    state = {}
    text: dict[Any, str] = {}  # dtype / device -> its name (a handful per model)
    for prefix, tensors in pairs:
        for name, t in tensors:
            dtype, device = t.dtype, t.device
            state[prefix + name] = [list(t.shape), text.get(dtype) or text.setdefault(dtype, str(dtype)),
                                    text.get(device) or text.setdefault(device, str(device))]
    return state


def _members(modules: list[tuple[str, Any]], attr: str) -> list[tuple[str, Any]]:
    """``nn.Module._named_members`` over ``modules`` (``named_modules()``): each tensor of
    the ``attr`` dicts once, under the first name it is found by, None entries skipped."""
    seen: set[int] = set()
    out = []
    for prefix, module in modules:
        for key, value in getattr(module, attr).items():
            if value is None or id(value) in seen:
                continue
            seen.add(id(value))
            out.append((f"{prefix}.{key}" if prefix else key, value))
    return out


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


#: the capture side (``sources_capture``): recording what Dynamo traced; re-exported on first use
_CAPTURE_SIDE = frozenset({"describe_traced", "is_library_file"})


def __getattr__(name: str) -> Any:
    if name in _CAPTURE_SIDE:
        from . import sources_capture

        return getattr(sources_capture, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
