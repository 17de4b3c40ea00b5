"""Fresh-interpreter helpers shared by the tests (a module of its own: ``conftest`` is an
ambiguous import name once tests/torchair/conftest.py is loaded too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, *, env: dict[str, str] | None = None, cwd: str | None = None, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh interpreter; it must print one JSON object on its
    last stdout line (use ``emit(obj)``). Returns that object; fails loudly with
    the child's output otherwise."""
    prelude = textwrap.dedent(
        """
        import json as _json, sys as _sys
        def emit(obj):
            print(_json.dumps(obj, default=str))
            _sys.stdout.flush()
        """
    )
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    full_env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests"), full_env.get("PYTHONPATH", "")])
    if env:
        full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"child failed (rc={proc.returncode})\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    result = json.loads(lines[-1])
    result["_stderr"] = proc.stderr
    return result
