"""Numbers that differ in every process never reach a cached program (``bypass/trace_ids``).

Dynamo folds ``id(obj)`` of an object it can find again into the graph and guards the
object's identity; a replay in another process finds the same object (a module-level
instance, the receiver), so the check held and the cold process's number was replayed:
``self.lin(x) + id(self) % 1000`` came out silently wrong at every warm start, on both
routes. ``hash()`` of an identity-hashed object is the same number shifted (a string's hash
is the capture's seed check's: ``test_stale_round3``). Now such a value stays Dynamo's
compile-time-only id while our backends trace:
used in arithmetic it is a graph break (the call runs as Python in each process), used
only as a dict key inside one trace it replays as before (``kernels`` does that).
Cold in one process, warm in a fresh one.
"""

from __future__ import annotations

import textwrap

import pytest
from subprocess_helpers import run_python

SCRIPT = textwrap.dedent("""
    import os
    import torch
    import torchair_cached_backend as tcb
    from torch._dynamo.utils import counters

    class ById(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) + id(self) % 1000

    class ByHash(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) + hash(self.lin) % 1000

    class IdKeyed(torch.nn.Module):  # ids compared inside one trace (kernels' routing dict): still replays
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            scales = {id(route): 2.0}
            return self.lin(x) * scales.get(id(route), 1.0)

    def route():  # kernels keys its dict by a function module's id
        pass

    if os.environ.get("PRIOR") == "1":  # Dynamo caches its handler of id() at the first trace that calls it
        torch.compile(ById(), backend="eager")(torch.randn(2, 4))
    torch.manual_seed(0)
    model = {"id": ById, "hash": ByHash, "id_keyed": IdKeyed}[os.environ["CASE"]]()
    x = torch.randn(2, 4)
    root = os.environ["ROOT"]
    with torch.no_grad():
        want = model(x)
        if os.environ["ROUTE"] == "load" and os.environ["PHASE"] == "warm":
            fn = tcb.load(model, root, compiler="eager")
        else:
            fn = torch.compile(model, backend="npu_cached", options={"cache_dir": root, "compiler": "eager"})
        got = fn(x)
    emit({"diff": (got - want).abs().max().item(), "frames": counters["frames"]["total"],
          "stats": tcb.stats().as_dict()})
""")


def _run(case: str, route: str, root: str, phase: str, seed: str, prior: bool = False) -> dict:
    return run_python(SCRIPT, env={"CASE": case, "ROUTE": route, "ROOT": root, "PHASE": phase,
                                   "PYTHONHASHSEED": seed, "PRIOR": "1" if prior else "0"})


@pytest.mark.parametrize("route", ["load", "backend"])
@pytest.mark.parametrize("case", ["id", "hash"])
def test_a_number_of_this_process_is_never_replayed_from_another(tmp_path, case, route):
    # one fixed PYTHONHASHSEED for both: the capture's seed check then lets frames that hash strings
    # replay, and an identity hash must not ride along
    cold = _run(case, route, str(tmp_path), "cold", "7")
    assert cold["diff"] == 0.0, cold
    warm = _run(case, route, str(tmp_path), "warm", "7")  # another process: other ids
    assert warm["diff"] == 0.0, warm  # was 100-900: the cold process's number


@pytest.mark.parametrize("route", ["load", "backend"])
@pytest.mark.parametrize("case", ["id_keyed"])
def test_ids_compared_inside_one_trace_still_replay(tmp_path, case, route):
    cold = _run(case, route, str(tmp_path), "cold", "1")
    assert cold["diff"] == 0.0 and cold["frames"] >= 1, cold
    warm = _run(case, route, str(tmp_path), "warm", "2")
    s = warm["stats"]
    assert warm["diff"] == 0.0 and warm["frames"] == 0 and s["bypass_loads"] == 1 and s["fallbacks"] == 0, warm


def test_an_earlier_trace_of_another_backend_does_not_undo_it(tmp_path):
    # the cold process first traces id() for another backend: Dynamo's cached handler of id() is made then
    cold = _run("id", "backend", str(tmp_path), "cold", "1", prior=True)
    assert cold["diff"] == 0.0, cold
    warm = _run("id", "backend", str(tmp_path), "warm", "2")
    assert warm["diff"] == 0.0, warm
