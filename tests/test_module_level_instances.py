"""Objects a library binds at module level and a traced method reaches through a closure.

transformers 5.25 with ``kernels`` installed (its dependency) decorates every Llama-style
attention class with ``@use_kernelized_func(apply_rotary_pos_emb)``: the class's forward
becomes a wrapper whose closure holds ``apply_rotary_pos_emb``, an *instance* of a local
``nn.Module`` class that the modeling module binds at top level. Dynamo guards that
instance's identity (``ID_MATCH``); no import name rebuilds an instance, so every such
frame was refused at capture and Llama, Mistral, Qwen2, ... never replayed again.

Now the identity is checked against the object the module binds under that name in the
warm process (``encode_global``): a state that differs (the closure value Dynamo read) or
a rebinding is rebuilt, never replayed; an instance bound nowhere is still refused.
Cold in one fresh process, warm in another, on both warm routes.
"""

from __future__ import annotations

import textwrap

import pytest

LIB = textwrap.dedent(
    """
    import functools, os
    import torch

    def _as_module(scale):
        class Func(torch.nn.Module):  # a local class, as kernels' _create_func_module makes
            def forward(self, x):
                return torch.tanh(x) * scale
        return Func()

    ACT = _as_module(float(os.environ.get("SCALE", "2")))

    def uses(*fns):
        def deco(cls):
            orig = cls.forward
            @functools.wraps(orig)
            def forward(self, x):
                active = {id(fn): fn for fn in fns}  # kernels keys its dispatch table so: Dynamo guards the ids
                for fn in fns:
                    x = active[id(fn)](x)
                return orig(self, x)
            cls.forward = forward
            return cls
        return deco

    class _Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x)

    @uses(ACT)
    class Layer(_Linear):
        pass

    @uses(_as_module(3.0))  # an instance no module binds: its identity cannot be checked elsewhere
    class Unbound(_Linear):
        pass

    if os.environ.get("REBIND") == "1":  # the name now holds another instance than the closure's
        ACT = _as_module(2.0)
    """
)

CHILD = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, os.environ["LIBDIR"])
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, stats
    import kernlib

    m = getattr(kernlib, os.environ["CLASS"])().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        want = m(x)
        opts = {"cache_dir": os.environ["ROOT"], "compiler": "eager"}
        if os.environ["PHASE"] == "cold" or os.environ["ROUTE"] == "backend":
            f = torch.compile(m, backend="npu_cached", options=opts)
        else:
            f = tcb.load(m, os.environ["ROOT"], compiler="eager")
        got = f(x)
    emit({"ok": bool(torch.allclose(got, want)), "frames": frames(), "stats": stats(), "logs": LOGS[-6:]})
    """
)


@pytest.fixture
def lib(tmp_path):
    d = tmp_path / "lib"
    d.mkdir()
    (d / "kernlib.py").write_text(LIB)
    return str(d)


@pytest.mark.parametrize("route", ["load", "backend"])
def test_an_instance_a_module_binds_replays_and_another_state_is_rebuilt(run, tmp_path, lib, route):
    env = {"ROOT": str(tmp_path / "cache"), "LIBDIR": lib, "CLASS": "Layer", "ROUTE": route}
    cold = run(CHILD, env=dict(env, PHASE="cold"))
    assert cold["ok"] and not any("not be replayed" in line for line in cold["logs"]), cold
    same = run(CHILD, env=dict(env, PHASE="warm"))
    assert same["ok"], same
    assert same["frames"] == 0 and same["stats"]["bypass_loads"] == 1 and same["stats"]["fallbacks"] == 0, same

    other = run(CHILD, env=dict(env, PHASE="warm", SCALE="5"))  # the closure value Dynamo read differs
    assert other["ok"], f"the scale-2 program served a scale-5 process: {other['logs']}"
    assert other["frames"] == 1 and other["stats"]["fallbacks"] == 1, other  # traced again, counted

    rebound = run(CHILD, env=dict(env, PHASE="warm", REBIND="1"))  # kernlib.ACT is not the closure's object
    assert rebound["ok"], rebound
    assert rebound["frames"] == 1 and rebound["stats"]["fallbacks"] == 1, rebound


def test_an_instance_no_module_binds_is_still_refused(run, tmp_path, lib):
    env = {"ROOT": str(tmp_path / "cache"), "LIBDIR": lib, "CLASS": "Unbound", "ROUTE": "load"}
    cold = run(CHILD, env=dict(env, PHASE="cold"))
    assert cold["ok"], cold
    assert any("cannot be checked in another process" in line and "no module binds" in line for line in cold["logs"]), cold
    warm = run(CHILD, env=dict(env, PHASE="warm"))
    assert warm["ok"] and warm["stats"]["bypass_loads"] == 0, warm
