"""The global names a code object (and every code nested in it) reads, and a copy of it
reading other names: the capture renames graphs to per-program names, the loader and the
backend route rename what they install beside the replayed bytecode."""

from __future__ import annotations

import types


def global_names(code: types.CodeType) -> set[str]:
    """``co_names`` of ``code`` and of every code object among its constants."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


def renamed(code: types.CodeType, rename: dict[str, str]) -> types.CodeType:
    """``code`` (and its nested codes) with the names in ``rename`` replaced."""
    consts = tuple(renamed(c, rename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_names=tuple(rename.get(n, n) for n in code.co_names), co_consts=consts)
