"""Plumbing shared by the benchmark scripts: one fresh child process per measurement,
results as JSON plus a markdown rendering."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

#: prefix of the one stdout line a child reports its result on
RESULT_TAG = "RESULT "


def spawn(script: str, args: list[str], inductor_dir: str, timeout: float, child_env: dict[str, str]) -> dict:
    """Run ``script --child *args`` in a fresh interpreter with its own Inductor cache
    dir; the result dict it printed, or ``{"error": ...}``. Never raises."""
    os.makedirs(inductor_dir, exist_ok=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, **child_env)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as an installed package, children use .pyc files
    cmd = [sys.executable, os.path.abspath(script), "--child", *args]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f}s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}, no output"])[-1]
    return {"error": tail[:500]}


def report(result: dict) -> None:
    """A child's side of :func:`spawn`."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def write_outputs(doc: dict, out: str, render: Callable[[dict], str]) -> None:
    """``out`` (JSON) and the markdown beside it."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    md = os.path.splitext(out)[0] + ".md"
    with open(md, "w") as f:
        f.write(render(doc))
    print(f"wrote {out}, {md}")
