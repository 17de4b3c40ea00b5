"""The fifth review's stale replays: state the frame itself changes. Dynamo specializes on a global
or a container's length the frame then changes (``global CALLS; CALLS += 1``, ``self.log.append``,
a global of another module a helper rebinds),
so each call is a new variant. A warm ``load()`` filed those guards as load-time ones: it replayed
the first call's variant at every later call (outputs [1, 1, 1], the counter stuck at 1), silently
wrong. A guard on anything the frame changes in place or assigns is now checked per call: the
global's own source (Dynamo files a root frame's global store under it), a module's global under
every name the frame's globals bind the module to, and the containers Dynamo
tracked as changed (``bypass/trace_mutations``: kept past Dynamo's cleanup for the capture).

Two more the same review found: a method a user set on ``torch.Tensor`` that the graph calls by name
(its compiled training graph held the cold body), and arguments sharing memory (a view of an argument
the frame changes in place) served a graph compiled for distinct ones.
"""

from __future__ import annotations

import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import os
    import sys
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import frames, stats

    ROOT, PHASE, ROUTE = os.environ["ROOT"], os.environ["PHASE"], os.environ.get("ROUTE")
    with open(os.path.join(ROOT, "counter_module.py"), "w") as f:  # a global of another module, which
        f.write("CALLS = 0\\ndef bump(x):\\n    global CALLS\\n    CALLS += 1\\n    return x + CALLS\\n")
    sys.path.insert(0, ROOT)
    import counter_module  # Dynamo reads under its own alias (G['__import_counter_module'])

    CALLS = 0
    HISTORY = []

    class GlobalCounter(torch.nn.Module):
        def forward(self, x):
            global CALLS
            CALLS += 1
            return x + CALLS

    class ListAttr(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.log = []

        def forward(self, x):
            self.log.append(1)
            return x + len(self.log)

    class DictAttr(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = {}

        def forward(self, x):
            self.seen[len(self.seen)] = True
            return x + len(self.seen)

    class GlobalList(torch.nn.Module):
        def forward(self, x):
            HISTORY.append(1)
            return x + len(HISTORY)

    class OtherModuleGlobal(torch.nn.Module):
        def forward(self, x):
            return counter_module.bump(x)

    def counting():
        count = 0

        def step(x):
            nonlocal count
            count += 1
            return x + count

        return step

    class ClosureCell(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.step = counting()

        def forward(self, x):
            return self.step(x)

    def state(m):
        return {GlobalCounter: lambda: CALLS, ListAttr: lambda: len(m.log), DictAttr: lambda: len(m.seen),
                GlobalList: lambda: len(HISTORY), OtherModuleGlobal: lambda: counter_module.CALLS,
                ClosureCell: lambda: m.step.__closure__[0].cell_contents}[type(m)]()

    out = {}
    x = torch.zeros(2)
    for cls in (GlobalCounter, ListAttr, DictAttr, GlobalList, OtherModuleGlobal, ClosureCell):
        tcb.reset_stats()
        f0 = frames()
        m = cls()
        d = os.path.join(ROOT, cls.__name__)
        if PHASE == "cold" or ROUTE == "backend":
            f = torch.compile(m, backend="npu_cached", options={"cache_dir": d, "compiler": "eager"})
        else:
            f = tcb.load(m, d, compiler="eager", fallback=True)
        got = [f(x)[0].item() for _ in range(3)]
        out[cls.__name__] = {"got": got, "state": state(m), "stats": stats(), "frames": frames() - f0}
    emit(out)
    """
)
CASES = ["GlobalCounter", "ListAttr", "DictAttr", "GlobalList", "OtherModuleGlobal", "ClosureCell"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from subprocess_helpers import run_python

    root = str(tmp_path_factory.mktemp("round5_stale"))
    cold = run_python(CHILD, env={"ROOT": root, "PHASE": "cold"})
    warm = {route: run_python(CHILD, env={"ROOT": root, "PHASE": "warm", "ROUTE": route}) for route in ("load", "backend")}
    return cold, warm


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("route", ["load", "backend"])
def test_state_the_frame_changes_is_checked_on_every_call(runs, route, case):
    cold, warm = runs
    assert cold[case]["got"] == [1.0, 2.0, 3.0] and cold[case]["state"] == 3, cold[case]
    entry = warm[route][case]
    assert entry["got"] == [1.0, 2.0, 3.0] and entry["state"] == 3, entry
    # replayed, not traced again: the cold process cached a variant for each call
    assert entry["frames"] == 0 and entry["stats"]["bypass_loads"] >= 1, entry


TENSOR_METHOD = textwrap.dedent(
    """
    import os
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import stats

    def by_two(t):
        return t * 2

    def by_three(t):
        return t * 3

    # a method a user sets on torch.Tensor, chosen at import (by an environment variable, a hardware probe)
    torch.Tensor.my_scale = by_two if os.environ["PHASE"] == "cold" else by_three

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def forward(self, x):
            return (x * self.w).my_scale()  # called on a tensor the frame computed: no guard names it

    ROOT, PHASE, ROUTE = os.environ["ROOT"], os.environ["PHASE"], os.environ.get("ROUTE")
    m = M()
    with torch.set_grad_enabled(os.environ["GRAD"] == "True"):
        if PHASE == "cold" or ROUTE == "backend":
            f = torch.compile(m, backend="npu_cached", options={"cache_dir": ROOT, "compiler": "eager"})
        else:
            f = tcb.load(m, ROOT, compiler="eager", fallback=True)
        got, want = f(torch.ones(2)), m(torch.ones(2))
    emit({"got": got.tolist(), "want": want.tolist(), "stats": stats()})
    """
)


@pytest.fixture(scope="module")
def tensor_method_runs(tmp_path_factory):
    from subprocess_helpers import cold_then_warm_routes

    cold, warm = {}, {}
    for grad in ("True", "False"):  # each in processes of its own; each route on its own copy of the cold cache
        base = tmp_path_factory.mktemp(f"round5_tensor_method_{grad}")
        cold[grad], warm[grad] = cold_then_warm_routes(TENSOR_METHOD, base, {"GRAD": grad})
    return cold, warm


@pytest.mark.parametrize("grad", ["True", "False"])
@pytest.mark.parametrize("route", ["load", "backend"])
def test_a_method_set_on_torch_tensor_is_the_one_the_graph_was_traced_with(tensor_method_runs, route, grad):
    # the graph names the method only (a call_method node); its compiled form held the cold process's
    # function: the warm start replayed x * 2 where eager computes x * 3 (and a recompile hit the same
    # graph key). Now the graph's key holds what torch.Tensor resolves the name to (a user's function
    # by its content), re-checked before a stored graph runs: the changed one is compiled again
    cold, warm = tensor_method_runs
    assert cold[grad]["got"] == cold[grad]["want"] == [2.0, 2.0], cold
    entry = warm[grad][route]
    assert entry["got"] == entry["want"] == [3.0, 3.0], entry
    if grad == "True":  # the training graph AOTAutograd traced holds x * 2: rebuilt, and counted
        assert entry["stats"].get("fallbacks", 0) >= 1, entry
    # (under no_grad the eager inner compiler's graph calls the method by name: the live one runs)


SHARING = textwrap.dedent(
    """
    import os
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import stats

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, y):
            x.mul_(2)  # changes y too when y is a view of x
            return self.lin(y) + 1

    def inputs(shared):
        x = torch.arange(24.0).reshape(3, 8) / 10
        return (x, x[1]) if shared else (x, (torch.arange(24.0).reshape(3, 8) / 10)[1])

    ROOT, PHASE, ROUTE = os.environ["ROOT"], os.environ["PHASE"], os.environ.get("ROUTE")
    m = M()
    if PHASE == "cold" or ROUTE == "backend":
        f = torch.compile(m, backend="npu_cached", options={"cache_dir": ROOT, "compiler": "eager"})
    else:
        f = tcb.load(m, ROOT, compiler="eager", fallback=True)
    shared = PHASE == "warm"
    got, want = f(*inputs(shared)), m(*inputs(shared))
    emit({"ok": bool(torch.allclose(got, want)), "stats": stats()})
    """
)


@pytest.mark.parametrize("route", ["load", "backend"])
def test_arguments_sharing_memory_are_not_served_a_graph_compiled_for_distinct_ones(tmp_path, route):
    # cold: x and y distinct; warm: y a view of x, which the frame changes in place. The variant's checks
    # held only that they are distinct objects, and the graph key their metadata alone: the warm call
    # replayed (and a recompile reloaded) the graph that reads y before x.mul_(2). Now the per-call
    # checks and the graph key hold which arguments share memory
    from subprocess_helpers import run_python

    root = str(tmp_path / "cache")
    cold = run_python(SHARING, env={"ROOT": root, "PHASE": "cold"})
    assert cold["ok"], cold
    warm = run_python(SHARING, env={"ROOT": root, "PHASE": "warm", "ROUTE": route})
    assert warm["ok"], warm
    assert warm["stats"].get("fallbacks", 0) >= 1, warm  # compiled for the sharing, and counted


FOLDED = textwrap.dedent(
    """
    import os
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import stats

    ROOT, PHASE, ROUTE = os.environ["ROOT"], os.environ["PHASE"], os.environ.get("ROUTE")
    torch.backends.cuda.matmul.allow_tf32 = PHASE == "warm"  # set at start-up (a launcher's choice)

    class Version(torch.nn.Module):
        def forward(self, x):
            return x + x._version  # the graph calls prims._tensor_version, registered by Dynamo's import

    class Flag(torch.nn.Module):
        def forward(self, x):
            return x * 2 if torch.backends.cuda.matmul.allow_tf32 else x * 3  # folded, unguarded by Dynamo

    out = {}
    for cls in (Version, Flag):
        tcb.reset_stats()
        m, d = cls(), os.path.join(ROOT, cls.__name__)
        if PHASE == "cold" or ROUTE == "backend":
            f = torch.compile(m, backend="npu_cached", options={"cache_dir": d, "compiler": "eager"})
        else:
            f = tcb.load(m, d, compiler="eager", fallback=True)
        try:
            got = f(torch.ones(2)).tolist()
        except Exception as exc:
            got = f"{type(exc).__name__}: {exc}"
        out[cls.__name__] = {"got": got, "want": m(torch.ones(2)).tolist(), "stats": stats()}
    emit(out)
    """
)


@pytest.mark.parametrize("route", ["load", "backend"])
def test_values_dynamo_folds_without_a_guard_of_its_own(tmp_path, route):
    # x._version: the warm replay (Dynamo never imported on load()'s route) crashed: the graph calls
    # prims._tensor_version, an operator torch registers when Dynamo's tensor_version_op is imported.
    # torch.backends.cuda.matmul.allow_tf32 (and its siblings) read in forward: Dynamo folds the value
    # without a guard, and the warm start replayed the cold process's branch. Now a load-time check
    from subprocess_helpers import run_python

    root = str(tmp_path / "cache")
    cold = run_python(FOLDED, env={"ROOT": root, "PHASE": "cold"})
    assert cold["Version"]["got"] == cold["Version"]["want"] and cold["Flag"]["got"] == [3.0, 3.0], cold
    warm = run_python(FOLDED, env={"ROOT": root, "PHASE": "warm", "ROUTE": route})
    assert warm["Version"]["got"] == warm["Version"]["want"], warm["Version"]
    assert warm["Version"]["stats"]["bypass_loads"] == 1, warm["Version"]  # replayed
    assert warm["Flag"]["got"] == warm["Flag"]["want"] == [2.0, 2.0], warm["Flag"]
    assert warm["Flag"]["stats"].get("fallbacks", 0) >= 1, warm["Flag"]
