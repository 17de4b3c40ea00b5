"""Methods Dynamo compiled as frames of their own (a graph break inside them) are replayed
at warm wherever the model calls them, not run as plain Python (uncounted eager):

* a submodule's forward under decorators that reach it through closure cells (no
  ``__wrapped__``), called at a graph break of its parent (``load()``);
* the other layers of a ``ModuleList`` whose first layer's forward Dynamo compiled and
  whose others it served from its own cache (nothing recorded them at cold);
* a root forward under a ``wrapped(*args, **kwargs)`` decorator (transformers'
  ``deprecate_kwarg``) in which Dynamo compiled nothing;
* a callee's load-time guards are evaluated at its first call, as Dynamo evaluates them at
  the frame's entry (its caller sets module state before calling it);
* under the backend route (``guards="call"``) every layer's continuation after its graph
  break replays, not only the first layer's.

Cold and warm run in fresh processes; one cold process fills every model's cache.
"""

from __future__ import annotations

import pytest
from subprocess_helpers import run_python

pytestmark = pytest.mark.timeout(600)

MODELS = r'''
import functools, os
import torch
import torchair_cached_backend as tcb
from torch._dynamo.utils import counters


class Broken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.k = 2  # an int attribute: Dynamo specializes on it

    def forward(self, x):
        y = torch.relu(self.a(x))
        print("", end="")  # a graph break
        return self.b(y) * self.k


def closure_deco(fn):  # reaches the method through its cell only (no functools.wraps)
    def outer(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return outer


def varargs_deco(fn):  # transformers' deprecate_kwarg: wrapped(*args, **kwargs)
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapped


class ClosureDecorated(Broken):
    @closure_deco
    @closure_deco
    def forward(self, x):
        y = torch.relu(self.a(x))
        print("", end="")
        return self.b(y) * 2


class Parent(torch.nn.Module):
    """Two decorated submodules, each called at a graph break of the parent."""

    def __init__(self):
        super().__init__()
        self.pre = torch.nn.Linear(8, 8)
        self.sub = ClosureDecorated()
        self.sub2 = ClosureDecorated()

    def forward(self, x):
        return self.sub2(self.sub(self.pre(x) + 1)) * 3


class Loop(torch.nn.Module):
    """A graph break in the loop over blocks: Dynamo skips this frame and compiles the first
    block's forward; the other blocks run Dynamo's cached code (no recompile)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Broken() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            print("", end="")
        return x


class VarargsRoot(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.inner = Broken()

    @varargs_deco
    def forward(self, x):
        return self.inner(self.a(x)) * 2


class Flags:
    scale = None


FLAGS = Flags()


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.l(x)
        if FLAGS.scale is not None:  # specialized on what the caller set just before the call
            y = y * FLAGS.scale
        print("", end="")
        return y + 1


class SetsState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.child = Scaled()

    def forward(self, x):
        FLAGS.scale = 3.0
        out = self.child(x)
        FLAGS.scale = None
        return out


class Layers(torch.nn.Module):
    """Each layer's forward has a graph break: every layer runs the continuation."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Broken() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Comprehension(torch.nn.Module):
    """Dynamo skips this frame (a graph break in the loop) and compiles the list
    comprehension, a frame of its own in Python 3.11, on its own."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            print("", end="")
        ys = [torch.relu(x * s) for s in (1.0, 2.0, 3.0)]
        return ys[0] + ys[1] + ys[2]


def build(cls):
    torch.manual_seed(0)
    return cls().eval()


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
LOAD = {"parent": Parent, "loop": Loop, "varargs": VarargsRoot, "state": SetsState}
BACKEND = {"layers": Layers, "comprehension": Comprehension}


def run(name, root):
    model = build({**LOAD, **BACKEND}[name])
    want = model(X)
    path = os.path.join(root, name)
    if name in LOAD:
        fn = tcb.load(model, path, compiler="eager")
    else:
        fn = torch.compile(model, backend="npu_cached", options={"cache_dir": path, "compiler": "eager"})
    got, again = fn(X), fn(X)
    return bool(torch.allclose(got, want, atol=1e-5) and torch.allclose(again, want, atol=1e-5))
'''


