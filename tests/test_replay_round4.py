"""The fourth review's never-replayed frames and crashing warm starts, cold in one fresh
process and warm in another (``eager`` inner compiler: these are about what is replayed).

* A process subgroup or DeviceMesh read in forward (``dist.get_rank(self.tp_group)``,
  ``group.size()``, ``mesh.get_local_rank("tp")``):
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

import pytest

GROUPS = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, stats

    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    TP = int(os.environ["TP"])

    class Sharded(torch.nn.Module):
        def __init__(self, group):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)
            self.tp_group = group

        def forward(self, x):
            return self.lin(x) * (dist.get_rank(self.tp_group) + 1.0) + self.tp_group.size()

    class MeshSharded(torch.nn.Module):
        def __init__(self, mesh):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)
            self.mesh = mesh

        def forward(self, x):
            return self.lin(x) * (self.mesh.get_local_rank("tp") + 1.0) + self.mesh["tp"].size()

    if os.environ["KIND"] == "group":
        m = Sharded(dist.new_group(list(range(TP)))).eval()
    else:
        from torch.distributed.device_mesh import init_device_mesh

        m = MeshSharded(init_device_mesh("cpu", (4 // TP, TP), mesh_dim_names=("dp", "tp"))).eval()
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


@pytest.mark.parametrize("kind", ["group", "mesh"])
def test_a_process_subgroup_replays_and_another_layout_is_rebuilt(run, tmp_path, kind):
    env = {"ROOT": str(tmp_path), "KIND": kind}
    cold = run(GROUPS, env=dict(env, PHASE="cold", TP="2"))
    assert cold["ok"] and not any("not be replayed" in line for line in cold["logs"]), cold
    same = run(GROUPS, env=dict(env, PHASE="warm", TP="2"))
    assert same["ok"] and same["frames"] == 0 and same["stats"]["bypass_loads"] == 1, same
    assert same["stats"]["fallbacks"] == 0, same
    wider = run(GROUPS, env=dict(env, PHASE="warm", TP="4"))  # same world rank, TP size 4
    assert wider["ok"], f"the TP-size-2 variant served a TP-size-4 process: {wider['logs']}"
    assert wider["stats"]["fallback_reasons"] == {"guards failed at load": 1}, wider["stats"]
    what = "process group self.tp_group" if kind == "group" else "device mesh self.mesh"
    assert any(what in line for line in wider["logs"]), wider["logs"]


INSTANCE = textwrap.dedent(
    """
    import functools, os, types
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, stats

    class Adapted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):  # the class's own forward: not what the instance runs
            return self.lin(x)

        def scaled(self, x, k):
            return self.lin(x) * k

    def adapted_forward(self, x):
        return self.scaled(x, 3.0).relu()

    class Bare(torch.nn.Module):  # no forward of its own
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)

        def body(self, x, k):
            return self.lin(x) * k

    def build(kind, d):
        if kind == "method":
            m = Adapted().eval()
            m.forward = types.MethodType(adapted_forward, m)
        elif kind == "compiled":  # the user's own script, cold and warm: a compiled forward set on the instance
            m = Adapted().eval()
            m.forward = torch.compile(m.forward, backend="npu_cached", options={"cache_dir": d, "compiler": "eager"})
        else:
            m = Bare().eval()
            m.forward = functools.partial(m.body, k=2.0)
        hooked = []
        m.register_forward_hook(lambda mod, args, out: hooked.append(1))
        return m, hooked

    root, cold = os.environ["ROOT"], os.environ["PHASE"] == "cold"
    x = torch.randn(4, 8)
    out = {}
    with torch.no_grad():
        for kind in ("method", "partial", "compiled"):
            tcb.reset_stats()
            d = os.path.join(root, kind)
            m, hooked = build(kind, d)
            want = Adapted.forward(m, x) if kind == "compiled" else m(x)
            f0 = frames()
            if cold:
                f = m if kind == "compiled" else torch.compile(m, backend="npu_cached", options={"cache_dir": d, "compiler": "eager"})
            else:
                f = tcb.load(m, d, compiler="eager")
            hooked.clear()
            ok = bool(torch.allclose(f(x), want)) and bool(torch.allclose(f(x), want))
            out[kind] = {"ok": ok, "hooks": len(hooked), "frames": frames() - f0, "stats": stats()}
    emit(out)
    """
)


def test_a_forward_set_on_the_instance_is_what_load_replays(run, tmp_path):
    env = {"ROOT": str(tmp_path)}
    cold = run(INSTANCE, env=dict(env, PHASE="cold"))
    assert all(cold[k]["ok"] and cold[k]["hooks"] == 2 for k in ("method", "partial", "compiled")), cold
    warm = run(INSTANCE, env=dict(env, PHASE="warm"))
    method, partial = warm["method"], warm["partial"]
    assert method["ok"], f"load() served the class's forward, not the instance's: {method}"
    assert method["hooks"] == 2, "the module's hooks run once per call, around the replay"
    assert method["frames"] == 0 and method["stats"]["bypass_loads"] == 1 and method["stats"]["fallbacks"] == 0, method
    # a partial is not a frame of its own: compiled (counted, with its reason), never a crash
    assert partial["ok"] and partial["hooks"] == 2, partial
    assert partial["stats"]["fallback_reasons"] == {"instance forward not replayed": 1}, partial
    # ``m.forward = torch.compile(m.forward)`` (the instance's forward is the class's, compiled): replayed
    compiled = warm["compiled"]
    assert compiled["ok"] and compiled["hooks"] == 2, compiled
    assert compiled["frames"] == 0 and compiled["stats"]["bypass_loads"] == 1 and compiled["stats"]["fallbacks"] == 0, \
        compiled


OWN_CALL = textwrap.dedent(
    """
    import os
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, stats

    class Doubled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x)

        def __call__(self, x):  # what m(x) runs
            return super().__call__(x) * 2

    m = Doubled().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        if os.environ["PHASE"] == "cold":
            f = torch.compile(m, backend="npu_cached", options={"cache_dir": os.environ["ROOT"], "compiler": "eager"})
        elif os.environ["PHASE"] == "optimized":  # load() of what torch.compile returned: the module it wraps
            f = tcb.load(torch.compile(m, backend="eager"), os.environ["ROOT"], compiler="eager")
        else:
            f = tcb.load(m, os.environ["ROOT"], compiler="eager")
        ok = bool(torch.allclose(f(x), m(x)))
    emit({"ok": ok, "frames": frames(), "stats": stats(), "logs": LOGS[-4:]})
    """
)


def test_a_module_class_with_its_own_call_replays_that_call(run, tmp_path):
    """``load(m)`` stands for ``m(x)``: a class that overrides ``__call__`` is replayed through it
    (Dynamo compiled that frame); it served ``forward`` alone (without the ``* 2``)."""
    env = {"ROOT": str(tmp_path)}
    assert run(OWN_CALL, env=dict(env, PHASE="cold"))["ok"]
    warm = run(OWN_CALL, env=dict(env, PHASE="warm"))
    assert warm["ok"], f"load() served forward, not the class's __call__: {warm['logs']}"
    assert warm["frames"] == 0 and warm["stats"]["bypass_loads"] == 1 and warm["stats"]["fallbacks"] == 0, warm
    optimized = run(OWN_CALL, env=dict(env, PHASE="optimized"))  # it crashed: "missing the required forward"
    assert optimized["ok"] and optimized["frames"] == 0 and optimized["stats"]["bypass_loads"] == 1, optimized
