"""Parity with torchair's grad-mode semantics: ``cache_compile`` calls run under ``torch.no_grad()``.

torchair's ``cache_compile`` runs every call of the compiling function under ``torch.no_grad()``
(``ModelCacheSaver.__call__``), and a warm process runs the saved GE kernel, whose outputs have
no autograd history. So with torchair:

* a module that calls ``self.cached(t1, t2)`` without ``no_grad`` (the reference's own usage),
  even with parameters that require grad, is compiled once, cached, and served warm;
* every output has ``requires_grad=False``;
* a caller that needs gradients through the cached function gets none: ``backward()`` raises
  ``RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn`` and
  the parameters' ``.grad`` stays ``None``. Nothing warns.

Ours must behave the same, plus explain (a warning or log line naming ``no_grad``) when a caller's
inputs require grad. Both sides run the reference example exactly as written
(``reference_example.REFERENCE_EXAMPLE``; ours through ``patch_torchair()``, so the same source
text calls ``torchair.inference.cache_compile``), plus a variant with a parameter that requires
grad. Cold, then warm, in fresh processes; the warm torchair process must not compile
(``ModelCacheSaver`` raises), and ours must replay (bypass, no Dynamo frame).
"""

from __future__ import annotations

import json

import pytest

from tests.torchair.reference_example import CHILD_GLUE, DROP_FAKE_TORCH_NPU, REFERENCE_EXAMPLE
from tests.torchair_harness.run import run_script

pytestmark = pytest.mark.torchair

TIMEOUT = 300

RUN = """
import warnings
side, phase = {side!r}, {phase!r}
if side == "ours":
    tcb.patch_torchair()
if phase == "warm":
    ModelCacheSaver.__call__ = torchair_compiled  # a warm process of either side must not compile with torchair's saver


class ParamModel(Model):
    \"\"\"The example with a parameter that requires grad.\"\"\"

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))

    def inner_forward(self, t1, t2):
        return torch.ops.aten.add(t1, t2) * self.weight


facts = {{"grad_enabled": torch.is_grad_enabled()}}
model, pmodel = Model(), ParamModel()
out = model(torch.ones(2, 3), torch.ones(2, 3))          # as the reference uses it: no no_grad
pout = pmodel(torch.ones(2, 3), torch.ones(2, 3))
facts["example"] = {{"shape": list(out.shape), "requires_grad": out.requires_grad}}
facts["param"] = {{"shape": list(pout.shape), "requires_grad": pout.requires_grad,
                   "param_requires_grad": pmodel.weight.requires_grad}}
facts["types"] = sorted({{type(model.cached).__name__, type(pmodel.cached).__name__}})
facts["round_trip_stats"], facts["round_trip_frames"] = stats(), frames()
facts["grad_enabled_after"] = torch.is_grad_enabled()

if phase == "warm":  # a caller that needs gradients through the cached function
    logs_before = len(LOGS)
    t1 = torch.ones(2, 3, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gout = pmodel(t1, torch.ones(2, 3))
    try:
        gout.sum().backward()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    facts["grad_caller"] = {{
        "requires_grad": gout.requires_grad, "backward_error": error,
        "weight_grad": None if pmodel.weight.grad is None else pmodel.weight.grad.tolist(),
        "input_grad": None if t1.grad is None else t1.grad.tolist(),
        "explained": [str(w.message) for w in caught] + LOGS[logs_before:],
    }}
result(**facts)
"""


def _run(side: str, phase: str, cwd: str) -> dict:
    proc = run_script(
        REFERENCE_EXAMPLE + DROP_FAKE_TORCH_NPU + CHILD_GLUE + RUN.format(side=side, phase=phase),
        timeout=TIMEOUT,
        shim=True,
        fake_torch_npu=True,
        cwd=cwd,
        env={"TORCHAIR_CACHE_HOME": None},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON result line:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = {}
    for side in ("torchair", "ours"):
        cwd = str(tmp_path_factory.mktemp(f"grad_{side}"))
        out[side] = {phase: _run(side, phase, cwd) for phase in ("cold", "warm")}
    return out


@pytest.mark.parametrize("side", ["torchair", "ours"])
def test_reference_usage_without_no_grad_round_trips(runs, side: str) -> None:
    """The example exactly as written, and its variant with a parameter requiring grad, called
    without no_grad: cached cold, served warm, outputs without autograd history."""
    for phase in ("cold", "warm"):
        r = runs[side][phase]
        assert r["grad_enabled"] is True and r["grad_enabled_after"] is True, (phase, r)
        assert r["example"] == {"shape": [2, 3], "requires_grad": False}, (phase, r["example"])
        assert r["param"] == {"shape": [2, 3], "requires_grad": False, "param_requires_grad": True}, (phase, r)
    expected_type = "CacheCompiledFunction" if side == "ours" else "LazyCompiledModel"
    assert runs[side]["cold"]["types"] == [expected_type]
    if side == "ours":
        cold, warm = runs["ours"]["cold"], runs["ours"]["warm"]
        assert cold["round_trip_stats"]["misses"] == 2, cold["logs"]  # cached, not "compiled uncached"
        assert cold["round_trip_stats"]["uncached"] == 0, cold["logs"]
        s = warm["round_trip_stats"]
        assert (s["bypass_loads"], s["misses"], s["uncached"], s["fallbacks"]) == (2, 0, 0, 0), warm["logs"]
        assert warm["round_trip_frames"] == 0, f"the warm process traced with Dynamo: {warm['logs']}"


def test_caller_needing_gradients_gets_torchair_behaviour_and_an_explanation(runs) -> None:
    theirs, ours = runs["torchair"]["warm"]["grad_caller"], runs["ours"]["warm"]["grad_caller"]
    # torchair: no autograd history, backward fails, no gradient anywhere, nothing said
    assert theirs["requires_grad"] is False
    assert theirs["backward_error"] and "does not require grad" in theirs["backward_error"]
    assert theirs["weight_grad"] is None and theirs["input_grad"] is None
    # ours: the same behaviour ...
    assert ours["requires_grad"] is False
    assert ours["backward_error"] and "does not require grad" in ours["backward_error"]
    assert ours["weight_grad"] is None and ours["input_grad"] is None
    # ... and a clear explanation instead of silence
    assert any("no_grad" in line for line in ours["explained"]), ours["explained"]
