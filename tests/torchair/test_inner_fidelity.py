"""The torchair inner compiler serves exactly what torchair would compile now.

Each setting that changes what GE gets is changed between a cold and a warm process
(fresh interpreters over one cache), through ``torch.compile(backend="npu_cached")``
and through our ``cache_compile``; GE's view is what torchair hands it (the executor
shim records the options and graph of every ``load``). Where torchair's own
``cache_compile`` is right, it runs on the same script and the two are compared;
where it serves a stale graph (custom passes as partials or callable objects, edited
GE converters, dim gears, deterministic algorithms), ours must not.

Cases are batched: one process per phase runs every case, each on its own function
and cache directory.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.torchair_harness.run import run_script

pytestmark = pytest.mark.torchair

TIMEOUT = 300

#: one process per phase (PHASE=cold|warm); every case writes report[name]
OURS = r'''
import functools, glob, json, os, sys
import torch, torchair
import torchair_cached_backend as tcb
from torchair._ge_concrete_graph import ge_apis as ge
from torchair.inference import set_dim_gears
from tests.torchair_harness import executor_shim

CACHE = os.environ["CACHE"]
warm = os.environ["PHASE"] != "cold"
report = {}


def record(name, run):
    start, s0 = len(executor_shim.LOADS), tcb.stats().as_dict()
    out = run()
    s1 = tcb.stats().as_dict()
    report[name] = {
        "loads": executor_shim.LOADS[start:],
        **{k: s1[k] - s0[k] for k in ("hits", "misses", "bypass_loads", "quarantined")},
    }
    return out


def backend_route(name, fn, *args, **opts):
    """torch.compile(backend="npu_cached"), a graph-level hit when warm."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="npu_cached",
                             options={"compiler": "torchair", "cache_dir": os.path.join(CACHE, name), **opts})
    with torch.no_grad():
        return record(name, lambda: compiled(*args))


def cache_compile_route(name, fn, *args, **kw):
    """Our cache_compile: the guard-bypass replay when warm."""
    cached = tcb.cache_compile(fn, cache_dir=os.path.join(CACHE, name), compiler="torchair", **kw)
    with torch.no_grad():
        out = record(name, lambda: cached(*args))
    report[name]["path"] = cached.cache_path
    return out


# -- torch.use_deterministic_algorithms (GE: ge.deterministic) ---------------------
def det_fn(x):
    return torch.relu(x) * 2


def det_cc(x):
    return torch.relu(x) * 3


torch.use_deterministic_algorithms(warm)
backend_route("deterministic", det_fn, torch.ones(2, 4))
cache_compile_route("deterministic_cc", det_cc, torch.ones(2, 4), dynamic=False)
torch.use_deterministic_algorithms(False)


# -- torchair.inference.set_dim_gears (GE: ge.dynamicDims) --------------------------
def gears_fn(x):
    return x.sin() + 1


def gears_cc(x):
    return x.sin() + 2


for name, fn in (("dim_gears", backend_route), ("dim_gears_cc", cache_compile_route)):
    x = torch.ones(4, 3)
    set_dim_gears(x, {0: [2, 4, 8] if warm else [2, 4]})
    fn(name, gears_fn if name == "dim_gears" else gears_cc, x)


# -- custom passes: a functools.partial, a callable object (edited __call__) --------
def swap(gm, example_inputs, config, *, to):
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.relu.default:
            node.target = to
    gm.recompile()


exec(f"""
class Swap:  # the same class, its __call__ edited between the processes
    def __call__(self, gm, example_inputs, config):
        swap(gm, example_inputs, config, to=torch.ops.aten.{'sigmoid' if warm else 'relu'}.default)
""")
target = torch.ops.aten.sigmoid.default if warm else torch.ops.aten.relu.default


def config_with(post_pass):
    cfg = torchair.CompilerConfig()
    cfg.post_grad_custom_post_pass = post_pass
    return cfg


def pass_partial_cc(x):
    return torch.relu(x) + 5


backend_route("pass_partial", lambda x: torch.relu(x) + 3, torch.ones(2, 4),
              config=config_with(functools.partial(swap, to=target)))
backend_route("pass_callable", lambda x: torch.relu(x) + 4, torch.ones(2, 4), config=config_with(Swap()))
cache_compile_route("pass_partial_cc", pass_partial_cc, torch.ones(2, 4), dynamic=False,
                    config=config_with(functools.partial(swap, to=target)))


