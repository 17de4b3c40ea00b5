"""Generated Python source stored with its compiled bytecode.

Every inner compiler stores Python source (FX code, Inductor's wrapper,
torchair's GE codegen). Compiling that source again at every warm start costs
milliseconds for large graphs (torchair's embeds the serialized GE graph), so
the artifact also carries the code object, marshalled. The graph key includes
the Python minor version, so the marshal format always matches; the source
stays beside it for humans and for ``readable_cache``.
"""

from __future__ import annotations

import marshal
import types

SUFFIX = ".marshal"


def precompile(files: dict[str, bytes], name: str, filename: str) -> None:
    """Add ``name + SUFFIX`` (the compiled ``files[name]``) to ``files``."""
    code = compile(files[name].decode(), filename, "exec")
    files[name + SUFFIX] = marshal.dumps(code)


def load_code(files: dict[str, bytes], name: str, filename: str) -> types.CodeType:
    """The code object of ``files[name]``: unmarshalled when precompiled, else compiled."""
    blob = files.get(name + SUFFIX)
    if blob is not None:
        code = marshal.loads(blob)
        if isinstance(code, types.CodeType):
            return code
    return compile(files[name].decode(), filename, "exec")
