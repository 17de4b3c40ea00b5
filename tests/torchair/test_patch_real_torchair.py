"""``patch_torchair()``: code written against torchair's API gets our cache without edits.

The real torchair on CPU (harness + executor shim), the reference page's example exactly as
written (``reference_example.REFERENCE_EXAMPLE``: ``import torch, torch_npu, torchair``, the Add
decomposition and the ``Model`` calling ``torchair.inference.cache_compile`` in its
``__init__``). Every process is fresh; a warm process is a second one over the same working
directory (both caches default to ``./.torchair_cache``).

Harness note: ``import torch_npu`` is served by the harness's fake torch_npu, removed again before
the first call (``reference_example.DROP_FAKE_TORCH_NPU`` says why).
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from tests.torchair.reference_example import CHILD_GLUE, DROP_FAKE_TORCH_NPU, REFERENCE_EXAMPLE
from tests.torchair_harness.run import run_script

pytestmark = pytest.mark.torchair

TIMEOUT = 300

PATCHED_RUN = """
ModelCacheSaver.__call__ = torchair_compiled
patch = tcb.patch_torchair()
model = Model()
out = model(torch.ones(2, 3), torch.ones(2, 3))
try:
    text = torchair.inference.readable_cache(model.cached.cache_path, print_output=False)
except Exception as exc:  # reported, so the other facts still come back
    text = f"readable_cache raised {exc!r}"
result(cached_type=type(model.cached).__module__ + "." + type(model.cached).__name__,
       shape=list(out.shape), cache_path=model.cached.cache_path, active=patch.active,
       readable_describes_ours="inner_forward" in text and "program" in text, readable_head=text[:1500])
"""


def _run(code: str, cwd: str) -> dict:
    proc = run_script(
        REFERENCE_EXAMPLE + DROP_FAKE_TORCH_NPU + CHILD_GLUE + code,
        timeout=TIMEOUT,
        shim=True,
        fake_torch_npu=True,
        cwd=cwd,
        env={"TORCHAIR_CACHE_HOME": None},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON result line:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def _torchair_files(files: list[str]) -> list[str]:
    return [f for f in files if os.path.basename(f) in ("compiled_module",) or f.endswith(".om")]


def test_patched_reference_example_cold_then_warm_is_served_by_our_cache(tmp_path):
    cwd = str(tmp_path)
    cold = _run(PATCHED_RUN, cwd)
    assert cold["cached_type"] == "torchair_cached_backend.drop_in.CacheCompiledFunction", cold
    assert cold["active"] is True
    assert cold["shape"] == [2, 3]  # the harness's GE executor returns placeholder zeros: shapes only
    assert cold["stats"]["misses"] == 1, cold
    # ours: ./.torchair_cache/Model_dynamic_<md5>/inner_forward, holding our program and graph
    assert os.path.realpath(cold["cache_path"]).startswith(os.path.realpath(cwd) + os.sep)
    assert glob.glob(os.path.join(cold["cache_path"], "programs", "*", "manifest.json")), cold["files"]
    assert _torchair_files(cold["files"]) == [], "torchair wrote its own cache files"

    warm = _run(PATCHED_RUN, cwd)
    assert warm["shape"] == [2, 3]
    assert warm["cache_path"] == cold["cache_path"]
    s = warm["stats"]
    assert (s["bypass_loads"], s["misses"], s["fallbacks"]) == (1, 0, 0), warm["logs"]
    assert s["hits"] >= 1
    assert warm["frames"] == 0, f"the warm process traced with Dynamo: {warm['logs']}"
    assert warm["readable_describes_ours"], warm["readable_head"]
    assert _torchair_files(warm["files"]) == []


UNPATCH_RUN = """
import torchair.inference as ti
originals = {n: getattr(ti, n) for n in ("cache_compile", "readable_cache", "_cache_compile", "_readable_cache")}
from torchair.inference import cache_compile as bound_early   # bound before any patching
facts = {}
with tcb.patch_torchair() as handle:
    facts["replaced"] = sorted(n for n, f in originals.items() if getattr(ti, n) is not f)
    facts["inside"] = type(Model().cached).__name__
    # the public function bound before patching delegates to the private one, which is ours too
    facts["bound_early"] = type(bound_early(Model().inner_forward)).__name__
    nested = tcb.patch_torchair()
    facts["nested_is_owner"] = nested.owner
    nested.unpatch()  # must not remove the outer patch
    facts["after_nested_unpatch"] = type(Model().cached).__name__
facts["restored"] = all(getattr(ti, n) is f for n, f in originals.items())
facts["handle_active_after_exit"] = handle.active
model = Model()
facts["after"] = type(model.cached).__name__
out = model(torch.ones(2, 3), torch.ones(2, 3))  # torchair's own cache_compile: compiles, writes compiled_module
cache_bins = glob.glob(os.path.join(".torchair_cache", "Model_*", "inner_forward", "compiled_module"))
facts["torchair_cache_bins"] = len(cache_bins)
# patched again: a path that is not ours (torchair's compiled_module) goes to torchair's readable_cache
tcb.patch_torchair()
facts["readable_torchair_file"] = "ModelCacheMeta" in str(ti.readable_cache(cache_bins[0], print_output=False))
tcb.unpatch_torchair()
tcb.unpatch_torchair()  # idempotent
facts["restored_again"] = all(getattr(ti, n) is f for n, f in originals.items())
result(shape=list(out.shape), **facts)
"""


def test_unpatch_restores_torchair_functions(tmp_path):
    res = _run(UNPATCH_RUN, str(tmp_path))
    assert res["replaced"] == ["_cache_compile", "_readable_cache", "cache_compile", "readable_cache"]
    assert res["inside"] == res["bound_early"] == res["after_nested_unpatch"] == "CacheCompiledFunction"
    assert res["nested_is_owner"] is False
    assert res["restored"] and res["restored_again"]
    assert res["handle_active_after_exit"] is False
    assert res["after"] == "LazyCompiledModel"  # torchair's own again
    assert res["shape"] == [2, 3]
    assert res["torchair_cache_bins"] == 1
    assert res["readable_torchair_file"] is True
