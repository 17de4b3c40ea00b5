"""Run a Python snippet against the real torchair in a fresh subprocess.

Example::

    from tests.torchair_harness.run import run_script

    proc = run_script('''
        import torchair
        print(torchair.__file__)
    ''', timeout=60)
    assert "build/torchair-cpu" in proc.stdout

The snippet (dedented) is written to a temporary file and executed in the
child's ``__main__`` namespace (so classes it defines are picklable and
tracebacks show its lines) after ``bootstrap.setup(shim=..., fake_torch_npu=...)``.

The child is started in its own session and killed with SIGKILL (whole
process group) on timeout: torchair's SIGINT/SIGTERM handlers swallow the
polite signals.  A non-zero exit or a timeout raises ``AssertionError`` with
the snippet's stdout/stderr (unless ``check=False``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from . import build as _build

_OUTPUT_LIMIT = 12000

_PRELUDE = """\
import sys
sys.path.insert(0, {repo!r})
import tests.torchair_harness.bootstrap as _tcb_bootstrap
_tcb_bootstrap.setup(shim={shim!r}, fake_torch_npu={fake!r})
del _tcb_bootstrap
_tcb_path = {snippet!r}
with open(_tcb_path, encoding="utf-8") as _tcb_file:
    _tcb_code = compile(_tcb_file.read(), _tcb_path, "exec")
del _tcb_file, _tcb_path
exec(_tcb_code)
"""


def _tail(text: str | bytes | None) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text if len(text) <= _OUTPUT_LIMIT else "...[truncated]...\n" + text[-_OUTPUT_LIMIT:]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own session/group
    except (ProcessLookupError, PermissionError):
        proc.kill()


def run_script(
    code: str,
    *,
    timeout: float,
    env: dict | None = None,
    shim: bool = False,
    fake_torch_npu: bool = False,
    cwd: str | os.PathLike | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the torchair harness bootstrapped.

    ``env`` entries are added to (not substituted for) the current environment;
    a value of ``None`` removes that variable.  ``shim`` installs the executor
    shim (needed whenever a GE graph is *executed*), ``fake_torch_npu`` the
    fake torch_npu (needed for reduce-overhead / npugraph_ex codegen).
    """
    child_env = dict(os.environ)
    child_env.setdefault("CANN_STUB_QUIET", "1")
    child_env["PYTHONUNBUFFERED"] = "1"
    for key, value in (env or {}).items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = str(value)

    with tempfile.TemporaryDirectory(prefix="tcb-torchair-") as tmp:
        snippet = Path(tmp) / "snippet.py"
        snippet.write_text(textwrap.dedent(code), encoding="utf-8")
        runner = Path(tmp) / "runner.py"
        runner.write_text(
            _PRELUDE.format(
                repo=str(_build.REPO_ROOT), shim=bool(shim), fake=bool(fake_torch_npu), snippet=str(snippet)
            ),
            encoding="utf-8",
        )
        args = [sys.executable, str(runner)]
        start = time.monotonic()
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env,
            cwd=str(cwd) if cwd is not None else None,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            stdout, stderr = proc.communicate()
            raise AssertionError(
                f"torchair snippet timed out after {timeout:.0f}s and was killed (SIGKILL)\n"
                f"--- snippet ---\n{textwrap.dedent(code)}\n--- stdout ---\n{_tail(stdout)}\n"
                f"--- stderr ---\n{_tail(stderr)}"
            ) from None
        except BaseException:
            _kill_group(proc)
            proc.communicate()
            raise
        elapsed = time.monotonic() - start
    result = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"torchair snippet failed with exit code {proc.returncode} after {elapsed:.1f}s\n"
            f"--- snippet ---\n{textwrap.dedent(code)}\n--- stdout ---\n{_tail(stdout)}\n"
            f"--- stderr ---\n{_tail(stderr)}"
        )
    return result
