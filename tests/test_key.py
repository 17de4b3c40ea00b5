"""One test per key factor: each one changes the graph key."""

from __future__ import annotations

import pytest
import torch

import torchair_cached_backend.key as keys
from torchair_cached_backend import environment
from torchair_cached_backend.compilers import get_compiler
from torchair_cached_backend.options import parse_options


def _capture(fn, *args, dynamic=False):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    return graphs[0]


def _key(gm, inputs, compiler="eager", grad=False, **opts):
    options = parse_options({"compiler": compiler, **opts})
    return keys.compute_key(gm, inputs, get_compiler(compiler), options, grad)


def f(x):
    return (x * 2).sin()


def g(x):
    return (x * 2).cos()


@pytest.fixture
def base():
    gm, inputs = _capture(f, torch.ones(4, 3))
    return gm, inputs, _key(gm, inputs)[0]


def test_key_is_deterministic_across_traces(base):
    gm, inputs, key = base
    gm2, inputs2 = _capture(f, torch.ones(4, 3))
    assert _key(gm2, inputs2)[0] == key


def test_graph_changes_key(base):
    gm, inputs = _capture(g, torch.ones(4, 3))
    assert _key(gm, inputs)[0] != base[2]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.ones(4, 3, dtype=torch.float64),  # dtype
        torch.ones(5, 3),  # shape
        torch.ones(3, 4).t(),  # stride
        torch.ones(4, 3, device="meta"),  # device
    ],
    ids=["dtype", "shape", "stride", "device"],
)
def test_input_metadata_changes_key(base, tensor):
    gm, inputs = _capture(f, tensor)
    assert _key(gm, inputs)[0] != base[2]


def test_requires_grad_changes_key(base):
    gm, inputs, key = base
    assert _key(gm, [inputs[0].clone().requires_grad_(True)])[0] != key


def test_symbolic_shape_changes_key(base):
    gm, inputs = _capture(f, torch.ones(4, 3), dynamic=True)
    key, factors = _key(gm, inputs)
    assert key != base[2]
    assert any(isinstance(d, str) for d in factors["inputs"][-1]["shape"])


def test_compiler_changes_key(base):
    gm, inputs, key = base
    assert _key(gm, inputs, compiler="inductor")[0] != key


def test_compiler_options_change_key(base, monkeypatch):
    gm, inputs, key = base
    compiler = get_compiler("eager")
    monkeypatch.setattr(compiler, "hash_factors", lambda options: {"codegen": "other"})
    assert _key(gm, inputs)[0] != key


def test_torchair_config_changes_key(base):
    gm, inputs, key = base

    class CompilerConfig:  # stands in for torchair's; real torchair is tested in tests/torchair
        def __init__(self, mode):
            self.mode = mode

    a = keys.compute_key(gm, inputs, get_compiler("eager"), parse_options({"compiler": "eager", "config": CompilerConfig("max-autotune")}), False)
    b = keys.compute_key(gm, inputs, get_compiler("eager"), parse_options({"compiler": "eager", "config": CompilerConfig("reduce-overhead")}), False)
    assert a[0] != b[0] != key


def test_custom_decompositions_change_key(base):
    gm, inputs, key = base

    def decomp_a(t1, t2):
        return t1 + t2

    def decomp_b(t1, t2):
        return t1 - t2

    ka = _key(gm, inputs, custom_decompositions={torch.ops.aten.add.default: decomp_a})[0]
    kb = _key(gm, inputs, custom_decompositions={torch.ops.aten.add.default: decomp_b})[0]
    assert key != ka != kb


def test_grad_mode_changes_key(base):
    gm, inputs, key = base
    assert _key(gm, inputs, grad=True)[0] != key


@pytest.mark.parametrize("factor", ["python", "torch", "torch_npu", "torchair", "cann"])
def test_environment_versions_change_key(base, monkeypatch, factor):
    gm, inputs, key = base
    real = environment.environment_factors()
    monkeypatch.setattr(keys, "environment_factors", lambda: dict(real, **{factor: "9.9.9"}))
    new_key, factors = _key(gm, inputs)
    assert new_key != key and factors["environment"][factor] == "9.9.9"


