"""The ``torchair`` inner compiler against the real torchair on CPU (harness + shim).

Every torchair interaction runs in a fresh process (``run_script``); a "warm"
process is a second fresh process over the same cache directory.
"""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from tests.torchair_harness.run import run_script

pytestmark = pytest.mark.torchair

TIMEOUT = 300

MODEL = """
import glob, json, os, sys, logging
import torch, torchair
import torchair_cached_backend as tcb
from torchair_cached_backend.compilers import torchair as tc_mod

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).relu() + x

    def prompt(self, x):
        return self.linear(x).relu() + x

model = Model()

def result(**kw):
    s = tcb.stats()
    kw.update(hits=s.hits, misses=s.misses, bypass_loads=s.bypass_loads, dynamo="torch._dynamo" in sys.modules)
    print(json.dumps(kw))
"""


def _last_json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON result line in stdout:\n{stdout}"
    return json.loads(lines[-1])


def _run(code: str, **kw) -> tuple[dict, str]:
    proc = run_script(MODEL + code, timeout=TIMEOUT, shim=True, **kw)
    return _last_json(proc.stdout), proc.stderr


def _entries(cache: str) -> list[str]:
    return sorted(glob.glob(os.path.join(cache, "graphs", "*", "files", "torchair_graph.py")))


BACKEND_RUN = """
opts = {{"compiler": "torchair", "cache_dir": {cache!r}}}
opts.update({extra})
compiled = torch.compile(model, backend="npu_cached", options=opts)
with torch.no_grad():
    out = compiled(torch.ones(2, 4))
result(shape=list(out.shape))
"""


def test_cold_then_warm_hit(tmp_path):
    cache = str(tmp_path / "cache")
    cold, _ = _run(BACKEND_RUN.format(cache=cache, extra="{}"))
    assert cold["misses"] == 1 and cold["hits"] == 0
    assert cold["shape"] == [2, 4]
    (entry,) = _entries(cache)
    code = open(entry).read()
    assert "GeGraph(serialized_model_def=" in code
    assert 'local_compile_options["mode"] = "max-autotune"' in code
    assert "ge.graph_compiler_cache_dir" not in code

    warm, _ = _run(BACKEND_RUN.format(cache=cache, extra="{}"))
    assert warm["hits"] >= 1 and warm["misses"] == 0
    assert warm["shape"] == [2, 4]
    assert _entries(cache) == [entry]


def test_one_config_leaf_changes_the_key(tmp_path):
    cache = str(tmp_path / "cache")
    res, _ = _run(f"""
from torchair_cached_backend.compilers import get_compiler
from torchair_cached_backend.options import parse_options
a, b = torchair.CompilerConfig(), torchair.CompilerConfig()
b.experimental_config.frozen_parameter = True
comp = get_compiler("torchair")
fa = comp.hash_factors(parse_options({{"cache_dir": {cache!r}, "config": a}}))
fb = comp.hash_factors(parse_options({{"cache_dir": {cache!r}, "config": b}}))
fd = comp.hash_factors(parse_options({{"cache_dir": {cache!r}}}))
for cfg in (a, b):
    torch._dynamo.reset()
    m = torch.compile(model, backend="npu_cached",
                      options={{"compiler": "torchair", "cache_dir": {cache!r}, "config": cfg}})
    with torch.no_grad():
        m(torch.ones(2, 4))
result(same=fa == fb, default_same=fa == fd)
""")
    assert not res["same"]
    assert res["default_same"]  # None and a default CompilerConfig() hash alike
    assert res["misses"] == 2
    entries = _entries(cache)
    assert len(entries) == 2
    texts = [open(e).read() for e in entries]
    assert sum('local_compile_options["frozen_parameter"] = "1"' in t for t in texts) == 1


GE_CACHE_RUN = """
seen = []
orig_exec, orig_load = tc_mod._exec_source, tc_mod.TorchairCompiler.load
def spy_exec(src, name):
    mod = orig_exec(src, name)
    seen.append(mod)
    return mod
tc_mod._exec_source = spy_exec
opts = {{"compiler": "torchair", "cache_dir": {cache!r}, "ge_cache": True}}
compiled = torch.compile(model, backend="npu_cached", options=opts)
with torch.no_grad():
    out = compiled(torch.ones(2, 4))
result(shape=list(out.shape),
       ge_dirs=[m.local_compile_options.get("ge.graph_compiler_cache_dir") for m in seen])
"""


