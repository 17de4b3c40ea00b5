"""``cache_compile``: the torchair-compatible entry point, cold in one fresh
process and warm in another.

Hits are proven by ``torchair_cached_backend.stats()`` and by Dynamo's own frame
counters (or by ``torch._dynamo`` never being imported), never by timing. The
``eager`` inner compiler (the FX graph's own Python code) keeps this fast.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import socket
import textwrap

import pytest
from models import EDITABLE_SOURCE

PRELUDE = textwrap.dedent(
    """
    import dataclasses, logging, os, sys, warnings
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, same, stats, programs
    """
)


def child(code: str) -> str:
    return PRELUDE + textwrap.dedent(code)


# ---------------------------------------------------------------------------
# every model kind, cold then warm
# ---------------------------------------------------------------------------

#: model -> graphs Dynamo makes of it; "closure" is a plain function from a factory
MODELS = {"mlp": 1, "helper": 1, "constants": 1, "dataclass": 1, "gpt": 1, "closure": 1, "defaults": 1, "graph_break": 2}
# sizes >= 2 only: a size-1 dim is specialized by Dynamo (0/1 specialization) and needs a variant of its own
GPT_SHAPES = {"cold": [(2, 16), (3, 9)], "warm": [(2, 16), (5, 3), (4, 30), (3, 2)]}

MODELS_CHILD = f"""
from models import build
PHASE = os.environ["PHASE"]
ROOT = os.environ["ROOT"]

def factory(bias):
    def fn(x):
        return torch.tanh(x) * 2.0 + bias
    return fn

class Defaults(torch.nn.Module):  # defaults, keywords and keyword-only arguments, as cache_compile(self.inner)
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.cached = tcb.cache_compile(self.inner, cache_dir=ROOT, compiler="eager")

    def inner(self, x, scale=2.0, *, shift=1.0):
        return self.lin(x) * scale + shift

bias = torch.full((8,), float(os.environ["BIAS"]))
out, dynamo, paths = {{}}, {{}}, {{}}
with torch.no_grad():
    for name in {list(MODELS)!r}:  # graph_break last: its forward itself imports torch._dynamo
        if name == "closure":
            fn = factory(bias)
            x = torch.randn(4, 8)
            c = tcb.cache_compile(fn, cache_dir="rel_cache", compiler="eager")  # relative: under the cwd
            ok = same(c(x), torch.tanh(x) * 2.0 + bias)
        elif name == "defaults":
            m, x = Defaults(), torch.randn(4, 8)
            c = m.cached
            calls = [((x,), {{}}), ((x, 2.0), {{}}), ((), {{"x": x}}), ((x,), {{"scale": 2.0, "shift": 1.0}})]
            ok = all(same(c(*a, **k), m.inner(*a, **k)) for a, k in calls)
        elif name == "gpt":
            m, _ = build(name)
            c = tcb.cache_compile(m.forward, compiler="eager")  # the default .torchair_cache under the cwd
            ok = all(same(c(i), m(i)) for s in {GPT_SHAPES!r}[PHASE] for i in [torch.randint(0, 100, s)])
        else:
            m, x = build(name)
            c = tcb.cache_compile(m.forward, cache_dir=ROOT, compiler="eager")
            got = c(x)
            ok = same(got, m(x)) and type(got) is type(m(x))
        out[name] = ok
        dynamo[name] = "torch._dynamo" in sys.modules
        paths[name] = [c.cache_path, programs(c.cache_path)]
