"""Human-readable dumps of cached programs (``readable_cache``, as torchair's)."""

from __future__ import annotations

import dis
import io
import json
import os
from typing import Any

from . import fs_security as fs
from .store import MANIFEST


def _program_dirs(path: str) -> list[str]:
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return [path]
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "quarantine")
        if MANIFEST in files and os.path.basename(os.path.dirname(root)) == "programs":
            found.append(root)
    return found


def _graph_code(cache_root: str, key: str) -> str:
    blob = os.path.join(cache_root, "graphs", key, "files", "graph_code.py")
    try:
        return fs.read_private(blob, root=cache_root).decode()
    except OSError:
        return f"<graph {key[:12]} not found in {cache_root}>\n"


def describe_program(entry_dir: str) -> str:
    from .bypass import code_codec

    cache_root = os.path.dirname(os.path.dirname(entry_dir))
    manifest = json.loads(fs.read_private(os.path.join(entry_dir, MANIFEST), root=cache_root))
    program: dict[str, Any] = manifest["program"]
    out = io.StringIO()
    w = out.write
    w("=" * 100 + "\n")
    fn = program["function"]
    w(f"program {manifest['key'][:16]}  function {fn.get('module')}.{fn['qualname']}  compiler {program['compiler']}\n")
    if program.get("unsupported"):
        w(f"NOT REPLAYABLE: {program['unsupported']}\n")
    w("\n## key factors\n")
    w(json.dumps({"versions": manifest.get("versions"), "traced_sources": program.get("traced"),
                  "tensor_state": program.get("tensor_state")}, indent=1, default=str) + "\n")
    for i, variant in enumerate(program["variants"]):
        w(f"\n## variant {i}: grad_enabled={variant['grad_enabled']} root frame {variant['root']}\n")
        w("input signature:\n")
        for item in variant["signature"]:
            w(f"  {json.dumps(item)}\n")
    for fid, frame in program["frames"].items():
        w(f"\n## frame {fid} ({frame['co_name']})\n")
        for name, desc in frame["globals"].items():
            w(f"  global {name} = {json.dumps(desc)}\n")
        code = code_codec.loads_code(fs.read_private(os.path.join(entry_dir, "files", frame["code"]), root=cache_root))
        w("\n### transformed bytecode\n")
        w(dis.Bytecode(code).dis())
        for name, desc in frame["globals"].items():
            if desc.get("kind") == "graph":
                w(f"\n### graph {name} ({desc['compiler']}, key {desc['key'][:16]})\n")
                w(_graph_code(cache_root, desc["key"]))
    return out.getvalue()


def readable_cache(cache_bin: str, print_output: bool = True, file: str | None = None) -> str:
    """Describe the cached program(s) under ``cache_bin`` (an entry, a ``cache_compile``
    directory or a whole cache dir): bytecode disassembly, graph code, input
    signature and key factors. Prints it, writes it to ``file`` (mode 0600), and returns it."""
    dirs = _program_dirs(cache_bin)
    if not dirs:
        raise FileNotFoundError(f"no cached program under {cache_bin!r}")
    text = "\n".join(describe_program(d) for d in dirs)
    if print_output:
        print(text)
    if file is not None:
        if os.path.lexists(file):
            os.remove(file)
        fs.write_private(file, text.encode())
    return text
