"""Staleness checks beside the guards: the code Dynamo traced, and the module's tensors.

At capture we fingerprint every user code object Dynamo traced or inlined; code
of installed libraries (site-packages, the standard library, torch itself) is
recorded by its distribution's version instead, so a library upgrade rebuilds
and an unchanged library costs nothing at load. At load we find the live user
code object again by module and qualified name and compare: an edited
``forward`` or helper is a miss and a rebuild, never stale code replayed.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types
from typing import Any

from ..code_codec import code_fingerprint

#: Dynamo names the code it generates for graph-break continuations this way
RESUME_PREFIX = "torch_dynamo_resume_in"


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """Directories whose code belongs to installed packages, not to the user."""
    import torch

    roots = {os.path.dirname(os.path.abspath(torch.__file__))}
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            roots.add(os.path.abspath(paths[key]))
    for entry in sys.path:
        if entry and os.path.basename(entry) in ("site-packages", "dist-packages"):
            roots.add(os.path.abspath(entry))
    return tuple(sorted(r + os.sep for r in roots))


@functools.cache
def is_library_file(filename: str) -> bool:
    """Code in an installed package or the standard library (an editable install
    of a package lives outside these roots and counts as user code)."""
    if filename.startswith("<"):
        return True  # frozen / generated code: covered by versions or by the guard on the object
    path = os.path.abspath(filename)
    return path.startswith(_library_roots())


def _is_library_code(code: types.CodeType) -> bool:
    return is_library_file(code.co_filename)


def _top_package(module_name: str | None) -> str | None:
    return module_name.split(".", 1)[0] if module_name else None


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


def library_version(package: str) -> str | None:
    """The version of an importable top-level package, without importlib.metadata where possible."""
    module = _imported(package)
    if module is None:
        return None
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    file = getattr(module, "__file__", None) or ""
    if is_library_file(file) and os.path.abspath(file).startswith(tuple(
        r for r in _library_roots() if "site-packages" in r or "dist-packages" in r
    )):
        try:
            from importlib import metadata

            return metadata.version(package)
        except Exception:
            return None
    return f"python {sys.version_info[0]}.{sys.version_info[1]}"  # standard library


def _is_generated(code: types.CodeType) -> bool:
    """Dynamo's resume functions: generated from the traced function (whose own
    fingerprint covers them), never findable in the live module."""
    return code.co_name.startswith(RESUME_PREFIX)


def _module_for_file(filename: str) -> str | None:
    target = os.path.abspath(filename)
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and os.path.abspath(path) == target:
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
    nested = _nested_codes(codes)
    out = []
    libraries: set[str] = set()
    for code in codes:
        if id(code) in seen or _is_generated(code) or id(code) in nested:
            continue
        seen.add(id(code))
        if _is_library_code(code):
            if code.co_filename.startswith("<"):
                continue
            package = _top_package(_module_for_file(code.co_filename))
            if package and package not in libraries and package != "torch":  # torch: in every key already
                libraries.add(package)
                out.append({"library": package, "version": library_version(package)})
            continue
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


def _nested_codes(codes: list[types.CodeType]) -> set[int]:
    """Code objects that are constants of other traced code: their parent's fingerprint covers them."""
    inner: set[int] = set()

    def walk(code: types.CodeType) -> None:
        for const in code.co_consts:
            if isinstance(const, types.CodeType) and id(const) not in inner:
                inner.add(id(const))
                walk(const)

    for code in codes:
        walk(code)
    return inner


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