# -- ge_cache=True: GE's cache dir exists (inside the entry) when GE loads the graph ------
backend_route("ge_cache", lambda x: x.cos() * 7, torch.ones(2, 4), ge_cache=True)


# -- a graph that is compiled but not cached (a training graph whose output aliases its input) ----
def uncacheable(x):
    return x.sin() * 9, x.view(-1)


torch._dynamo.reset()
compiled = torch.compile(uncacheable, backend="npu_cached",
                         options={"compiler": "torchair", "cache_dir": os.path.join(CACHE, "uncacheable"), "ge_cache": True})


def _uncacheable_call():
    return compiled(torch.ones(2, 4, requires_grad=True))


record("uncacheable", _uncacheable_call)
report["uncacheable"]["store"] = sorted(
    os.path.relpath(p, os.path.join(CACHE, "uncacheable"))
    for p in glob.glob(os.path.join(CACHE, "uncacheable", "**"), recursive=True)
    if os.path.isdir(p) and not os.path.basename(p).startswith(("locks", "."))
)


# -- outputs that are views of inputs: cached, rebuilt as views ----------------------------
def views(x):
    return x.t(), x.relu(), x[1:]


x = torch.randn(3, 4)
outs = backend_route("views", views, x)
report["views"]["aliases"] = [o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for o in outs]
report["views"]["values"] = [bool(torch.equal(a, b)) for a, b in zip(outs[::2], views(x)[::2])]
cc_x = torch.randn(3, 4)
cc_outs = cache_compile_route("views_cc", views, cc_x, dynamic=False)
report["views_cc"]["aliases"] = [o.untyped_storage().data_ptr() == cc_x.untyped_storage().data_ptr() for o in cc_outs]


# -- config=None (cold) and config=CompilerConfig() (warm): one directory, one entry --------
def config_none(x):
    return x.exp() + 8


cache_compile_route("config_none", config_none, torch.ones(2, 4), dynamic=False,
                    config=torchair.CompilerConfig() if warm else None)

# -- a user's GE converter, edited between the processes (last: every torchair graph key
#    holds the user's converters, so graphs compiled after it would key differently) ------
exec(f"""
@torchair.register_fx_node_ge_converter(torch.ops.aten.neg.default)
def my_neg(self, meta_outputs=None):
    return ge.{'Abs' if warm else 'Neg'}(self)
""")


def converter_cc(x):
    return -x + 6


backend_route("converter", lambda x: -x + 5, torch.ones(2, 4))
cache_compile_route("converter_cc", converter_cc, torch.ones(2, 4), dynamic=False)