def test_ge_cache_dir_points_into_the_entry(tmp_path):
    cache = str(tmp_path / "cache")
    cold, _ = _run(GE_CACHE_RUN.format(cache=cache))
    assert cold["misses"] == 1
    (entry,) = _entries(cache)
    files_dir = os.path.dirname(entry)
    code = open(entry).read()
    # the stored code carries a placeholder, never this machine's path
    assert 'local_compile_options["ge.graph_compiler_cache_dir"] = "<npu_cached:ge_cache_dir>"' in code
    assert "def _update_ge_cache_dir(path):" in code
    assert str(tmp_path) not in code
    # the cold process already points GE at the entry it is about to publish
    assert cold["ge_dirs"] == [os.path.join(files_dir, "ge_cache")]

    warm, _ = _run(GE_CACHE_RUN.format(cache=cache))
    assert warm["hits"] >= 1 and warm["misses"] == 0
    assert warm["ge_dirs"] == [os.path.join(files_dir, "ge_cache")]


#: where the fake torch_npu stops: it generates and loads aclgraph code, it cannot capture
FAKE_CAPTURE_ERROR = "fake torch_npu: NPUGraph capture is not available on CPU"


def _aclgraph_entry(cache: str, config_lines: str, extra_options: str = "") -> tuple[dict, str, str, dict]:
    """Compile the model in an aclgraph mode with the fake torch_npu (which can generate
    and load aclgraph code, not capture it); return the result, the stored code, stderr,
    the manifest. Only the fake's own capture error is expected: any other error (ours
    included) fails the test."""
    proc = run_script(
        MODEL
        + f"""
cfg = torchair.CompilerConfig()
cfg.experimental_config.pattern_fusion_pass = False
{config_lines}
compiled = torch.compile(model, backend="npu_cached",
                         options={{"compiler": "torchair", "cache_dir": {cache!r}, "config": cfg{extra_options}}})
try:
    with torch.no_grad():
        compiled(torch.ones(2, 4))
    err = None
except RuntimeError as exc:
    err = str(exc)
result(err=err)
""",
        timeout=TIMEOUT,
        shim=True,
        fake_torch_npu=True,
    )
    res = _last_json(proc.stdout)
    assert res["err"] is not None and FAKE_CAPTURE_ERROR in res["err"], res["err"]
    (entry,) = _entries(cache)
    manifest = json.load(open(os.path.join(os.path.dirname(os.path.dirname(entry)), "manifest.json")))
    return res, open(entry).read(), proc.stderr, manifest


def test_reduce_overhead_codegen_and_ge_cache_warning(tmp_path):
    res, code, stderr, manifest = _aclgraph_entry(
        str(tmp_path / "cache"), 'cfg.mode = "reduce-overhead"', ', "ge_cache": True'
    )
    assert res["misses"] == 1
    assert "AclGraph(fx_forward=forward" in code
    assert "GeGraph(" not in code
    assert "ge.graph_compiler_cache_dir" not in code
    assert "ge_cache=True has no effect in aclgraph mode reduce-overhead" in stderr
    assert manifest["meta"]["mode"] == "reduce-overhead" and manifest["meta"]["ge_cache"] is False


def test_rng_graph_is_rejected(tmp_path):
    res, _ = _run(f"""
def f(x):
    return (x + torch.randn(2, 4),)
compiled = torch.compile(f, backend="npu_cached", options={{"compiler": "torchair", "cache_dir": {str(tmp_path)!r}}})
try:
    with torch.no_grad():
        compiled(torch.ones(2, 4))
    err = None
except Exception as exc:
    err = str(exc)
result(err=err)
""")
    assert res["err"] and "Cache compile does not support operator that depend on RNG" in res["err"]
    assert _entries(str(tmp_path)) == []


TORCHAIR_CC = """
from torchair.inference._cache_compiler import CompiledModel, ModelCacheSaver
cached = torchair.inference.cache_compile(model.prompt, cache_dir={cache!r})
cache_bin = CompiledModel.get_cache_bin(model.prompt, cache_dir={cache!r})
if {warm!r}:
    def must_not_compile(*a, **k):
        raise AssertionError("torchair cache miss")
    ModelCacheSaver.__call__ = must_not_compile
with torch.no_grad():
    out = cached(torch.ones(3, 4))
code = CompiledModel.load(cache_bin).compiled_fx.py_code
result(cache_bin=cache_bin, shape=list(out.shape), code=code)
"""