emit({{"same": out, "dynamo": dynamo, "paths": paths, "stats": stats(), "frames": frames(), "logs": LOGS}})
"""


def test_models_cold_then_warm(run, tmp_path):
    root = str(tmp_path / "abs_cache")
    env = {"ROOT": root, "BIAS": "1.0"}
    cold = run(child(MODELS_CHILD), env=dict(env, PHASE="cold"), cwd=str(tmp_path))
    assert all(cold["same"].values()), cold["same"]
    assert cold["stats"]["misses"] == sum(MODELS.values()) and cold["frames"] == sum(MODELS.values())
    for name, (path, progs) in cold["paths"].items():
        assert len(progs) == 1, (name, path)
    # ${cache_dir}/${model_info}/${func}: absolute, relative to the cwd, and the default
    info, func = os.path.relpath(cold["paths"]["mlp"][0], root).split(os.sep)
    assert info.startswith("MLP_dynamic_") and func == "forward"
    info, func = os.path.relpath(cold["paths"]["closure"][0], tmp_path / "rel_cache").split(os.sep)
    assert info.startswith("factory_dynamic_") and func == "fn"
    info, func = os.path.relpath(cold["paths"]["gpt"][0], tmp_path / ".torchair_cache").split(os.sep)
    assert info.startswith("GPT_dynamic_") and func == "forward"

    # warm: new closure values (same shapes) must be read from the live function's cells
    warm = run(child(MODELS_CHILD), env=dict(env, PHASE="warm", BIAS="5.0"), cwd=str(tmp_path))
    assert all(warm["same"].values()), warm["same"]
    s = warm["stats"]
    assert (s["bypass_loads"], s["hits"], s["misses"], s["uncached"]) == (len(MODELS), sum(MODELS.values()), 0, 0), s
    assert warm["frames"] == 0, "the warm process compiled a frame"
    assert not any(v for k, v in warm["dynamo"].items() if k != "graph_break"), warm["dynamo"]
    assert not any("runs eagerly" in line for line in warm["logs"]), warm["logs"]
    assert warm["paths"] == cold["paths"]


# ---------------------------------------------------------------------------
# static entries: a recompile adds a variant; a warm start serves every variant
# and compiles (never raises) what no variant fits
# ---------------------------------------------------------------------------


def test_static_recompile_keeps_variants_and_warm_compiles_new_inputs(run, tmp_path):
    """torchair drops its cache when Dynamo recompiles (it cannot tell variants apart);
    ours keeps each variant behind its own guards. A warm start replays all of them,
    and an input none fits is compiled (and cached), never an InputSignatureError."""
    code = child(
        f"""
        from models import build
        m, x = build("mlp")
        x7, x9 = torch.randn(7, 16), torch.randn(9, 16)
        a = tcb.cache_compile(m.forward, cache_dir={str(tmp_path / "a")!r}, compiler="eager", dynamic=False)
        assert "_static_" in a.cache_path
        res = {{}}
        with torch.no_grad():
            res["x"] = same(a(x), m(x))
            res["x7"] = same(a(x7), m(x7))  # a recompile: a second variant
            replayed = frames() == 0
            if os.environ["PHASE"] == "warm":
                res["x9"] = same(a(x9), m(x9))  # no variant fits: compiled, not refused
        res["grad"] = same(a(x), m(x).detach())  # torchair's semantics: runs under no_grad
        res["no_grad_out"] = not a(x).requires_grad
        emit({{"res": res, "replayed": replayed, "programs": programs(a.cache_path), "stats": stats(),
               "frames": frames(), "logs": LOGS}})
        """
    )
    cold = run(code, env={"PHASE": "cold"})
    assert all(cold["res"].values()), cold["res"]
    assert cold["frames"] == 2 and len(cold["programs"]) == 1
    assert any("recompiled" in line and "2 variants" in line for line in cold["logs"]), cold["logs"]

    warm = run(code, env={"PHASE": "warm"})
    assert all(warm["res"].values()), warm["res"]
    assert warm["replayed"], "both cached variants must replay without Dynamo"
    assert warm["stats"]["bypass_loads"] == 1 and warm["stats"]["fallbacks"] == 1, warm["stats"]
    assert any("no cached variant fits" in line and "[9, 16]" in line for line in warm["logs"]), warm["logs"]


# ---------------------------------------------------------------------------
# staleness: edited source, changed parameter shapes
# ---------------------------------------------------------------------------



def test_edited_forward_rebuilds(run, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "editable_cc.py").write_text(EDITABLE_SOURCE)
    code = child(
        f"""
        sys.path.insert(0, {str(src)!r})
        import editable_cc
        m, x = editable_cc.Edited().eval(), torch.ones(2, 4)
        c = tcb.cache_compile(m.forward, cache_dir={str(tmp_path / "cache")!r}, compiler="eager")
        with torch.no_grad():
            y = c(x)
            ok = same(y, m(x))
        emit({{"ok": ok, "y": y.tolist(), "stats": stats(), "frames": frames(), "logs": LOGS, "path": c.cache_path}})
        """
    )
    env = {"PYTHONDONTWRITEBYTECODE": "1"}  # an edit within the same second must not hit a stale .pyc
    cold = run(code, env=env)
    assert cold["ok"] and cold["frames"] == 1

    (src / "editable_cc.py").write_text(EDITABLE_SOURCE.replace("return helper(self.lin(x))", "return helper(self.lin(x)) - 10.0"))
    warm = run(code, env=env)
    assert warm["path"] == cold["path"]
    assert warm["ok"], "the warm process must run the edited forward"
    assert warm["y"] != cold["y"]
    assert warm["stats"]["bypass_loads"] == 0 and warm["frames"] == 1
    assert any("Edited.forward" in line and "edited" in line for line in warm["logs"]), warm["logs"]
    programs = os.listdir(os.path.join(warm["path"], "programs"))
    assert len([p for p in programs if not p.startswith(".")]) == 1, "the stale program must be removed"


def test_changed_parameter_shape_rebuilds(run, tmp_path):
    code = child(
        f"""
        class Proj(torch.nn.Module):
            def __init__(self, n):
                super().__init__()
                self.w = torch.nn.Parameter(torch.randn(n, 4))  # not in repr(): same model_info dir

            def forward(self, x):
                return x @ self.w.t()

        torch.manual_seed(0)
        m, x = Proj(int(os.environ["N"])), torch.ones(2, 4)
        c = tcb.cache_compile(m.forward, cache_dir={str(tmp_path / "cache")!r}, compiler="eager")
        with torch.no_grad():
            y = c(x)
            ok = same(y, m(x))
        emit({{"ok": ok, "shape": list(y.shape), "stats": stats(), "frames": frames(), "logs": LOGS, "path": c.cache_path}})
        """
    )
    cold = run(code, env={"N": "4"})
    assert cold["ok"] and cold["shape"] == [2, 4] and cold["frames"] == 1
    warm = run(code, env={"N": "6"})
    assert warm["path"] == cold["path"]
    assert warm["ok"] and warm["shape"] == [2, 6]
    assert warm["stats"]["bypass_loads"] == 0 and warm["frames"] == 1
    assert any("param:w" in line and "changed" in line for line in warm["logs"]), warm["logs"]
    # both parameter shapes now have a variant in the one program: each start replays its own
    again = run(code, env={"N": "4"})
    assert again["ok"] and again["stats"]["bypass_loads"] == 1 and again["frames"] == 0, again["stats"]


# ---------------------------------------------------------------------------
# what cache_compile refuses
# ---------------------------------------------------------------------------


def test_rng_ops_are_rejected_at_compile_time(run, cache_dir):
    out = run(
        child(
            f"""
            class Drop(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.lin = torch.nn.Linear(4, 4)
                    self.drop = torch.nn.Dropout(0.5)

                def forward(self, x):
                    return self.drop(self.lin(x))

            def noisy(x):
                return x + torch.randn(x.shape)

            def bernoulli(x):
                return torch.bernoulli(torch.sigmoid(x))

            res = {{}}
            x = torch.ones(2, 4)
            for name, fn in [("randn", noisy), ("bernoulli", bernoulli), ("dropout_train", Drop().train().forward),
                             ("dropout_eval", Drop().eval().forward)]:
                c = tcb.cache_compile(fn, cache_dir={cache_dir!r}, compiler="eager")
                try:
                    with torch.no_grad():
                        c(x)
                    res[name] = None
                except Exception as e:
                    res[name] = str(e)
            emit({{"res": res, "stats": stats()}})
            """
        )
    )
    r = out["res"]
    for name, op in [("randn", "torch.randn"), ("bernoulli", "bernoulli"), ("dropout_train", "dropout")]:
        assert r[name] is not None, f"{name} must be rejected"
        assert "RNGOpError" in r[name] and "random number generator" in r[name] and op in r[name], r[name]
    assert r["dropout_eval"] is None, "dropout in eval mode uses no RNG and must be cached"
    assert out["stats"]["misses"] == 1


class CompilerConfig:
    """Stands in for torchair's CompilerConfig (its class name is what is checked)."""

    def __init__(self, mode: str = "max-autotune") -> None:
        self.mode = mode


def fake_npu_backend(gm, example_inputs, compiler_config=None):
    """Stands in for torchair's backend function; get_npu_backend() is a partial of it."""
    return gm


def test_config_backend_mismatch_and_backend_config():
    from torchair_cached_backend import cache_compile

    def fn(x):
        return x + 1

    max_autotune, reduce_overhead = CompilerConfig("max-autotune"), CompilerConfig("reduce-overhead")
    backend = functools.partial(fake_npu_backend, compiler_config=reduce_overhead)
    with pytest.raises(ValueError, match="config in current backend is different"):
        cache_compile(fn, config=max_autotune, backend=backend, compiler="eager")
    # same config: fine; only a backend: its config is the config (aclgraph mode tags the dir)
    both = cache_compile(fn, config=reduce_overhead, backend=backend, compiler="eager", cache_dir="/tmp/x")
    only_backend = cache_compile(fn, backend=backend, compiler="eager", cache_dir="/tmp/x")
    plain = cache_compile(fn, compiler="eager", cache_dir="/tmp/x")
    assert both.cache_path == only_backend.cache_path
    assert "_aclgraphcache_" in os.path.basename(os.path.dirname(only_backend.cache_path))
    assert "aclgraphcache" not in plain.cache_path
    # an equal-valued config (another object) is accepted as well
    cache_compile(fn, config=CompilerConfig("reduce-overhead"), backend=backend, compiler="eager")
    with pytest.raises(TypeError, match="unexpected keyword"):
        cache_compile(fn, compiler="eager", full_graph=True)
    with pytest.raises(TypeError, match="fullgraph"):
        cache_compile(fn, compiler="eager", fullgraph="yes")
    assert cache_compile(fn, compiler="eager", fullgraph=True)._fullgraph is True  # as vllm-ascend passes it
    # ge_cache: GE (max-autotune) only; a tag in model_info, refused by non-GE compilers, dropped in aclgraph modes
    with pytest.raises(ValueError, match="ge_cache"):
        cache_compile(fn, ge_cache=True, compiler="eager")
    ge = cache_compile(fn, config=max_autotune, ge_cache=True, compiler="torchair", cache_dir="/tmp/x")
    assert "_static_" not in ge.cache_path and "_dynamic_gecache_" in ge.cache_path
    acl = cache_compile(fn, backend=backend, ge_cache=True, compiler="torchair", cache_dir="/tmp/x")
    assert "gecache" not in acl.cache_path and "_aclgraphcache_" in acl.cache_path


# ---------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------


def test_cache_path_layout(tmp_path, monkeypatch):
    from torchair_cached_backend import cache_compile

    class Net:  # the owner of a bound method names model_info
        def step(self, x):
            return x

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHAIR_CACHE_HOME", raising=False)
    net = Net()

    def parts(path, root):
        return os.path.relpath(path, root).split(os.sep)

    absolute = cache_compile(net.step, cache_dir=str(tmp_path / "abs"), compiler="eager", dynamic=False)
    info, func = parts(absolute.cache_path, tmp_path / "abs")
    assert info.startswith("Net_static_") and func == "step"
    relative = cache_compile(net.step, cache_dir="rel", compiler="eager")
    info, func = parts(relative.cache_path, tmp_path / "rel")
    assert info.startswith("Net_dynamic_") and func == "step"
    default = cache_compile(net.step, compiler="eager")
    assert parts(default.cache_path, tmp_path / ".torchair_cache")[1:] == ["step"]
    monkeypatch.setenv("TORCHAIR_CACHE_HOME", str(tmp_path / "home"))
    home = cache_compile(net.step, compiler="eager")
    assert parts(home.cache_path, tmp_path / "home")[1:] == ["step"]
    explicit = cache_compile(net.step, cache_dir=str(tmp_path / "abs"), compiler="eager")
    assert parts(explicit.cache_path, tmp_path / "abs")[1:] == ["step"], "cache_dir wins over TORCHAIR_CACHE_HOME"
    # static and dynamic never share a directory; tp/pp ranks get their own without torch.distributed
    assert os.path.dirname(absolute.cache_path) != os.path.dirname(explicit.cache_path)
    ranked = cache_compile(net.step, cache_dir="rel", compiler="eager", tp_rank=1, pp_rank=0)
    assert parts(ranked.cache_path, tmp_path / "rel")[1:] == ["tp_rank1_pp_rank0", "step"]
    # another instance of a class with the default repr (an address) shares the entry
    assert cache_compile(Net().step, cache_dir="rel", compiler="eager").cache_path == relative.cache_path
    # nothing is created before the first call
    assert not os.path.exists(tmp_path / "rel") and not os.path.exists(tmp_path / ".torchair_cache")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_path_layout_with_torch_distributed(run, tmp_path):
    port = _free_port()
    root = str(tmp_path / "cache")
    code = child(
        f"""
        import torch.distributed as dist
        from models import build
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        m, x = build("mlp")
        c = tcb.cache_compile(m.forward, cache_dir={root!r}, compiler="eager", tp_rank=rank, pp_rank=0)
        explicit = tcb.cache_compile(m.forward, cache_dir={root!r}, compiler="eager", global_rank=7)
        with torch.no_grad():
            ok = same(c(x), m(x))
        dist.barrier()
        dist.destroy_process_group()
        emit({{"ok": ok, "path": c.cache_path, "programs": programs(c.cache_path), "explicit": explicit.cache_path}})
        """
    )
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run, code, env=dict(env, RANK=str(r)), timeout=180) for r in (0, 1)]
        results = [f.result() for f in futures]
    for rank, out in enumerate(results):
        info, rank_dir, func = os.path.relpath(out["path"], root).split(os.sep)
        assert info.startswith("MLP_dynamic_") and func == "forward"
        assert rank_dir == f"world2global_rank{rank}_tp_rank{rank}_pp_rank0"
        assert out["ok"] and len(out["programs"]) == 1
        assert os.path.relpath(out["explicit"], root).split(os.sep)[1] == "world2global_rank7"
    assert results[0]["path"] != results[1]["path"]