def test_cann_version_is_read_from_env(monkeypatch):
    environment.cann_version.cache_clear()
    monkeypatch.setenv("TCB_CANN_VERSION", "8.1.RC1")
    try:
        assert environment.environment_factors()["cann"] == "8.1.RC1"
    finally:
        environment.cann_version.cache_clear()


def test_format_version_changes_key(base, monkeypatch):
    gm, inputs, key = base
    monkeypatch.setattr(keys, "FORMAT_VERSION", keys.FORMAT_VERSION + 1)
    assert _key(gm, inputs)[0] != key


def test_constant_tensor_values_change_key():
    def make(v):
        gm, inputs = _capture(f, torch.ones(2))
        gm.register_buffer("_const", torch.full((2,), v))
        node = gm.graph.get_attr("_const")
        del node  # the get_attr node is enough for the key to see the constant
        return _key(gm, inputs)[0]

    assert make(1.0) != make(2.0)


def test_explain_difference_names_the_factor(base):
    gm, inputs, _ = base
    _, a = _key(gm, inputs)
    gm64, inputs64 = _capture(f, torch.ones(4, 3, dtype=torch.float64))
    _, b = _key(gm64, inputs64)
    diffs = keys.explain_difference(a, b)
    assert any(d.startswith("inputs") for d in diffs)


# ----------------------------------------------------------------- issue 8.5 / issue 11 factors
def test_context_factors_are_the_top_level_of_the_key(base):
    gm, inputs, _ = base
    compiler = get_compiler("eager")
    options = parse_options({"compiler": "eager"})
    _, factors = keys.compute_key(gm, inputs, compiler, options, False)
    context = keys.context_factors(compiler, options)
    assert context and all(factors[k] == v for k, v in context.items())
    runtime = keys.runtime_state_factors()
    assert set(runtime) <= set(factors) and set(runtime) >= {"grad_enabled", "autocast", "default_dtype", "deterministic"}


def test_context_factors_do_not_import_dynamo_or_inductor(run):
    out = run(
        """
        import sys, time
        import torchair_cached_backend.key as keys
        from torchair_cached_backend.compilers import get_compiler
        from torchair_cached_backend.options import parse_options
        for name in ("eager", "inductor"):
            c, o = get_compiler(name), parse_options({"compiler": name})
            first = keys.context_factors(c, o)
            t0 = time.perf_counter()
            for _ in range(100):
                assert keys.context_factors(c, o) == first
            keys.runtime_state_factors()
        emit({"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules,
              "us": (time.perf_counter() - t0) / 100 * 1e6})
        """
    )
    assert not out["dynamo"] and not out["inductor"]


def test_autocast_changes_key(base):
    gm, inputs, key = base
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _key(gm, inputs)[0] != key
    with torch.autocast("cpu", dtype=torch.float16):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = _key(gm, inputs)[0]
        assert _key(gm, inputs)[0] not in (key, bf16)


def test_default_dtype_changes_key(base):
    gm, inputs, key = base
    torch.set_default_dtype(torch.float64)
    try:
        assert _key(gm, inputs)[0] != key
    finally:
        torch.set_default_dtype(torch.float32)


def test_deterministic_algorithms_change_key(base):
    gm, inputs, key = base
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        warn_only = _key(gm, inputs)[0]
        torch.use_deterministic_algorithms(True)
        assert _key(gm, inputs)[0] not in (key, warn_only) and warn_only != key
    finally:
        torch.use_deterministic_algorithms(False)


def _cond_sin(x):
    return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))


def _cond_exp(x):
    return torch.cond(x.sum() > 0, lambda x: x.exp() * 100, lambda x: x.cos(), (x,))


def test_cond_branch_subgraphs_change_key():
    a, ia = _capture(_cond_sin, torch.ones(4))
    b, ib = _capture(_cond_exp, torch.ones(4))
    assert [n.target for n in a.graph.nodes] == [n.target for n in b.graph.nodes]  # same outer graph
    assert _key(a, ia)[0] != _key(b, ib)[0]
    assert "subgraphs" in keys.graph_factors(a)


