"""Fresh-interpreter helpers shared by the tests (a module of its own: ``conftest`` is an
ambiguous import name once tests/torchair/conftest.py is loaded too)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any

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


def cold_then_warm_routes(code: str, base: Any, env: dict[str, str]) -> tuple[dict, dict[str, dict]]:
    """``code`` cold in a fresh process (cache ``base/cold``), then warm once per route (``load``,
    ``backend``), each in a fresh process on its own copy of the cold cache. ``env`` goes to all three
    with ``ROOT``, ``PHASE`` and (warm) ``ROUTE`` set. Returns ``(cold, {route: warm})``."""
    cold = run_python(code, env={**env, "ROOT": os.path.join(base, "cold"), "PHASE": "cold"})
    warm = {}
    for route in ("load", "backend"):
        shutil.copytree(os.path.join(base, "cold"), os.path.join(base, route))
        warm[route] = run_python(code, env={**env, "ROOT": os.path.join(base, route), "PHASE": "warm", "ROUTE": route})
    return cold, warm
