"""Issue 17, the routes the invalidation matrix does not take: a warm ``torch.compile(backend=
"npu_cached")`` (graph-level hits) after an edit the graph only names, and two ranks sharing one
cache dir. Cold in one fresh process, warm in another; the matrix (tests/test_guards_matrix.py,
cases ``allow_in_graph_edit``, ``custom_op_edit``, ``dist_rank``...) covers the bypass routes."""

from __future__ import annotations

import textwrap

import pytest

#: an allow_in_graph helper and a torch.library op with a Python CompositeImplicitAutograd kernel,
#: both called by name from the graph; FACTOR is what the "edit" changes
EDITED = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch._dynamo
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, stats

    FACTOR = float(os.environ["FACTOR"])
    LIB = torch.library.Library("tcbround3", "DEF")
    LIB.define("scaled_cos(Tensor x) -> Tensor")

    def scaled_cos_impl(x):
        return torch.cos(x) * FACTOR

    LIB.impl("scaled_cos", scaled_cos_impl, "CompositeImplicitAutograd")

    @torch._dynamo.allow_in_graph
    def helper(h):
        return torch.sin(h) * FACTOR

    class Net(torch.nn.Module):
        def __init__(self, use_op):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)
            self.use_op = use_op

        def forward(self, x):
            h = self.lin(x)
            return (torch.ops.tcbround3.scaled_cos(h) if self.use_op else helper(h)) + 1.0

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = {}
    with torch.no_grad():
        for use_op in (False, True):
            m = Net(use_op).eval()
            f = torch.compile(m, backend="npu_cached", options={"cache_dir": os.environ["ROOT"], "compiler": "inductor"})
            out["op" if use_op else "allow_in_graph"] = bool(torch.allclose(f(x), m(x), atol=1e-5))
    emit({"out": out, "stats": stats(), "frames": frames()})
    """
)


@pytest.mark.slow
def test_graph_call_targets_count_by_code_on_the_backend_route(run, tmp_path):
    """Dynamo re-traces the edited program to the same graph (it names the helper / the op):
    the graph key must differ, or the warm process loads the stale Inductor artifact."""
    env = {"ROOT": str(tmp_path / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    cold = run(EDITED, env=dict(env, FACTOR="2.0"))
    assert all(cold["out"].values()), cold["out"]
    assert cold["stats"]["misses"] == 2, cold["stats"]
    same = run(EDITED, env=dict(env, FACTOR="2.0"))
    # unchanged: replayed (the backend route installs the program: no frame traced, no graph compiled)
    assert all(same["out"].values()) and same["frames"] == 0 and same["stats"]["misses"] == 0, same
    edited = run(EDITED, env=dict(env, FACTOR="3.0", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor_warm")))
    assert all(edited["out"].values()), f"a warm start served the stale graph: {edited['out']}"
    assert edited["stats"]["misses"] == 2, edited["stats"]


RANKS = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, stats

    RANK, ROUTE, ROOT = int(os.environ["RANK"]), os.environ["ROUTE"], os.environ["ROOT"]
    dist.init_process_group("fake", rank=RANK, world_size=2, store=FakeStore())

    class Sharded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) * (dist.get_rank() + 1.0) + dist.get_world_size()

    m = Sharded().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        if ROUTE == "compile":
            f = torch.compile(m, backend="npu_cached", options={"cache_dir": ROOT, "compiler": "eager"})
        else:
            f = tcb.load(m, ROOT, compiler="eager")
        ok = bool(torch.allclose(f(x), m(x)))
    emit({"ok": ok, "frames": frames(), "stats": stats(), "logs": LOGS})
    """
)


def test_two_ranks_sharing_one_cache_dir_get_their_own_variant(run, tmp_path):
    """Dynamo folds ``dist.get_rank()`` into the graph without a guard: a program variant
    captured by rank 1 must not be replayed by rank 0 (and each rank then replays its own)."""
    env = {"ROOT": str(tmp_path)}
    assert run(RANKS, env=dict(env, RANK="1", ROUTE="compile"))["ok"]
    graph_level = run(RANKS, env=dict(env, RANK="0", ROUTE="compile"))
    assert graph_level["ok"], "rank 0 got rank 1's graph through torch.compile"
    warm0 = run(RANKS, env=dict(env, RANK="0", ROUTE="load"))
    assert warm0["ok"], f"rank 0 replayed rank 1's variant: {warm0['logs'][-5:]}"
    assert warm0["frames"] == 0 and warm0["stats"]["bypass_loads"] == 1, warm0["stats"]  # rank 0's own variant
    warm1 = run(RANKS, env=dict(env, RANK="1", ROUTE="load"))
    assert warm1["ok"] and warm1["frames"] == 0 and warm1["stats"]["bypass_loads"] == 1, warm1["stats"]


HASHED = textwrap.dedent(
    """
    import os
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, stats

    class Hashed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) * float(hash("npu_cached") % 5 + 1)

    m = Hashed().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        if os.environ["PHASE"] == "cold":
            f = torch.compile(m, backend="npu_cached", options={"cache_dir": os.environ["ROOT"], "compiler": "eager"})
        else:
            f = tcb.load(m, os.environ["ROOT"], compiler="eager")
        ok = bool(torch.allclose(f(x), m(x)))
    emit({"ok": ok, "frames": frames(), "stats": stats(), "logs": LOGS})
    """
)


def test_hash_of_a_str_is_never_replayed_and_the_fallback_says_why(run, tmp_path):
    """``hash(str)`` is randomized per process and Dynamo folds it in: the frame is refused at
    capture, and every warm start compiles it as a counted fallback naming the reason; with
    ``PYTHONHASHSEED`` fixed, the seed is checked and the frame replays."""
    env = {"ROOT": str(tmp_path / "random"), "PYTHONHASHSEED": "random"}
    assert run(HASHED, env=dict(env, PHASE="cold"))["ok"]
    warm = run(HASHED, env=dict(env, PHASE="warm"))
    assert warm["ok"] and warm["frames"] == 1, warm
    assert warm["stats"]["fallback_reasons"] == {"not replayable": 1}, warm["stats"]
    assert any("hash()" in line and "PYTHONHASHSEED" in line for line in warm["logs"]), warm["logs"]
    fixed = {"ROOT": str(tmp_path / "fixed"), "PYTHONHASHSEED": "7"}
    assert run(HASHED, env=dict(fixed, PHASE="cold"))["ok"]
    replayed = run(HASHED, env=dict(fixed, PHASE="warm"))
    assert replayed["ok"] and replayed["frames"] == 0 and replayed["stats"]["bypass_loads"] == 1, replayed["stats"]


SCALE = 2.0


def scaled_helper(h):
    return h * SCALE


def test_call_target_factors_describe_helpers_by_code_and_globals(monkeypatch):
    """In-process: a graph that calls a helper by reference keys it by its code and the
    globals it reads, and ``stale_call_targets`` finds an edit in another process's terms."""
    import sys

    import torch
    import torch.fx

    from torchair_cached_backend import key as keys

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(scaled_helper, (x,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    targets = keys.call_target_factors(gm)
    name = f"{__name__}.scaled_helper"
    assert list(targets) == [name] and targets[name]["kind"] == "function", targets
    before = keys.digest(keys.graph_factors(gm))
    assert keys.stale_call_targets(targets) == []
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
    assert keys.digest(keys.graph_factors(gm)) != before
    assert keys.stale_call_targets(targets) == [f"{name} (called by the graph) was edited"]
