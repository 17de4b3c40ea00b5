"""``torch.compile(model, backend="npu_cached", fullgraph=True)`` raises at a graph break, cache or not.

A program cached from a forward with a graph break (compiled without ``fullgraph``) was replayed on
the backend route under ``fullgraph=True`` too: the right outputs, but the break the user asked to
be told about went unreported (plain ``torch.compile(fullgraph=True)`` raises). Now such a frame is
traced by Dynamo, which raises; without ``fullgraph`` the same cache replays. Cold and warm are
fresh processes.
"""

from __future__ import annotations

import os
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import os
    import torch
    from child_helpers import frames, stats

    ROOT, PHASE, FULLGRAPH = os.environ["ROOT"], os.environ["PHASE"], os.environ.get("FULLGRAPH") == "1"

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.a(x).relu()
            torch._dynamo.graph_break()
            return self.b(y)

    torch.manual_seed(0)
    m, x = M(), torch.randn(2, 4)
    out = {}
    for name, backend in (("npu_cached", None), ("plain", "eager")):
        if name == "plain" and PHASE == "cold":
            continue
        torch._dynamo.reset()
        options = {"cache_dir": ROOT, "compiler": "eager"}
        f = (torch.compile(m, backend="npu_cached", options=options, fullgraph=FULLGRAPH) if backend is None
             else torch.compile(m, backend=backend, fullgraph=FULLGRAPH))
        entry = out[name] = {"error": None}
        try:
            entry["diff"] = (f(x) - m(x)).abs().max().item()
        except Exception as exc:
            entry["error"] = type(exc).__name__
        entry["frames"] = frames()
    out["stats"] = stats()
    emit(out)
    """
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from subprocess_helpers import run_python

    root = str(tmp_path_factory.mktemp("fullgraph") / "cache")
    cold = run_python(CHILD, env={"ROOT": root, "PHASE": "cold"})
    assert cold["npu_cached"]["error"] is None and cold["npu_cached"]["diff"] == 0, cold
    return root


def _warm(root: str, fullgraph: bool, tmp_path) -> dict:
    import shutil

    from subprocess_helpers import run_python

    copy = str(tmp_path / "warm")
    shutil.copytree(root, copy)
    return run_python(CHILD, env={"ROOT": copy, "PHASE": "warm", "FULLGRAPH": "1" if fullgraph else "0"})


def test_without_fullgraph_the_cached_program_with_its_break_replays(cache, tmp_path):
    warm = _warm(cache, False, tmp_path)
    assert warm["npu_cached"] == {"error": None, "diff": 0.0, "frames": 0}, warm


def test_fullgraph_raises_at_the_cached_break_as_plain_torch_compile_does(cache, tmp_path):
    warm = _warm(cache, True, tmp_path)
    assert warm["plain"]["error"] is not None, warm  # what torch.compile(fullgraph=True) does here
    assert warm["npu_cached"]["error"] == warm["plain"]["error"], warm  # was None: replayed, break unreported
    assert warm["stats"]["fallbacks"] >= 1, warm
    assert os.path.isdir(cache)