print(json.dumps(report, default=str))
'''


def _run(code: str, phase: str, cache: str, *, fake_torch_npu: bool = False) -> dict:
    proc = run_script(
        code, timeout=TIMEOUT, shim=True, fake_torch_npu=fake_torch_npu, env={"PHASE": phase, "CACHE": cache}
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> dict[str, dict]:
    """Cold, warm (settings changed), warm again (same changed settings: must hit)."""
    cache = str(tmp_path_factory.mktemp("fidelity"))
    return {phase: _run(OURS, phase if phase != "again" else "warm", cache) for phase in ("cold", "warm", "again")}


def _option(report: dict, key: str) -> list:
    return [load["options"].get(key) for load in report["loads"]]


def _ops(report: dict) -> list[str]:
    return [op for load in report["loads"] for op in load["ops"]]


@pytest.mark.parametrize("name", ["deterministic", "deterministic_cc"])
def test_deterministic_algorithms_reach_ge(ours, name):
    assert _option(ours["cold"][name], "ge.deterministic") == ["0"]
    assert _option(ours["warm"][name], "ge.deterministic") == ["1"], ours["warm"][name]
    assert ours["again"][name]["misses"] == 0  # the new setting's graph is cached in turn


@pytest.mark.parametrize("name", ["dim_gears", "dim_gears_cc"])
def test_dim_gears_reach_ge(ours, name):
    assert _option(ours["cold"][name], "ge.dynamicDims") == ["2;4"]
    (dims,) = _option(ours["warm"][name], "ge.dynamicDims")
    assert sorted(dims.split(";"), key=int) == ["2", "4", "8"], ours["warm"][name]
    assert ours["again"][name]["misses"] == 0


@pytest.mark.parametrize("name", ["pass_partial", "pass_callable", "pass_partial_cc"])
def test_custom_pass_by_code_and_bound_values(ours, name):
    assert "Relu" in _ops(ours["cold"][name]) and "Sigmoid" not in _ops(ours["cold"][name])
    assert "Sigmoid" in _ops(ours["warm"][name]) and "Relu" not in _ops(ours["warm"][name]), ours["warm"][name]
    assert ours["again"][name]["misses"] == 0 and ours["again"][name]["hits"] >= 1


@pytest.mark.parametrize("name", ["converter", "converter_cc"])
def test_edited_ge_converter(ours, name):
    assert "Neg" in _ops(ours["cold"][name])
    assert "Abs" in _ops(ours["warm"][name]) and "Neg" not in _ops(ours["warm"][name]), ours["warm"][name]
    assert ours["again"][name]["misses"] == 0 and ours["again"][name]["hits"] >= 1


def test_unchanged_settings_hit(ours):
    """The same settings in a fresh process are served from the cache (nothing compiles)."""
    for name in ("deterministic", "dim_gears", "pass_partial", "pass_callable", "converter", "ge_cache", "views"):
        assert ours["again"][name]["misses"] == 0 and ours["again"][name]["hits"] >= 1, (name, ours["again"][name])
    for name in ("deterministic_cc", "pass_partial_cc", "converter_cc", "views_cc", "config_none"):
        assert ours["again"][name]["bypass_loads"] == 1 and ours["again"][name]["misses"] == 0, (name, ours["again"][name])


def test_ge_cache_dir_exists_when_ge_loads(ours):
    for phase in ("cold", "warm"):
        (load,) = ours[phase]["ge_cache"]["loads"]
        ge_dir = load["options"]["ge.graph_compiler_cache_dir"]
        assert load["ge_cache_dir_exists"], (phase, ge_dir)
        assert ge_dir.endswith(os.path.join("files", "ge_cache")) and "/graphs/" in ge_dir
        assert os.path.isfile(os.path.join(ge_dir, "tcb_shim_ge_cache.om"))  # GE could write its cache


def test_uncacheable_graph_never_points_ge_into_the_store(ours):
    for phase in ("cold", "warm", "again"):
        rep = ours[phase]["uncacheable"]
        (load,) = rep["loads"]
        ge_dir = load["options"]["ge.graph_compiler_cache_dir"]
        assert "/graphs/" not in ge_dir and load["ge_cache_dir_exists"], ge_dir
        assert rep["quarantined"] == 0 and rep["hits"] == 0
        assert [d for d in rep["store"] if d.startswith("graphs/")] == [], rep["store"]
        assert "quarantine" not in rep["store"]


@pytest.mark.parametrize("name", ["views", "views_cc"])
def test_views_of_inputs_are_cached_and_rebuilt(ours, name):
    assert ours["cold"][name]["misses"] == 1
    warm = ours["warm"][name]
    assert warm["misses"] == 0 and warm["hits"] >= 1
    assert warm["aliases"] == [True, False, True]  # as in eager: .t() and [1:] view the input
    if name == "views":
        assert warm["values"] == [True, True]


def test_config_none_equals_default_config(ours):
    cold, warm = ours["cold"]["config_none"], ours["warm"]["config_none"]
    assert cold["path"] == warm["path"]
    assert cold["misses"] == 1 and warm["misses"] == 0 and warm["hits"] >= 1


#: torchair's own cache_compile on the same cases, where torchair is right
THEIRS = r'''
import glob, json, os
import torch, torchair
from torchair.inference._cache_compiler import CompiledModel
from tests.torchair_harness import executor_shim

CACHE = os.environ["CACHE"]
warm = os.environ["PHASE"] != "cold"
report = {}


class Model(torch.nn.Module):
    def views(self, x):
        return x.t(), x.relu(), x[1:]

    def cos(self, x):
        return x.cos() * 7

    def exp(self, x):
        return x.exp() + 8


m = Model()
x = torch.randn(3, 4)
with torch.no_grad():
    outs = torchair.inference.cache_compile(m.views, cache_dir=os.path.join(CACHE, "views"), dynamic=False)(x)
report["views"] = {"aliases": [o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for o in outs],
                   "bins": glob.glob(os.path.join(CACHE, "views", "*", "views", "compiled_module"))}

