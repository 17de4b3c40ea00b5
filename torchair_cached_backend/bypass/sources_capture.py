"""What a capture records of the code Dynamo traced (see ``sources``, the load side).

User code by module, qualified name and fingerprint; code of installed libraries
by its distribution's version. Only capture (and a compile's key, for the
functions a graph calls; and ``library_version`` for a package without
``__version__``) imports this module.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types
from typing import Any

from ..code_codec import code_fingerprint
from .sources import RESUME_PREFIX, library_version


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