OURS_CC = """
cached = tcb.cache_compile(model.prompt, cache_dir={cache!r}, compiler="torchair")
with torch.no_grad():
    out = cached(torch.ones(3, 4))
result(path=cached.cache_path, shape=list(out.shape))
"""


def _ge_lines(code: str) -> dict[str, str]:
    serialized = re.search(r"^serialized_graph = (b.*)$", code, re.M)
    assert serialized, code[:2000]
    return {
        "serialized": serialized.group(1),
        "geg": [line for line in code.splitlines() if "GeGraph(serialized_model_def=" in line],
        "mode": [line for line in code.splitlines() if line.startswith('local_compile_options["mode"]')],
    }


def test_parity_with_torchair_cache_compile(tmp_path):
    theirs_dir, ours_dir = str(tmp_path / "torchair"), str(tmp_path / "ours")
    t_cold, _ = _run(TORCHAIR_CC.format(cache=theirs_dir, warm=False))
    o_cold, _ = _run(OURS_CC.format(cache=ours_dir))
    assert t_cold["shape"] == o_cold["shape"] == [3, 4]

    # torchair: <root>/Model_dynamic_<md5>/prompt/compiled_module
    assert re.fullmatch(
        re.escape(os.path.realpath(theirs_dir)) + r"/Model_dynamic_[0-9a-f]{32}/prompt/compiled_module",
        t_cold["cache_bin"],
    ), t_cold["cache_bin"]
    assert os.path.isfile(t_cold["cache_bin"])
    # ours: <root>/Model_dynamic_<md5>/prompt/
    assert re.fullmatch(re.escape(ours_dir) + r"/Model_dynamic_[0-9a-f]{32}/prompt", o_cold["path"]), o_cold["path"]
    assert o_cold["misses"] == 1
    (entry,) = _entries(o_cold["path"])

    t_warm, _ = _run(TORCHAIR_CC.format(cache=theirs_dir, warm=True))
    o_warm, _ = _run(OURS_CC.format(cache=ours_dir))
    assert t_warm["shape"] == o_warm["shape"] == [3, 4]
    assert o_warm["hits"] >= 1 and o_warm["misses"] == 0
    assert o_warm["bypass_loads"] == 1  # ours replays the saved bytecode: no Dynamo tracing at warm start

    theirs, ours = _ge_lines(t_cold["code"]), _ge_lines(open(entry).read())
    assert theirs["geg"] and ours["geg"] == theirs["geg"]
    assert theirs["mode"] == ours["mode"] == ['local_compile_options["mode"] = "max-autotune"']
    # same GE graph: protobuf map fields serialize in no fixed order, so compare parsed ModelDefs
    (tmp_path / "theirs.txt").write_text(theirs["serialized"])
    (tmp_path / "ours.txt").write_text(ours["serialized"])
    proc = run_script(
        f"""
import ast, json
from torchair._ge_concrete_graph.ge_ir_pb2 import ModelDef
a, b = (ModelDef.FromString(ast.literal_eval(open(p).read())) for p in ({str(tmp_path / "theirs.txt")!r},
                                                                     {str(tmp_path / "ours.txt")!r}))
print(json.dumps({{"equal": a == b, "ops": len(a.graph[0].op)}}))
""",
        timeout=TIMEOUT,
    )
    parsed = _last_json(proc.stdout)
    assert parsed["ops"] > 0
    assert parsed["equal"]