def test_decompositions_by_bound_values(base):
    """Two partials of one function (or one function with other defaults) are other decompositions."""
    import functools

    gm, inputs, _ = base

    def scaled(t1, t2, *, k):
        return t1 + k * t2

    op = torch.ops.aten.add.default
    k1 = _key(gm, inputs, custom_decompositions={op: functools.partial(scaled, k=1)})[0]
    k2 = _key(gm, inputs, custom_decompositions={op: functools.partial(scaled, k=2)})[0]
    assert k1 != k2


def test_dim_gears_and_parameters_are_input_factors(base):
    gm, inputs, key = base
    x = inputs[0].clone()
    x.dim_gears = {0: [2, 4]}  # what torchair.inference.set_dim_gears sets
    k24 = _key(gm, [x])[0]
    x.dim_gears = {0: [2, 4, 8]}
    assert len({key, k24, _key(gm, [x])[0]}) == 3
    assert _key(gm, [torch.nn.Parameter(inputs[0].clone(), requires_grad=False)])[0] != key


def test_config_none_equals_default_config(base):
    from torchair_cached_backend.torchair_config import normalized_config_snapshot

    class CompilerConfig:  # stands in for torchair's (tests/torchair use the real one)
        def __init__(self):
            self.mode = "max-autotune"

    gm, inputs, key = base
    assert normalized_config_snapshot(CompilerConfig()) is None
    assert _key(gm, inputs, config=CompilerConfig())[0] == key
    other = CompilerConfig()
    other.mode = "reduce-overhead"
    assert _key(gm, inputs, config=other)[0] != key


def test_custom_passes_by_code_and_bound_values():
    import functools

    from torchair_cached_backend.torchair_config import config_snapshot

    def swap(gm, to):
        return to

    class Swap:
        def __init__(self, to):
            self.to = to

        def __call__(self, gm):
            return self.to

    class Config:
        def __init__(self, post_pass):
            self.post_grad_custom_post_pass = post_pass

    snaps = [config_snapshot(Config(p)) for p in (
        functools.partial(swap, to="relu"), functools.partial(swap, to="sigmoid"), Swap("relu"), Swap("sigmoid"),
    )]
    assert len({keys.canonical_json(s) for s in snaps}) == 4
    # the same settings describe alike (no ids or addresses)
    assert config_snapshot(Config(functools.partial(swap, to="relu"))) == snaps[0]


def test_frozen_module_tensors_are_listed_for_the_loader():
    """Under Inductor's freezing Dynamo keeps parameters as graph constants: the key holds
    their values, and ``module_tensors`` names them for the bypass loader."""
    import torch._inductor.config as inductor_config

    m = torch.nn.Linear(3, 2).eval()
    old_weight = m.weight.detach().clone()
    with inductor_config.patch(freezing=True), torch.no_grad():
        gm, inputs = _capture(m, torch.ones(1, 3))
        key, factors = _key(gm, inputs)
        m.weight.add_(1)  # a new checkpoint
        gm2, inputs2 = _capture(m, torch.ones(1, 3))
        key2, _ = _key(gm2, inputs2)
    assert set(factors["module_tensors"]) == {"weight", "bias"}
    assert factors["module_tensors"]["weight"] == keys.tensor_digest(old_weight)
    assert key != key2


def test_a_directory_named_like_torchair_on_sys_path_is_no_install(tmp_path, monkeypatch):
    # a bare ``torchair/`` directory on sys.path (a checkout's tests/torchair, a working directory) is a
    # namespace package, not torchair: no metadata scan (~1 ms of every warm start), and no version
    import importlib
    import sys

    from torchair_cached_backend import environment

    (tmp_path / "torchair").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    scans = []
    monkeypatch.setattr(environment, "_dist_version", lambda name: scans.append(name))
    monkeypatch.delitem(sys.modules, "torchair", raising=False)
    assert not environment._installed("torchair")
    environment.torchair_version.cache_clear()
    environment.torch_npu_version.cache_clear()
    try:
        assert environment.torchair_version() is None and scans == []
        (tmp_path / "torchair" / "__init__.py").write_text("")  # a real package is one
        importlib.invalidate_caches()
        assert environment._installed("torchair")
    finally:
        environment.torchair_version.cache_clear()
        environment.torch_npu_version.cache_clear()
