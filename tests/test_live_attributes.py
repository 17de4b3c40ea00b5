"""A graph attribute that is the process's own tensor is never served from a stored copy.

Dynamo installs a tensor it reads by identity as a graph attribute instead of an input: an
optimizer's parameters (``opt.step`` compiled, or a hand-written update reading
``opt.param_groups``), a tensor marked with ``torch._dynamo.mark_static_address``. The eager inner
compiler stored every attribute in ``constants.pt``, so a warm process's graph hit updated stored
copies in place: the model's parameters never moved (max difference 0.58 after three SGD steps),
silently; a forward that reads its optimizer (``self.opt.param_groups[0]["lr"]``) returned outputs
with no gradient in a warm process (training silently stopped). Such graphs are now compiled, not
cached (as the Inductor and torchair compilers already refuse them), on both routes; the cold and
warm runs are fresh processes.
"""

from __future__ import annotations

import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import copy
    import os
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import stats

    ROOT, PHASE, ROUTE, CASE = os.environ["ROOT"], os.environ["PHASE"], os.environ.get("ROUTE"), os.environ["CASE"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    STATIC = torch.zeros(4)
    torch._dynamo.mark_static_address(STATIC, guard=True)
    twin_static = torch.zeros(4)

    def hand_update(m, o):  # reads the optimizer: Dynamo installs its parameters as graph attributes
        with torch.no_grad():
            group = o.param_groups[0]
            for p in m.parameters():
                p.add_(p.grad, alpha=-group["lr"])

    def accumulate(x):  # a static-address global, changed in place
        STATIC.add_(x)
        return STATIC * 2

    def compiled(fn):
        if PHASE == "cold" or ROUTE == "backend":
            return torch.compile(fn, backend="npu_cached", options={"cache_dir": ROOT, "compiler": "eager"})
        return tcb.load(fn, ROOT, compiler="eager", fallback=True)

    class ScaledByLr(torch.nn.Module):  # a forward that reads its optimizer (a learning-rate-aware loss scale)
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)
            self.opt = torch.optim.SGD(self.lin.parameters(), lr=0.5)

        def forward(self, x):
            group = self.opt.param_groups[0]  # the group as a value: Dynamo installs its parameters
            return self.lin(x) * group["lr"]

    diffs = []
    if CASE == "reads_optimizer":
        scaled = ScaledByLr()
        twin_scaled = copy.deepcopy(scaled)
        f = compiled(scaled)
        for it in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(it))
            got, want = f(x), twin_scaled(x)
            if not got.requires_grad:  # the graph held detached copies of the parameters: no gradient at all
                diffs.append(float("inf"))
                continue
            got.sum().backward()
            want.sum().backward()
            pairs = zip(scaled.parameters(), twin_scaled.parameters())
            diffs.append(max([(got - want).abs().max().item()] + [(p.grad - q.grad).abs().max().item() for p, q in pairs]))
    elif CASE == "static":
        f = compiled(accumulate)
        for it in range(3):
            x = torch.full((4,), float(it + 1))
            got = f(x)
            twin_static.add_(x)
            diffs.append(max((got - twin_static * 2).abs().max().item(), (STATIC - twin_static).abs().max().item()))
    else:
        f = compiled(opt.step if CASE == "opt_step" else hand_update)
        for it in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(it))
            model(x).pow(2).sum().backward()
            twin(x).pow(2).sum().backward()
            f() if CASE == "opt_step" else f(model, opt)
            twin_opt.step()
            opt.zero_grad()
            twin_opt.zero_grad()
            diffs.append(max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin.parameters())))
    emit({"diffs": diffs, "stats": stats()})
    """
)

CASES = ["hand_update", "opt_step", "static", "reads_optimizer"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from subprocess_helpers import cold_then_warm_routes

    cold, warm = {}, {}
    for case in CASES:  # one cold cache per case; each route warms on its own copy of it
        cold[case], warm[case] = cold_then_warm_routes(CHILD, tmp_path_factory.mktemp(f"live_{case}"), {"CASE": case})
    return cold, warm


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("route", ["load", "backend"])
def test_a_tensor_dynamo_reads_by_identity_is_the_live_one_after_a_warm_start(runs, route, case):
    cold, warm = runs
    assert max(cold[case]["diffs"]) < 1e-6, cold[case]
    entry = warm[case][route]
    # before: the warm graph hit changed stored copies (0.58 after the first SGD step), the model never moved
    assert max(entry["diffs"]) < 1e-6, entry
    # compiled, not cached: said once in the stats, never a hit on a stored graph
    assert entry["stats"]["hits"] == 0, entry
    assert any("by identity" in reason for reason in entry["stats"]["uncached_reasons"]), entry