ADD_EXAMPLE = """
from torch._decomp import get_decompositions, register_decomposition

@register_decomposition(torch.ops.aten.add.default)
def test_add_decomp(t1, t2):
    return t1 + t2

class AddModel(torch.nn.Module):
    def __init__(self, cache_compile, **kw):
        super().__init__()
        self.cached = cache_compile(self.inner_forward, cache_dir={cache!r},
                                    custom_decompositions=get_decompositions([torch.ops.aten.add.default]), **kw)

    def inner_forward(self, t1, t2):
        return torch.ops.aten.add(t1, t2)

    def forward(self, t1, t2):
        return self.cached(t1, t2)

side = {side!r}
if side == "torchair":
    from torchair.inference._cache_compiler import CompiledModel, ModelCacheSaver
    m = AddModel(torchair.inference.cache_compile)
    if {warm!r}:
        ModelCacheSaver.__call__ = lambda *a, **k: (_ for _ in ()).throw(AssertionError("torchair cache miss"))
else:
    m = AddModel(tcb.cache_compile, compiler="torchair")
with torch.no_grad():
    out = m(torch.ones(2, 3), torch.ones(2, 3))
result(shape=list(out.shape), path=getattr(m.cached, "cache_path", None))
"""


def test_parity_reference_add_decomposition_example(tmp_path):
    """The reference page's example runs through torchair's cache_compile and ours, cold then warm."""
    for side in ("torchair", "ours"):
        cache = str(tmp_path / side)
        cold, _ = _run(ADD_EXAMPLE.format(cache=cache, side=side, warm=False))
        warm, _ = _run(ADD_EXAMPLE.format(cache=cache, side=side, warm=True))
        assert cold["shape"] == warm["shape"] == [2, 3]
        if side == "ours":
            assert cold["misses"] == 1 and warm["misses"] == 0
            assert warm["bypass_loads"] == 1 and warm["hits"] == 1
            assert re.search(r"/AddModel_dynamic_[0-9a-f]{32}/inner_forward$", warm["path"])
        else:
            assert glob.glob(os.path.join(cache, "AddModel_dynamic_*", "inner_forward", "compiled_module"))


RNG_CC = """
class RngModel(torch.nn.Module):
    def __init__(self, cache_compile, **kw):
        super().__init__()
        self.cached = cache_compile(self.prompt, cache_dir={cache!r}, **kw)

    def forward(self, x):
        return self.cached(x)

    def prompt(self, x):
        return x + torch.randn(2, 4)

if {side!r} == "torchair":
    m = RngModel(torchair.inference.cache_compile)
else:
    m = RngModel(tcb.cache_compile, compiler="torchair")
try:
    with torch.no_grad():
        m(torch.ones(2, 4))
    err = None
except Exception as exc:
    err = str(exc)
result(err=err)
"""


def test_parity_rng_error(tmp_path):
    """Both refuse a graph with an RNG op at compile time, naming the problem."""
    theirs, _ = _run(RNG_CC.format(cache=str(tmp_path / "t"), side="torchair"))
    ours, _ = _run(RNG_CC.format(cache=str(tmp_path / "o"), side="ours"))
    assert theirs["err"] and "RNG" in theirs["err"]
    assert ours["err"] and "random number generator" in ours["err"] and "randn" in ours["err"]


def test_aclgraph_static_kernel_cache_options(tmp_path):
    """npugraph_ex with static-shape kernels: torchair's static-kernel cache options reach codegen,
    with the directory a placeholder (re-pointed into the entry on load), never a machine path."""
    cache = str(tmp_path / "cache")
    res, code, _, manifest = _aclgraph_entry(
        cache, 'cfg.mode = "npugraph_ex"\ncfg.experimental_config.aclgraph._aclnn_static_shape_kernel = True'
    )
    assert res["misses"] == 1
    assert "_aclnn_static_shape_kernel.use_cache_compile" in code
    assert "<npu_cached:static_kernel_dir>" in code and cache not in code
    assert "def _update_static_kernel_cache_dir(" in code
    assert manifest["factors"]["compiler_factors"]["static_kernel_options"]["_aclnn_static_shape_kernel.deterministic"] == "0"
    # the static-kernel dir exists inside the entry before torchair compiles/loads kernels there,
    # cold and warm (torchair warns "The path does not exist" and caches nothing otherwise)
    (entry,) = _entries(cache)
    kernels_dir = os.path.join(os.path.dirname(entry), "static_kernels")
    assert os.path.isdir(kernels_dir) and os.listdir(kernels_dir)
    warm, _, stderr, _ = _aclgraph_entry(
        cache, 'cfg.mode = "npugraph_ex"\ncfg.experimental_config.aclgraph._aclnn_static_shape_kernel = True'
    )
    assert warm["hits"] == 1 and warm["misses"] == 0
    assert "The path does not exist" not in stderr
