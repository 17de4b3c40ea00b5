"""Higher-order ops with the eager inner compiler (issue 17): a graph that passes
subgraphs by attribute (``torch.cond``'s branches, ``torch.utils.checkpoint``'s body)
is stored with each subgraph's code and replays warm, as it does with Inductor.

One cold process compiles every case (each with its own cache dir), one fresh warm
process loads them with ``tcb.load``: outputs (and gradients) equal to eager, no
cache miss, no fallback, no Dynamo frame.
"""

from __future__ import annotations

import pytest

CASES = ("cond", "checkpoint", "cond_train", "checkpoint_train")

CHILD = """
import os, traceback
import torch
import torch.nn as nn
import torch.utils.checkpoint
import torchair_cached_backend as tcb
from child_helpers import LOGS, frames, same, stats

class WithCond(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return torch.cond(y.sum() > 0, lambda t: (t * self.lin.weight[0]).sin(), lambda t: t.cos() * 2.0, (y,))

class WithCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def block(self, t):
        return self.lin(t).relu() * 3.0

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False) + 1.0

def inputs():
    torch.manual_seed(1)
    x = torch.randn(2, 4)
    return [x.abs() + 1.0, -x.abs() - 1.0, x]  # the cond takes both branches

phase, root = {phase!r}, {root!r}
results = {{}}
for name in {cases!r}:
    tcb.reset_stats()
    f0, l0 = frames(), len(LOGS)
    entry = {{"error": None}}
    try:
        train = name.endswith("_train")
        m = (WithCond if name.startswith("cond") else WithCheckpoint)()
        d = os.path.join(root, name)
        if phase == "cold":
            f = torch.compile(m, backend="npu_cached", options={{"cache_dir": d, "compiler": "eager"}})
        else:
            f = tcb.load(m, d, compiler="eager")
        ok = []
        for x in inputs():
            if not train:
                with torch.no_grad():
                    ok.append(same(f(x), m(x)))
                continue
            xs = [x.clone().requires_grad_(True) for _ in range(2)]
            got, want = f(xs[0]), m(xs[1])
            g_got = torch.autograd.grad(got.sum(), [xs[0], m.lin.weight])
            g_want = torch.autograd.grad(want.sum(), [xs[1], m.lin.weight])
            ok.append(same(got, want) and got.requires_grad and all(map(same, g_got, g_want)))
        entry["ok"] = ok
    except Exception:
        entry["error"] = traceback.format_exc()[-3000:]
    entry["frames"] = frames() - f0
    entry["stats"] = stats()
    entry["logs"] = LOGS[l0:]
    results[name] = entry
emit(results)
"""


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    from subprocess_helpers import run_python

    root = str(tmp_path_factory.mktemp("eager_hop"))
    return {phase: run_python(CHILD.format(phase=phase, root=root, cases=list(CASES)), timeout=600)
            for phase in ("cold", "warm")}


def _why(entry: dict) -> str:
    logs = "\n  ".join(entry.get("logs") or ["(nothing logged)"])
    return f"\nlogs:\n  {logs}\nstats: {entry.get('stats')}\nerror: {entry.get('error')}"


@pytest.mark.parametrize("name", CASES)
def test_higher_order_op_graphs_replay_with_eager(outcome, name):
    cold, warm = outcome["cold"][name], outcome["warm"][name]
    assert cold["error"] is None, _why(cold)
    assert cold["ok"] == [True, True, True], f"cold output != eager:{_why(cold)}"
    assert not any("will not be replayed" in line or "not cacheable" in line for line in cold["logs"]), _why(cold)
    assert warm["error"] is None, _why(warm)
    assert warm["ok"] == [True, True, True], f"warm output != eager:{_why(warm)}"
    assert warm["frames"] == 0, f"Dynamo compiled {warm['frames']} frame(s) warm:{_why(warm)}"
    s = warm["stats"]
    assert s["bypass_loads"] >= 1 and s["misses"] == 0 and s["fallbacks"] == 0, _why(warm)
