"""Training graphs through the ``torchair`` inner compiler (real torchair on CPU, GE executor shim).

torchair's ``npu_backend`` training route compiles a GE graph for the forward and one for the
backward; neither torchair's ``cache_compile`` nor npugraph_ex caches backward graphs. Ours
stores both (torchair's generated code) in one entry: a fresh process hits it, builds no GE
graph from FX (``get_compiler`` is never called) and runs forward and backward. The shim's GE
returns zeros, so this checks plumbing (shapes, gradients reach every parameter), not numbers.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from tests.torchair_harness.run import run_script

pytestmark = pytest.mark.torchair

RUN = """
import json, sys, logging
import torch, torchair
import torchair_cached_backend as tcb

calls = []
orig_get_compiler = torchair.get_compiler
def counting_get_compiler(*a, **k):
    calls.append(1)
    return orig_get_compiler(*a, **k)
torchair.get_compiler = counting_get_compiler
# CPU stand-in for the NPU generator's philox offset torchair's RNG inputs read (CPU generators have none)
from torchair.ge import _ge_graph
_ge_graph._GraphRngState.consume = lambda self: torch.tensor(self._offset_lists)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
        self.drop = torch.nn.Dropout(0.5 if {dropout!r} else 0.0)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x))))

model = Net()
compiled = torch.compile(model, backend="npu_cached",
                         options={{"compiler": "torchair", "cache_dir": {cache!r}, "ge_cache": {ge_cache!r}}})
out = compiled(torch.ones(3, 4))
out.sum().backward()
s = tcb.stats()
print(json.dumps({{"shape": list(out.shape), "requires_grad": out.requires_grad,
                  "grads": [list(p.grad.shape) for p in model.parameters() if p.grad is not None],
                  "params": len(list(model.parameters())), "hits": s.hits, "misses": s.misses,
                  "uncached": s.uncached, "reasons": s.uncached_reasons, "torchair_compiles": len(calls)}}))
"""


def _run(cache: str, dropout: bool = False, ge_cache: bool = False) -> dict:
    proc = run_script(RUN.format(cache=cache, dropout=dropout, ge_cache=ge_cache), timeout=300, shim=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1])


def test_torchair_training_graph_cached_forward_and_backward(tmp_path):
    cache = str(tmp_path / "cache")
    cold = _run(cache)
    assert (cold["misses"], cold["uncached"], cold["reasons"]) == (1, 0, {}), cold
    assert cold["torchair_compiles"] == 2, cold  # one GE graph for the forward, one for the backward
    assert cold["shape"] == [3, 2] and cold["requires_grad"] and len(cold["grads"]) == cold["params"], cold
    (entry,) = glob.glob(os.path.join(cache, "graphs", "*", "files"))
    assert {"fw.torchair_graph.py", "bw.torchair_graph.py"} <= set(os.listdir(entry))
    warm = _run(cache)
    assert (warm["hits"], warm["misses"], warm["torchair_compiles"]) == (1, 0, 0), warm
    assert warm["grads"] == cold["grads"] and warm["requires_grad"], warm


def test_torchair_training_graph_with_dropout_never_crashes(tmp_path):
    """torchair generates no code for graphs with RNG ops: such a training graph is served by
    torchair's own runtime, uncached, with the reason counted - never a crash."""
    cache = str(tmp_path / "cache")
    cold = _run(cache, dropout=True)
    assert cold["shape"] == [3, 2] and len(cold["grads"]) == cold["params"], cold
    assert cold["misses"] == 1 and list(cold["reasons"].values()) == [1], cold
    assert "torchair" in next(iter(cold["reasons"])), cold


def test_torchair_training_with_ge_cache_keeps_both_ge_caches_in_the_entry(tmp_path):
    """``ge_cache`` (GE max-autotune) for a training graph: the forward's and the backward's GE
    graphs each cache GE's compiled model inside the one entry (``fw.ge_cache`` / ``bw.ge_cache``),
    and a fresh process hits the entry, builds no GE graph from FX and points GE at those caches."""
    cache = str(tmp_path / "cache")
    cold = _run(cache, ge_cache=True)
    assert (cold["misses"], cold["uncached"], cold["reasons"]) == (1, 0, {}), cold
    assert cold["shape"] == [3, 2] and len(cold["grads"]) == cold["params"], cold
    (entry,) = glob.glob(os.path.join(cache, "graphs", "*", "files"))
    for part in ("fw", "bw"):  # GE (the shim) wrote its cache where it was pointed: into the entry, sealed
        assert os.path.isfile(os.path.join(entry, f"{part}.ge_cache", "tcb_shim_ge_cache.om")), os.listdir(entry)
        seal = json.load(open(os.path.join(entry, f"{part}.ge_cache.seal.json")))
        assert list(seal["files"]) == ["tcb_shim_ge_cache.om"] and seal["cache"] == f"{part}.ge_cache", seal
    for om in glob.glob(os.path.join(entry, "*.ge_cache", "*.om")):
        os.remove(om)  # missing from its sealed cache: set aside, GE rebuilds it
    warm = _run(cache, ge_cache=True)
    assert (warm["hits"], warm["misses"], warm["torchair_compiles"]) == (1, 0, 0), warm
    assert warm["grads"] == cold["grads"], warm
    for part in ("fw", "bw"):  # the warm process pointed GE at the entry's caches again
        assert os.path.isfile(os.path.join(entry, f"{part}.ge_cache", "tcb_shim_ge_cache.om")), os.listdir(entry)
        seal = json.load(open(os.path.join(entry, f"{part}.ge_cache.seal.json")))
        assert list(seal["files"]) == ["tcb_shim_ge_cache.om"], seal  # rebuilt and sealed again
    assert len(glob.glob(os.path.join(cache, "quarantine", "graphs-*.ge_cache-*"))) == 2
