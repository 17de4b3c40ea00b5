"""Prebuild for images and fleets: fill a cache for the batch sizes a server will see,
pack it, unpack it elsewhere, and serve every size warm with no compile."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

from subprocess_helpers import REPO

from torchair_cached_backend.bundle import unpack
from torchair_cached_backend.progress import Progress

FLEET_MODEL = textwrap.dedent(
    """
    import torch

    class Server(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.proj = torch.nn.Linear(8, 4)

        def forward(self, x):
            return torch.relu(self.proj(x)) * 2

    BATCHES = (1, 2, 4)

    def build():
        return Server().eval(), [torch.randn(b, 8) for b in BATCHES]
    """
)


def test_prebuild_pack_unpack_serves_every_batch_size_warm(run, tmp_path):
    (tmp_path / "fleet_model.py").write_text(FLEET_MODEL)
    built, bundle, shipped = str(tmp_path / "built"), str(tmp_path / "fleet.tar.gz"), str(tmp_path / "node")
    proc = subprocess.run(
        [sys.executable, "-m", "torchair_cached_backend", "prebuild", "fleet_model.py:build", built,
         "-o", 'compiler="eager"', "-o", "dynamic=false", "--pack", bundle],
        cwd=tmp_path, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "3 calls, 3 graphs compiled" in proc.stdout and "packed 4 entries" in proc.stdout, proc.stdout
    assert "warning" not in proc.stdout  # the program replays
    for i in (1, 2, 3):
        assert f"prebuild: input {i} of 3" in proc.stderr, proc.stderr  # progress, and...
    assert proc.stderr.count("compiling graph") == 3  # ...each cold compile logged
    assert unpack(bundle, shipped)["published"] == 4  # a static graph per batch size, one program with three variants
    warm = run(
        f"""
        import sys, torch
        sys.path.insert(0, {str(tmp_path)!r})
        import torchair_cached_backend as tcb
        from child_helpers import same, stats
        from fleet_model import build
        model, inputs = build()
        served = tcb.load(model, {shipped!r}, compiler="eager", fallback=False)
        with torch.no_grad():
            ok = [same(served(x), model(x)) for x in inputs]
        emit({{"ok": ok, "stats": stats(), "dynamo": "torch._dynamo" in sys.modules}})
        """
    )
    assert warm["ok"] == [True, True, True], warm
    s = warm["stats"]
    assert (s["bypass_loads"], s["misses"], s["fallbacks"]) == (1, 0, 0), s
    assert not warm["dynamo"]


def test_progress_bar_and_lines():
    stream = io.StringIO()
    bar = Progress(3, "prebuild: input", stream=stream, bar=True)
    for i in range(3):
        bar.step(f"{i} graph(s) compiled")
    bar.close()
    text = stream.getvalue()
    assert "3/3" in text or "3 of 3" in text, text
    quiet = io.StringIO()
    lines = Progress(2, "prebuild: input", stream=quiet, bar=False)
    lines.step()
    assert quiet.getvalue() == "" and lines.done == 1  # not a terminal: log lines only