@pytest.fixture(scope="module")
def cold_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("callee_reach")
    out = run_python(MODELS + r'''
with torch.no_grad():
    ok = {name: run(name, os.environ["ROOT"]) for name in (*LOAD, *BACKEND)}
emit({"ok": ok, "frames": counters["frames"]["total"]})
''', env={"ROOT": str(root)})
    assert all(out["ok"].values()) and out["frames"] > 0, out
    return str(root)


def _warm(root: str, name: str) -> dict:
    out = run_python(MODELS + r'''
with torch.no_grad():
    ok = run(os.environ["NAME"], os.environ["ROOT"])
from torchair_cached_backend.bypass import frame_install
emit({"ok": ok, "frames": counters["frames"]["total"], "stats": tcb.stats().as_dict(),
      "installed": frame_install.counts["installed"]})
''', env={"ROOT": root, "NAME": name})
    assert out["ok"], out
    return out


def test_a_decorated_submodule_forward_replays_under_load(cold_root) -> None:
    """Parent's program, 2 submodules reached through two closure-cell decorators: the parent's
    two graphs and the submodules' two (one program for both: its graphs loaded once,
    ``shared_load``); before, the submodules' forwards ran as plain Python (2 graphs loaded, 1 program)."""
    out = _warm(cold_root, "parent")
    s = out["stats"]
    assert out["frames"] == 0 and s["fallbacks"] == 0, out
    assert s["hits"] == 4 and s["bypass_loads"] == 3, s  # parent + each submodule's replay


def test_every_layer_of_a_module_list_replays_not_only_the_recorded_one(cold_root) -> None:
    out = _warm(cold_root, "loop")
    s = out["stats"]
    assert out["frames"] == 0 and s["fallbacks"] == 0, out
    assert s["bypass_loads"] == 4, s  # the skipped root and each of the 3 blocks (before: 2)


def test_a_root_under_a_varargs_wrapper_dynamo_compiled_nothing_in_replays(cold_root) -> None:
    """Before: the wrapper's frame was not recorded (its receiver is ``args[0]``), so the
    warm start found no program for the model and traced everything again."""
    out = _warm(cold_root, "varargs")
    s = out["stats"]
    assert out["frames"] == 0 and s["fallbacks"] == 0 and s["misses"] == 0, out
    assert s["bypass_loads"] >= 2, s


def test_a_callees_load_time_guards_are_checked_when_it_is_first_called(cold_root) -> None:
    """The child was traced with ``FLAGS.scale == 3.0``, set by its caller just before the
    call; checked when the caller's replay was built (before it ran), the guard failed and
    the child was compiled again at every warm start (a fallback)."""
    out = _warm(cold_root, "state")
    s = out["stats"]
    assert out["frames"] == 0 and s["fallbacks"] == 0 and s["misses"] == 0, out


def test_every_layers_continuation_replays_on_the_backend_route(cold_root) -> None:
    """One replayed layer code serves all layers (``guards="call"``: no receiver fixed); its
    continuation after the graph break is one module global, which before was routed by
    receiver and ran the other layers' continuations eagerly (a counted fallback)."""
    out = _warm(cold_root, "layers")
    s = out["stats"]
    assert out["frames"] == 0 and s["fallbacks"] == 0, out
    assert s["hits"] >= 2, s


def test_a_comprehension_compiled_on_its_own_is_found_and_counted_on_the_backend_route(cold_root) -> None:
    """Its frame is looked up by its code (there is no function to find it by). Its program
    is not replayable yet (the guard on its iterator argument's type cannot be recorded):
    Dynamo traces it, counted with that reason; before, it was traced uncounted."""
    out = _warm(cold_root, "comprehension")
    s = out["stats"]
    assert out["installed"] == 0 and s["fallback_reasons"] == {"not replayable": 1}, out


def test_an_inferred_layer_whose_checks_fail_is_compiled_not_replayed(cold_root) -> None:
    """A block installed because its sibling was recorded, whose own checks fail (its ``k``
    changed after the cold start): a stand-in compiles it (a counted fallback) and the output
    is the changed model's; the other blocks replay."""
    out = run_python(MODELS + r'''
with torch.no_grad():
    model = build(Loop)
    model.blocks[2].k = 5
    want = model(X)
    fn = tcb.load(model, os.path.join(os.environ["ROOT"], "loop"), compiler="eager")
    got = fn(X)
emit({"ok": bool(torch.allclose(got, want, atol=1e-5)), "stats": tcb.stats().as_dict()})
''', env={"ROOT": cold_root})
    s = out["stats"]
    assert out["ok"], out
    # every block replays; block 2's continuation (k is read after the break) is compiled for k == 5
    assert s["fallbacks"] == 1 and s["misses"] == 1 and s["bypass_loads"] == 4, s


