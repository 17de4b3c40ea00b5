"""Generated Python source stored with its compiled bytecode (the compile side).

Every inner compiler stores Python source (FX code, Inductor's wrapper,
torchair's GE codegen). Compiling that source again at every warm start costs
milliseconds for large graphs (torchair's embeds the serialized GE graph), so
the artifact also carries the code object, marshalled. The graph key includes
the Python minor version, so the marshal format always matches; the source
stays beside it for humans and for ``readable_cache``. The warm side,
:func:`load_code`, lives in the ``compilers`` package (re-exported here).
"""

from __future__ import annotations

import marshal

from . import SUFFIX, load_code  # noqa: F401  (re-exported: the warm side)


def precompile(files: dict[str, bytes], name: str, filename: str) -> None:
    """Add ``name + SUFFIX`` (the compiled ``files[name]``) to ``files``."""
    code = compile(files[name].decode(), filename, "exec")
    files[name + SUFFIX] = marshal.dumps(code)
