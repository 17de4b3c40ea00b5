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


#: the checkout these scripts belong to: its package is the one a child measures
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_environ(inductor_dir: str, child_env: dict[str, str]) -> dict[str, str]:
    """A child's environment: its own Inductor cache dir, ``child_env``, this checkout's
    package first on the path (not whatever the venv has installed, e.g. an editable
    install of another tree; a ``PYTHONPATH`` in ``child_env`` instead, to measure another
    checkout), and .pyc files used as by an installed package."""
    os.makedirs(inductor_dir, exist_ok=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, **child_env)
    if "PYTHONPATH" not in child_env:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def spawn(script: str, args: list[str], inductor_dir: str, timeout: float, child_env: dict[str, str]) -> dict:
    """Run ``script --child *args`` in a fresh interpreter with its own Inductor cache
    dir; the result dict it printed, or ``{"error": ...}``. Never raises."""
    env = child_environ(inductor_dir, child_env)
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


def tiny_llama(layers: int) -> tuple[object, dict]:
    """(model, inputs) of the fixed-cost benchmarks: a random-init transformers Llama of ``layers``
    layers, d=128, input (2, 24) (``tests/hf_tiny.py``), built after ``import transformers``
    (which imports Dynamo, as in every transformers process)."""
    import transformers  # noqa: F401

    sys.path.insert(0, os.path.join(REPO, "tests"))
    import hf_tiny

    hf_tiny.SIZES[f"fixed{layers}"] = hf_tiny.Size(128, layers, 4, 2, 24)
    return hf_tiny.build("llama", size=f"fixed{layers}")


def report(result: dict) -> None:
    """A child's side of :func:`spawn`."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def write_outputs(
    doc: dict, out: str, render: Callable[[dict], str], png: Callable[[dict, str], str | None] | None = None
) -> None:
    """``out`` (JSON), the markdown beside it and, with ``png``, a plot (``png`` returns
    a note instead when it cannot draw one)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    base = os.path.splitext(out)[0]
    with open(base + ".md", "w") as f:
        f.write(render(doc))
    note = png(doc, base + ".png") if png else None
    plot = f", {base}.png" if png and note is None else ""
    print(f"wrote {out}, {base}.md{plot}" + (f"; {note}" if note else ""), flush=True)
