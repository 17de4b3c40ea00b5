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