HF_ATTENTION = r'''
import os
import torch
import hf_tiny
import torchair_cached_backend as tcb
from torch._dynamo.utils import counters
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def breaking_sdpa(module, query, key, value, attention_mask, **kwargs):
    torch._dynamo.graph_break()  # e.g. a kernel Dynamo cannot trace: a graph break in every layer
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("breaking_sdpa", breaking_sdpa)
with torch.no_grad():
    model, inputs = hf_tiny.build("llama")
    model.config._attn_implementation = "breaking_sdpa"
    want = model(**inputs).logits
    root = os.environ["ROOT"]
    if os.environ["ROUTE"] == "load":
        fn = tcb.load(model, root, compiler="eager")
    else:
        fn = torch.compile(model, backend="npu_cached", options={"cache_dir": root, "compiler": "eager"})
    got, again = fn(**inputs).logits, fn(**inputs).logits
emit({"ok": bool(torch.allclose(got, want, atol=1e-4) and torch.allclose(again, want, atol=1e-4)),
      "frames": counters["frames"]["total"], "stats": tcb.stats().as_dict()})
'''


@pytest.mark.parametrize("route", ["load", "backend"])
def test_transformers_llama_with_a_graph_break_in_every_layer_replays(tmp_path, route) -> None:
    """transformers' Llama with a registered attention function that breaks the graph: each
    decoder layer and attention forward is a frame of its own, reached through
    ``deprecate_kwarg``/``use_kernelized_func`` wrappers, the root under a
    ``wrapped(*args)`` decorator Dynamo compiled nothing in. Before: ``load()`` found no
    program and traced all 61 frames again at every warm start; the backend route traced 23
    and ran later layers' continuations eagerly (3 fallbacks). The first warm start compiles
    the attention once more (``kernels``' context variable only switches to its global under
    tracing, so the state the cold trace saw is not the state of a replay); from the second
    on, nothing is traced; the attention function itself, called through transformers' registry
    (no name ``load()`` could rebind), runs as Python under ``load()``, counted as such."""
    env = {"ROOT": str(tmp_path), "ROUTE": route}
    cold = run_python(HF_ATTENTION, env=env)
    assert cold["ok"] and cold["frames"] > 20, cold
    first = run_python(HF_ATTENTION, env=env)
    assert first["ok"] and first["stats"]["fallbacks"] <= 2 and first["frames"] < 10, first
    warm = run_python(HF_ATTENTION, env=env)
    s = warm["stats"]
    assert warm["ok"] and warm["frames"] == 0 and s["misses"] == 0, warm
    assert s["bypass_loads"] >= 7, s  # root, model forward, rotary, norm, and per layer its forward and attention
    if route == "backend":  # every frame is Dynamo's to hand over: the attention function replays too
        assert s["fallbacks"] == 0, s
    else:  # the attention function, reached through transformers' registry, runs as Python: said and counted
        from torchair_cached_backend.bypass.loader_callees import UNREACHED

        assert s["fallback_reasons"] == {UNREACHED: 2}, s  # once per load of the attention (2 layers)


def test_a_callee_whose_replay_fails_to_build_is_compiled_inside_the_users_call(cold_root) -> None:
    """A callee's replay is built at its first call, inside the user's: an unexpected error
    there (here injected) is reported and the callee compiled instead, never raised."""
    out = run_python(MODELS + r'''
from torchair_cached_backend.bypass import loader
real = loader.build_replay
def broken(target, options, *a, **k):
    if type(getattr(target, "__self__", None)).__name__ == "Broken":
        raise RuntimeError("injected")
    return real(target, options, *a, **k)
loader.build_replay = broken
with torch.no_grad():
    ok = run("loop", os.environ["ROOT"])
emit({"ok": ok, "stats": tcb.stats().as_dict()})
''', env={"ROOT": cold_root})
    assert out["ok"], out
    assert out["stats"]["fallback_reasons"] == {"other": 3}, out  # each block, compiled instead
