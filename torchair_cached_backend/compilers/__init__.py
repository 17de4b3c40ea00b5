"""Inner compilers, one module each, found by name and imported only when used.

Also the two things every compiler's warm ``load`` uses, here so a warm start imports no
module for them: :class:`Artifact` (what the store hands back) and :func:`load_code` (the
code object stored beside a generated source; ``pycode`` writes it). The compile-side
contract (``CompileResult``, the ``InnerCompiler`` protocol) is ``base``.
"""

from __future__ import annotations

import importlib
import marshal
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import InnerCompiler

_MODULES = {
    "eager": ("eager", "EagerCompiler"),
    "inductor": ("inductor", "InductorCompiler"),
    "torchair": ("torchair", "TorchairCompiler"),
}
_instances: dict[str, InnerCompiler] = {}

#: the file holding ``files[name]``'s marshalled code object is ``name + SUFFIX``
SUFFIX = ".marshal"


def get_compiler(name: str) -> InnerCompiler:
    """The (stateless, shared) inner compiler called ``name``."""
    if name not in _instances:
        if name not in _MODULES:
            raise ValueError(f"unknown inner compiler {name!r}; valid: {', '.join(_MODULES)}")
        module, cls = _MODULES[name]
        _instances[name] = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    return _instances[name]


# A plain slotted class, not a dataclass: a @dataclass costs ~0.5 ms at import.
class Artifact:
    """What an inner compiler stores for one graph.

    ``files`` are opaque blobs (name -> bytes), checksummed by the store.
    ``meta`` must be JSON-serializable; it is written into the manifest.
    ``root`` is set by the store on load: the directory holding ``files`` on
    disk, already verified against their checksums (a compiler may dlopen/exec
    them in place).
    """

    __slots__ = ("files", "meta", "root")

    def __init__(self, files: dict[str, bytes], meta: dict[str, Any] | None = None, root: str | None = None) -> None:
        self.files = files
        self.meta = {} if meta is None else meta
        self.root = root

    def __repr__(self) -> str:
        return f"Artifact(files={sorted(self.files)}, meta_keys={sorted(self.meta)}, root={self.root!r})"


#: operators a stored graph may call that torch registers only when a module of its own is imported
#: (Dynamo's, for ``x._version``): a warm process that never imported it crashed in the graph
OPS_REGISTERED_ON_IMPORT = {b"prims._tensor_version": "torch._dynamo.tensor_version_op"}


def load_code(files: dict[str, bytes], name: str, filename: str) -> types.CodeType:
    """The code object of ``files[name]``: unmarshalled when precompiled, else compiled. Operators
    its source calls that torch registers on an import (:data:`OPS_REGISTERED_ON_IMPORT`) are
    registered first."""
    source = files.get(name) or b""
    for op, module in OPS_REGISTERED_ON_IMPORT.items():
        if module not in sys.modules and op in source:  # (once imported: no scan of the source)
            importlib.import_module(module)
    blob = files.get(name + SUFFIX)
    if blob is not None:
        code = marshal.loads(blob)
        if isinstance(code, types.CodeType):
            return code
    return compile(files[name].decode(), filename, "exec")
