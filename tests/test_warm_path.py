"""The warm path stays lean (issue 18): importing the package in a process that already
imported Dynamo (every transformers process) registers ``npu_cached`` without importing
the capture machinery, which waits for the backend to be used; ``TCB_PROFILE=1`` prints
where a warm start spent its time."""

from __future__ import annotations

import textwrap

import pytest
from subprocess_helpers import run_python

MODEL = """
import sys
import torch._dynamo                      # as transformers does, before our package
import torchair_cached_backend as tcb
import torch, torch.nn as nn

class PrintsFirst(nn.Module):  # the root frame has no graph before its graph break
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        print("forward called")
        return self.lin(x).relu()

def ours():
    return sorted(m for m in sys.modules if m.startswith("torchair_cached_backend"))
"""

CAPTURE_MODULES = ("torchair_cached_backend.bypass.capture", "torchair_cached_backend.bypass.guard_capture",
                   "torchair_cached_backend.backend")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("warm_path"))
    cold = run_python(
        MODEL + textwrap.dedent(f"""
        after_import = ours()
        m, x = PrintsFirst().eval(), torch.randn(2, 4)
        f = torch.compile(m, backend="npu_cached", options={{"cache_dir": {d!r}, "compiler": "eager"}})
        after_compile = ours()
        with torch.no_grad():
            ok = bool(torch.allclose(f(x), m.lin(x).relu()))
        emit({{"after_import": after_import, "after_compile": after_compile, "ok": ok}})
        """),
    )
    warm = run_python(
        MODEL + textwrap.dedent(f"""
        from child_helpers import frames
        m, x = PrintsFirst().eval(), torch.randn(2, 4)
        with torch.no_grad():
            f = tcb.load(m, {d!r}, compiler="eager", fallback=False)
            ok = bool(torch.allclose(f(x), m.lin(x).relu()))
        checks = f._variants[0].checks
        emit({{"ok": ok, "frames": frames(), "loaded": ours(), "stats": tcb.stats().as_dict(),
               "full_loaded": checks._full is not None, "meta_parsed": checks._meta is not None}})
        """),
        env={"TCB_PROFILE": "1"},
    )
    return cold, warm


def test_import_with_dynamo_loaded_does_not_import_capture(runs):
    cold, _ = runs
    assert "torchair_cached_backend.registry" in cold["after_import"]
    assert not set(CAPTURE_MODULES) & set(cold["after_import"]), cold["after_import"]


def test_capture_installed_when_the_backend_is_used(runs):
    # torch.compile(backend="npu_cached") resolves the name: the capture listens before the
    # first frame, so a root frame with no graph of its own (the print) is recorded too
    cold, warm = runs
    assert "torchair_cached_backend.bypass.capture" in cold["after_compile"]
    assert cold["ok"]
    assert warm["ok"] and warm["frames"] == 0 and warm["stats"]["bypass_loads"] >= 1, warm


def test_warm_load_does_not_import_capture(runs):
    _, warm = runs
    assert not {"torchair_cached_backend.bypass.capture", "torchair_cached_backend.bypass.guard_capture"} & set(
        warm["loaded"]
    ), warm["loaded"]


def test_full_check_and_explanations_not_loaded_on_the_warm_path(runs):
    # guards="call"'s full check and the guards' explanations are read only when used
    _, warm = runs
    assert warm["full_loaded"] is False and warm["meta_parsed"] is False, warm


def test_profile_prints_the_breakdown(runs):
    _, warm = runs
    lines = [ln for ln in warm["_stderr"].splitlines() if ln.startswith("tcb profile:")]
    assert len(lines) == 1, warm["_stderr"][-3000:]
    line = lines[0]
    assert "PrintsFirst.forward" in line
    for phase in ("read", "verify", "decode", "checks", "guards", "graphs", "first call"):
        assert f"{phase} " in line, line


def test_no_profile_line_without_the_variable(run, tmp_path):
    out = run(
        f"""
        import sys, torch
        import torchair_cached_backend as tcb
        f = tcb.load(lambda x: x + 1, {str(tmp_path)!r}, compiler="eager")
        emit({{"profiling": "torchair_cached_backend.profiling" in sys.modules}})
        """
    )
    assert not out["profiling"]
    assert "tcb profile:" not in out["_stderr"]
