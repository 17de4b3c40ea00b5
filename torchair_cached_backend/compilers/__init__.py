"""Inner compilers, one module each, found by name and imported only when used."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import InnerCompiler

_MODULES = {
    "eager": ("eager", "EagerCompiler"),
    "inductor": ("inductor", "InductorCompiler"),
    "torchair": ("torchair", "TorchairCompiler"),
}
_instances: dict[str, InnerCompiler] = {}


def get_compiler(name: str) -> InnerCompiler:
    """The (stateless, shared) inner compiler called ``name``."""
    if name not in _instances:
        if name not in _MODULES:
            raise ValueError(f"unknown inner compiler {name!r}; valid: {', '.join(_MODULES)}")
        module, cls = _MODULES[name]
        _instances[name] = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    return _instances[name]