# ---------------------------------------------------------------------------
# custom_decompositions
# ---------------------------------------------------------------------------


def test_custom_decompositions(run, cache_dir):
    out = run(
        child(
            f"""
            from torch._decomp import get_decompositions, register_decomposition

            # the reference page's example, verbatim but for the import and compiler="eager"
            @register_decomposition(torch.ops.aten.add.default)
            def test_add_decomp(t1, t2):
                return t1 + t2

            class Model(torch.nn.Module):
                def __init__(self, **kwargs):
                    super().__init__()
                    self.cached = tcb.cache_compile(self.inner_forward, cache_dir={cache_dir!r}, compiler="eager", **kwargs)

                def inner_forward(self, t1, t2):
                    return torch.ops.aten.add(t1, t2)

                def forward(self, t1, t2):
                    return self.cached(t1, t2)

            reference_table = get_decompositions([torch.ops.aten.add.default])
            t1, t2 = torch.randn(3), torch.randn(3)
            res = {{}}
            with torch.no_grad():
                m = Model(custom_decompositions=reference_table)
                res["reference"] = [same(m(t1, t2), t1 + t2), len(reference_table), m.cached.cache_path]
                # two real, different tables for aten.add.Tensor (private registries, nothing global)
                table_a, table_b = {{}}, {{}}
                register_decomposition(torch.ops.aten.add.Tensor, registry=table_a)(lambda a, b: torch.sub(a, -b))
                register_decomposition(torch.ops.aten.add.Tensor, registry=table_b)(lambda a, b: a - (-1) * b)
                for name, table in [("a", table_a), ("b", table_b), ("a_again", table_a)]:
                    mm = Model(custom_decompositions=table)
                    res[name] = [same(mm(t1, t2), t1 + t2), len(table), mm.cached.cache_path]
            import json
            def graph_decomps(path):
                d = os.path.join(path, "graphs")
                return [json.load(open(os.path.join(d, k, "manifest.json")))["factors"]["decompositions"]
                        for k in sorted(os.listdir(d)) if not k.startswith(".")]
            emit({{"res": res, "graph_decomps": {{k: graph_decomps(v[2]) for k, v in res.items()}}, "stats": stats()}})
            """
        )
    )
    r, g = out["res"], out["graph_decomps"]
    assert all(v[0] for v in r.values()), r
    # on stock PyTorch aten.add.default (Scalar+Scalar) has no dispatcher kernel, so
    # register_decomposition skips it and the reference example's table is empty
    assert r["reference"][1] == 0 and g["reference"] == [None]
    assert r["a"][1] == r["b"][1] == 1
    assert r["a"][2] != r["b"][2] != r["reference"][2], "different tables must give different entries"
    assert r["a_again"][2] == r["a"][2], "the same table must give the same entry"
    assert g["a"] != g["b"] and g["a"][0] is not None and "aten.add.Tensor" in g["a"][0]
    # a_again is a fresh cache_compile of the same table: served from `a`'s entry
    assert (out["stats"]["misses"], out["stats"]["bypass_loads"], out["stats"]["hits"]) == (3, 1, 1)
