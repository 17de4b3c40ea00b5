"""The layers of a model load one program once: a graph break inside a layer's forward makes
that forward a frame of its own, which Dynamo compiles once per layer index (a constant to
it), so its program holds a variant per layer and every layer loads that program. Before,
each of N layers read, verified and decoded the whole program and built every variant's
checks: O(N^2) work at every warm start (a transformers Llama with a graph break in its
attention: ~12 ms a layer at 8 layers). Now the loads of one program share the verified
entry, decoded code, root checks and loaded graphs (``bypass/shared_load.py``), on both
routes; each layer still evaluates its own load-time guards and replays its own variant.

Cold and warm run in fresh processes; one cold process fills both routes' caches.
"""

from __future__ import annotations

import collections

import pytest
from subprocess_helpers import run_python

pytestmark = pytest.mark.timeout(600)

LAYERS = 6

MODEL = r'''
import collections, os
import torch
import torchair_cached_backend as tcb
from torch._dynamo.utils import counters


class Layer(torch.nn.Module):
    def __init__(self, idx):
        super().__init__()
        self.idx = idx  # an int attribute: Dynamo specializes each layer's forward on it
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.a(x)) * (self.idx + 1)
        print("", end="")  # a graph break: this forward is a frame of its own
        return y + self.idx


class Stack(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(i) for i in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build():
    torch.manual_seed(0)
    return Stack(int(os.environ["LAYERS"])).eval()


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def run(route, root):
    model = build()
    want = model(X)
    if route == "load":
        fn = tcb.load(model, root, compiler="eager")
    else:
        fn = torch.compile(model, backend="npu_cached", options={"cache_dir": root, "compiler": "eager"})
    got, again = fn(X), fn(X)
    return bool(torch.allclose(got, want, atol=1e-5) and torch.allclose(again, want, atol=1e-5))
'''


@pytest.fixture(scope="module")
def cold_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared_load")
    out = run_python(MODEL + r'''
with torch.no_grad():
    ok = {}
    for route in ("load", "backend"):
        torch._dynamo.reset()  # each route's cold compiles stay within Dynamo's recompile limit (8 a frame)
        ok[route] = run(route, os.path.join(os.environ["ROOT"], route))
emit({"ok": ok, "frames": counters["frames"]["total"]})
''', env={"ROOT": str(root), "LAYERS": str(LAYERS)})
    assert all(out["ok"].values()) and out["frames"] > LAYERS, out
    return str(root)


WARM = MODEL + r'''
from torchair_cached_backend import code_codec, store
from torchair_cached_backend.bypass import loader

reads, decoded, checks = collections.Counter(), collections.Counter(), [0]
plain_load, plain_loads_code, plain_build_checks = store.Store.load, code_codec.loads_code, loader.build_checks


def counted_load(self, key):
    reads[f"{self.kind}/{key}"] += 1
    return plain_load(self, key)


def counted_loads_code(data, *args, **kwargs):
    decoded[hash(bytes(data))] += 1
    return plain_loads_code(data, *args, **kwargs)


def counted_build_checks(*args, **kwargs):
    checks[0] += 1
    return plain_build_checks(*args, **kwargs)


store.Store.load, code_codec.loads_code, loader.build_checks = counted_load, counted_loads_code, counted_build_checks
route = os.environ["ROUTE"]
with torch.no_grad():
    ok = run(route, os.path.join(os.environ["ROOT"], route))
emit({"ok": ok, "frames": counters["frames"]["total"], "stats": tcb.stats().as_dict(),
      "reads": dict(reads), "decoded": sorted(decoded.values()), "checks": checks[0]})
'''


@pytest.mark.parametrize("route", ["load", "backend"])
def test_the_layers_of_a_model_read_decode_and_build_one_program_once(cold_root, route) -> None:
    out = run_python(WARM, env={"ROOT": cold_root, "LAYERS": str(LAYERS), "ROUTE": route})
    s = out["stats"]
    assert out["ok"] and out["frames"] == 0 and s["fallbacks"] == 0, out  # every layer replayed its own variant
    programs = collections.Counter(k.split("/")[0] for k in out["reads"])
    assert programs["programs"] >= 2, out  # the root's program and the layers' one
    assert max(out["reads"].values()) == 1, out["reads"]  # no entry read twice (was: the layers' program 6x)
    assert max(out["decoded"]) == 1, out["decoded"]  # no code blob decoded twice
    if route == "load":  # each variant's checks built once for all layers, plus each layer's continuation's
        # own (they hold their receiver): linear in the layers (was 7 per layer at 6 layers: every layer built all)
        assert out["checks"] <= 3 * LAYERS + 2, out["checks"]
    else:  # guards="call" checks a continuation's every guard per call: each layer keeps all of them, each
        # bound to it (from the decoded code and constants the layers share); the roots' built once
        assert out["checks"] <= LAYERS * LAYERS + LAYERS + 2, out["checks"]
    assert s["bypass_loads"] >= LAYERS, s  # each layer still has its own load, with its own load-time guards


def test_a_layer_whose_own_variant_is_missing_is_not_served_anothers(cold_root, tmp_path) -> None:
    """Sharing never lends one layer another's variant: with one more layer than at cold,
    the new layer's checks (its ``idx``) fit no cached variant; it is compiled (a counted
    fallback), and every output is right."""
    out = run_python(WARM, env={"ROOT": cold_root, "LAYERS": str(LAYERS + 1), "ROUTE": "load"})
    s = out["stats"]
    assert out["ok"], out
    assert s["fallbacks"] >= 1 and s["fallback_reasons"].get("guards failed at load", 0) >= 1, s