start = len(executor_shim.LOADS)
with torch.no_grad():
    torchair.inference.cache_compile(m.cos, cache_dir=os.path.join(CACHE, "ge_cache"), dynamic=False, ge_cache=True)(
        torch.ones(2, 4))
(load,) = executor_shim.LOADS[start:]
report["ge_cache"] = {"exists": load["ge_cache_dir_exists"], "dir": load["options"]["ge.graph_compiler_cache_dir"]}

config = torchair.CompilerConfig() if warm else None
fn = torchair.inference.cache_compile(m.exp, cache_dir=os.path.join(CACHE, "config_none"), dynamic=False, config=config)
report["config_none"] = {"bin": CompiledModel.get_cache_bin(m.exp, cache_dir=os.path.join(CACHE, "config_none"),
                                                              dynamic=False, config=config)}
print(json.dumps(report, default=str))
'''


@pytest.fixture(scope="module")
def theirs(tmp_path_factory) -> dict[str, dict]:
    cache = str(tmp_path_factory.mktemp("torchair_own"))
    return {phase: _run(THEIRS, phase, cache) for phase in ("cold", "warm")}


def test_parity_views_of_inputs(ours, theirs):
    """torchair caches outputs that view inputs and returns views; so do we."""
    for phase in ("cold", "warm"):
        assert theirs[phase]["views"]["aliases"] == [True, False, True]
        assert len(theirs[phase]["views"]["bins"]) == 1
    assert ours["warm"]["views_cc"]["aliases"] == theirs["warm"]["views"]["aliases"]


def test_parity_ge_cache_dir_created(ours, theirs):
    for phase in ("cold", "warm"):
        assert theirs[phase]["ge_cache"]["exists"], theirs[phase]
        (load,) = ours[phase]["ge_cache"]["loads"]
        assert load["ge_cache_dir_exists"] == theirs[phase]["ge_cache"]["exists"]


def test_parity_config_none(ours, theirs):
    assert theirs["cold"]["config_none"]["bin"] == theirs["warm"]["config_none"]["bin"]
    assert ours["cold"]["config_none"]["path"] == ours["warm"]["config_none"]["path"]


#: the NPU deterministic level (torch_npu's setting), ours and torchair's own cache_compile
DET_LEVEL = r'''
import glob, json, os, sys
import torch, torchair
import torchair_cached_backend as tcb
from tests.torchair_harness import executor_shim

CACHE = os.environ["CACHE"]
warm = os.environ["PHASE"] != "cold"
sys.modules["torch_npu"].npu.deterministic_level = 0 if warm else 1
report = {}


class Model(torch.nn.Module):
    def ours(self, x):
        return torch.relu(x) + 1

    def theirs(self, x):
        return torch.relu(x) + 1


def config():
    cfg = torchair.CompilerConfig()
    cfg.experimental_config.pattern_fusion_pass = False  # the fake torch_npu has no npu fusion ops
    return cfg


m = Model()
for side, cache_compile, kw in (("ours", tcb.cache_compile, {"compiler": "torchair"}),
                                ("theirs", torchair.inference.cache_compile, {})):
    start = len(executor_shim.LOADS)
    fn = cache_compile(getattr(m, side), cache_dir=os.path.join(CACHE, side), dynamic=False, config=config(), **kw)
    with torch.no_grad():
        fn(torch.ones(2, 4))
    report[side] = {
        "levels": [load["options"].get("ge.deterministicLevel") for load in executor_shim.LOADS[start:]],
        "dirs": sorted(os.path.basename(d) for d in glob.glob(os.path.join(CACHE, side, "*"))),
    }
print(json.dumps(report, default=str))
'''


def test_npu_deterministic_level(tmp_path):
    """Cached at level 1, called at level 0: torchair's cache_compile builds a new entry
    and GE gets level 0; ours must too (the bypass verifies each graph's key factors)."""
    cache = str(tmp_path)
    cold = _run(DET_LEVEL, "cold", cache, fake_torch_npu=True)
    warm = _run(DET_LEVEL, "warm", cache, fake_torch_npu=True)
    assert cold["theirs"]["levels"] == cold["ours"]["levels"] == ["1"]
    assert warm["theirs"]["levels"] == ["0"] and len(warm["theirs"]["dirs"]) == 2  # torchair: a new entry
    assert warm["ours"]["levels"] == ["0"], warm["ours"]
