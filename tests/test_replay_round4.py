"""The fourth review's never-replayed frames and crashing warm starts, cold in one fresh
process and warm in another (``eager`` inner compiler: these are about what is replayed).

* A process subgroup read in forward (``dist.get_rank(self.tp_group)``, ``group.size()``):
  Dynamo guards the group's type only and folds its rank and size into the graph, so the
  frame was refused at capture (never replayed). Now the group's state is checked: the same
  tensor-parallel layout replays, another one (same world rank, TP size 2 -> 4) is rebuilt.
* A module whose ``forward`` is set on the instance (``m.forward = types.MethodType(...)``,
  as wrappers and adapters do): ``nn.Module.__call__`` runs it, ``load()`` looked for the
  class's forward (crash: "missing the required forward"; or, with a class forward too,
  the class's answer instead of the instance's).
"""

from __future__ import annotations

import textwrap

GROUPS = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, stats

    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    tp = dist.new_group([0, 1] if os.environ["TP"] == "2" else [0, 1, 2, 3])

    class Sharded(torch.nn.Module):
        def __init__(self, group):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)
            self.tp_group = group

        def forward(self, x):
            return self.lin(x) * (dist.get_rank(self.tp_group) + 1.0) + self.tp_group.size()

    m = Sharded(tp).eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        if os.environ["PHASE"] == "cold":
            f = torch.compile(m, backend="npu_cached", options={"cache_dir": os.environ["ROOT"], "compiler": "eager"})
        else:
            f = tcb.load(m, os.environ["ROOT"], compiler="eager")
        ok = bool(torch.allclose(f(x), m(x)))
    emit({"ok": ok, "frames": frames(), "stats": stats(), "logs": LOGS[-4:]})
    """
)


def test_a_process_subgroup_replays_and_another_layout_is_rebuilt(run, tmp_path):
    env = {"ROOT": str(tmp_path)}
    cold = run(GROUPS, env=dict(env, PHASE="cold", TP="2"))
    assert cold["ok"] and not any("not be replayed" in line for line in cold["logs"]), cold
    same = run(GROUPS, env=dict(env, PHASE="warm", TP="2"))
    assert same["ok"] and same["frames"] == 0 and same["stats"]["bypass_loads"] == 1, same
    assert same["stats"]["fallbacks"] == 0, same
    wider = run(GROUPS, env=dict(env, PHASE="warm", TP="4"))  # same world rank, TP size 4
    assert wider["ok"], f"the TP-size-2 variant served a TP-size-4 process: {wider['logs']}"
    assert wider["stats"]["fallback_reasons"] == {"guards failed at load": 1}, wider["stats"]
    assert any("process group self.tp_group" in line for line in wider["logs"]), wider["logs"]
