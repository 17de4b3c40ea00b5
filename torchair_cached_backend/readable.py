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
    from . import code_codec

    cache_root = os.path.dirname(os.path.dirname(entry_dir))
    manifest = json.loads(fs.read_private(os.path.join(entry_dir, MANIFEST), root=cache_root))
    program: dict[str, Any] = manifest["program"]
    out = io.StringIO()
    w = out.write
    w("=" * 100 + "\n")
    fn = program["function"]
    w(f"program {manifest['key'][:16]}  function {fn.get('module')}.{fn['qualname']}  compiler {program['compiler']}\n")
    if fn.get("receiver_type"):
        w(f"receiver type {fn['receiver_type']}\n")
    w("\n## versions\n")
    w(json.dumps(manifest.get("versions"), indent=1, default=str) + "\n")
    for i, variant in enumerate(program.get("variants", [])):
        frame = program["frames"].get(variant["root"], {})
        w(f"\n## variant {i}: root frame {variant['root']}\n")
        _write_checks(w, frame, entry_dir, cache_root)
    for group in program.get("resumes", {}).values():
        w(f"\n## after a graph break: {group['name']} ({len(group.get('frames', []))} compiled variant(s); "
          "the original code runs eagerly when none fits)\n")
        for fid in group.get("frames", []):
            w(f"\n### resume variant, frame {fid}\n")
            _write_checks(w, program["frames"].get(fid, {}), entry_dir, cache_root)
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


def _guard_meta(guards: dict[str, Any], entry_dir: str, cache_root: str) -> list[dict[str, Any]]:
    """The guards' explanations: in the guards blob (format 3), else in the manifest."""
    if guards.get("meta") or not guards.get("code"):
        return guards.get("meta") or []
    from .bypass.guard_runtime import checks_meta

    try:
        blob = fs.read_private(os.path.join(entry_dir, "files", guards["code"]), root=cache_root)
        return checks_meta(blob)
    except (OSError, ValueError):
        return []


def _write_checks(w: Any, frame: dict[str, Any], entry_dir: str, cache_root: str) -> None:
    """What a warm start checks before replaying this frame (see the README)."""
    if frame.get("unsupported"):
        w(f"NOT REPLAYABLE: {frame['unsupported']}\n")
    guards = frame.get("guards") or {}
    state = guards.get("state") or {}
    if state:
        w(f"captured under: {json.dumps(state)}\n")
    meta = _guard_meta(guards, entry_dir, cache_root)
    for scope, title in (("load", "checked once when the warm start loads"),
                         ("call", "checked on every call (selects the variant)")):
        items = [m for m in meta if m.get("scope") == scope]
        w(f"{title}: {len(items)}\n")
        for m in items:
            shown = f": {m['was']}" if m.get("kind") == "TENSOR_MATCH" and m.get("was") else ""
            w(f"  [{m.get('kind')}] {m.get('desc')}{shown}\n")
    traced = frame.get("traced") or []
    if traced:
        w("code it traced (checked for edits at load):\n")
        for t in traced:
            if "library" in t:
                w(f"  library {t['library']} {t.get('version')}\n")
            else:
                w(f"  {t.get('module')}.{t['qualname']} ({t['fingerprint'][:12]})\n")


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
