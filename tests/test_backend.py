"""The npu_cached backend end to end: correct outputs, cold then warm in fresh processes."""

from __future__ import annotations

import json
import os

import pytest

# one child compiles every case and saves eager references; a second, fresh child
# (with an EMPTY Inductor cache dir) must serve all of them from our cache.
CASES = """
import torch, torchair_cached_backend as tcb
from models import build
results = {}
for name in ("mlp", "conv", "gpt"):
    for dynamic in (False, True):
        model, x = build(name)
        compiled = torch.compile(model, backend="npu_cached", dynamic=dynamic,
                                 options={"cache_dir": CACHE, "compiler": COMPILER})
        with torch.no_grad():
            ref = model(x)
            out = compiled(x)
            errs = [float((out - ref).abs().max())]
            if dynamic:  # another batch (and sequence) size through the same entry
                x2 = torch.cat([x, x, x])[:, : x.shape[1] - 1] if name == "gpt" else torch.cat([x, x, x])
                errs.append(float((compiled(x2) - model(x2)).abs().max()))
        results[f"{name}-{'dynamic' if dynamic else 'static'}"] = max(errs)
s = tcb.stats()
import sys
emit({"errs": results, "hits": s.hits, "misses": s.misses, "uncached": s.uncached,
      "inductor_imported": "torch._inductor" in sys.modules})
"""


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_outputs_match_and_warm_process_hits(run, tmp_path, compiler):
    cache = str(tmp_path / "cache")
    code = f"CACHE, COMPILER = {cache!r}, {compiler!r}\n" + CASES
    cold = run(code, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind_cold")})
    tol = 0.0 if compiler == "eager" else 1e-4
    assert all(err <= tol for err in cold["errs"].values()), cold["errs"]
    # (hits in the cold process: the dynamic torch.compile of a model replays the program its static
    # one cached moments before, on the backend route, until a new shape traces)
    assert cold["misses"] >= 6 and cold["uncached"] == 0

    empty = tmp_path / "ind_warm"
    empty.mkdir()
    warm = run(code, env={"TORCHINDUCTOR_CACHE_DIR": str(empty)})
    assert all(err <= tol for err in warm["errs"].values()), warm["errs"]
    # every cached graph is hit (each torch.compile's replay loads its program's variants)
    assert warm["misses"] == 0 and warm["hits"] >= cold["misses"]
    # self-contained: the warm process compiled no kernel into the empty Inductor dir
    assert not [f for _, _, fs in os.walk(empty) for f in fs if f.endswith((".so", ".cpp", ".py"))]
    # the key factors are stored readably beside every entry
    graphs = tmp_path / "cache" / "graphs"
    manifest = json.loads((next(graphs.iterdir()) / "manifest.json").read_text())
    assert {"graph", "inputs", "compiler", "environment", "decompositions"} <= set(manifest["factors"])
    assert manifest["factors"]["environment"]["torch"].startswith("2.")


def test_hit_and_miss_are_logged(run, tmp_path):
    code = f"""
    import logging, torch
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    f = torch.compile(lambda x: x.relu() + 1, backend="npu_cached",
                      options={{"cache_dir": {str(tmp_path)!r}, "compiler": "eager"}})
    with torch.no_grad():
        f(torch.ones(3))
    emit({{}})
    """
    first = run(code)["_stderr"]
    second = run(code)["_stderr"]
    assert "torchair_cached_backend INFO npu_cached miss" in first and "compiled in" in first
    assert "torchair_cached_backend INFO npu_cached hit" in second and "loaded in" in second


def test_autograd_graph_is_cached_forward_and_backward(run, tmp_path):
    """A graph that needs autograd is cached (forward + backward in one entry): a fresh
    process hits it and computes the same gradients (it used to be compiled uncached)."""
    code = f"""
        import logging, torch, torchair_cached_backend as tcb
        logging.basicConfig(level=logging.WARNING)
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 4)
        f = torch.compile(m, backend="npu_cached", options={{"cache_dir": {str(tmp_path)!r}, "compiler": "eager"}})
        f(torch.ones(2, 4)).pow(2).sum().backward()
        s = tcb.stats()
        emit({{"uncached": s.uncached, "misses": s.misses, "hits": s.hits, "grad": m.weight.grad.tolist()}})
        """
    cold, warm = run(code), run(code)
    assert (cold["uncached"], cold["misses"], cold["hits"]) == (0, 1, 0)
    assert (warm["uncached"], warm["misses"], warm["hits"]) == (0, 0, 1)
    assert warm["grad"] == cold["grad"] and any(any(row) for row in cold["grad"])
    assert "compiled uncached" not in cold["_stderr"] + warm["_stderr"]
    assert len(os.listdir(tmp_path / "graphs")) == 1


def test_corrupted_graph_blob_is_rebuilt_not_run(run, tmp_path):
    code = f"""
    import torch, torchair_cached_backend as tcb
    f = torch.compile(lambda x: x * 3, backend="npu_cached", options={{"cache_dir": {str(tmp_path)!r}, "compiler": "eager"}})
    with torch.no_grad():
        y = f(torch.ones(2))
    s = tcb.stats()
    emit({{"y": y.tolist(), "hits": s.hits, "misses": s.misses, "quarantined": s.quarantined}})
    """
    run(code)
    entry = next((tmp_path / "graphs").iterdir())
    blob = entry / "files" / "graph.py"
    blob.write_bytes(blob.read_bytes().replace(b"3", b"7"))  # same size, different content
    out = run(code)
    assert out["y"] == [3.0, 3.0] and out["quarantined"] == 1 and out["misses"] == 1 and out["hits"] == 0
    assert "broken" in out["_stderr"]
    assert len(os.listdir(tmp_path / "quarantine")) == 1
    again = run(code)
    assert again["hits"] == 1 and again["quarantined"] == 0


def test_entries_from_other_versions_coexist(run, tmp_path):
    """Issue 14: nodes on two CANN versions sharing a cache keep each other's graphs (their
    keys differ); nothing is set aside per start, only prune removes them."""
    code = f"""
    import torch, torchair_cached_backend as tcb
    f = torch.compile(lambda x: x - 1, backend="npu_cached", options={{"cache_dir": {str(tmp_path)!r}, "compiler": "eager"}})
    with torch.no_grad():
        f(torch.ones(2))
    s = tcb.stats()
    emit({{"hits": s.hits, "misses": s.misses, "quarantined": s.quarantined}})
    """
    run(code, env={"TCB_CANN_VERSION": "8.0.RC1"})
    out = run(code, env={"TCB_CANN_VERSION": "8.1.RC1"})
    assert out["misses"] == 1 and out["hits"] == 0 and out["quarantined"] == 0
    assert len(os.listdir(tmp_path / "graphs")) == 2 and not (tmp_path / "quarantine").exists()
    back = run(code, env={"TCB_CANN_VERSION": "8.0.RC1"})
    assert back["hits"] == 1 and back["misses"] == 0


def test_foreign_owned_cache_dir_refused_clearly(run, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a directory to another user")
    os.chown(tmp_path, 4242, 4242)
    out = run(
        f"""
        import torch
        f = torch.compile(lambda x: x + 1, backend="npu_cached", options={{"cache_dir": {str(tmp_path)!r}, "compiler": "eager"}})
        try:
            f(torch.ones(2)); emit({{"error": None}})
        except Exception as exc:
            emit({{"error": str(exc)}})
        """
    )
    assert "owned by uid 4242" in out["error"] and "cache_dir you own" in out["error"]
