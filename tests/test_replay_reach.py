"""Issue 9's review of the replay machinery: each defect, cold in one fresh process
and warm in another (cases in tests/replay_cases.py).

* Dynamo's numbered globals never leak: two classes with a graph break at the same
  offset replay their own resume functions; ``torch.compile`` of other code in the
  module works after a (static or dynamic) replay.
* Valid calls replay: classmethods, a receiver not named ``self``, grad-mode variants.
* Variants are merged across processes, never lost; a warm start that lacks a
  variant compiles it, it never raises.
* Nothing is judged stale forever: properties, module-level lambdas, buffers
  mutated in forward, several instances in one dir, graph breaks in closures.
"""

from __future__ import annotations

import os
import textwrap

PRELUDE = textwrap.dedent(
    """
    import os, sys
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, same, stats, programs
    import replay_cases as rc
    ROOT = os.environ["ROOT"]
    PHASE = os.environ["PHASE"]
    def d(name):
        return os.path.join(ROOT, name)
    def serve(target, name, dynamic=None):
        '''cold: torch.compile(npu_cached); warm: tcb.load (falls back to compiling on a miss)'''
        if PHASE == "cold":
            return torch.compile(target, backend="npu_cached", dynamic=dynamic,
                                 options={"cache_dir": d(name), "compiler": "eager"})
        return tcb.load(target, d(name), compiler="eager")
    """
)


def child(code: str) -> str:
    return PRELUDE + textwrap.dedent(code)


def both(run, tmp_path, code: str) -> tuple[dict, dict]:
    env = {"ROOT": str(tmp_path)}
    cold = run(child(code), env=dict(env, PHASE="cold"))
    warm = run(child(code), env=dict(env, PHASE="warm"))
    return cold, warm


def test_graph_breaks_at_same_offset_and_later_compiles_do_not_collide(run, tmp_path):
    code = """
    x = torch.randn(4)
    out = {}
    leaked = []
    with torch.no_grad():
        if PHASE == "cold" and os.environ.get("ONLY") == "decoder":
            out["dec"] = same(serve(rc.Decoder(), "dec")(x), x * 3.0 - 1.0)
        elif PHASE == "cold":
            out["enc"] = same(serve(rc.Encoder(), "enc")(x), x * 2.0 + 1.0)
        else:
            enc, dec = serve(rc.Encoder(), "enc"), serve(rc.Decoder(), "dec")
            out["enc"] = same(enc(x), x * 2.0 + 1.0)
            out["dec"] = same(dec(x), x * 3.0 - 1.0)
            out["replayed"] = frames() == 0 and stats()["bypass_loads"] == 2
            leaked = sorted(n for n in vars(rc) if n.startswith(("__resume_at", "__compiled_fn", "__builtins_dict")))
            # a plain torch.compile of another function of the module, after the replays
            out["other"] = same(torch.compile(rc.other_function, backend="eager")(x), x.sin() + 1.0)
            out["dyn"] = same(torch.compile(rc.other_function, backend="eager", dynamic=True)(x[:3]), x[:3].sin() + 1.0)
    emit({"out": out, "leaked": leaked if PHASE == "warm" else []})
    """
    env = {"ROOT": str(tmp_path)}
    # cached by separate processes, as in the review
    run(child(code), env=dict(env, PHASE="cold"))
    run(child(code), env=dict(env, PHASE="cold", ONLY="decoder"))
    warm = run(child(code), env=dict(env, PHASE="warm"))
    assert all(warm["out"].values()), warm["out"]
    assert warm["leaked"] == [], "replayed programs must not install Dynamo's own global names"


def test_dynamic_replay_then_plain_compile_in_same_module(run, tmp_path):
    code = """
    out = {}
    with torch.no_grad():
        f = serve(rc.no_params, "dyn", dynamic=True)
        for shape in [(5, 3), (7, 4)]:
            x = torch.randn(*shape)
            out[str(shape)] = same(f(x), (x * 2.0).cos())
        if PHASE == "warm":
            out["replayed"] = frames() == 0
            x = torch.randn(6, 2)
            out["other"] = same(torch.compile(rc.other_function, backend="eager", dynamic=True)(x), x.sin() + 1.0)
    emit({"out": out})
    """
    cold, warm = both(run, tmp_path, code)
    assert all(warm["out"].values()), warm["out"]


def test_receivers_classmethod_and_any_name(run, tmp_path):
    code = """
    out = {}
    x = torch.randn(4)
    with torch.no_grad():
        f = serve(rc.Scaler.apply, "cls")
        out["classmethod"] = same(f(x), x * 3.0 + 1.0)
        out["classmethod_kw"] = same(f(x=x), x * 3.0 + 1.0)
        g = tcb.cache_compile(rc.Scaler.apply, cache_dir=d("cc_cls"), compiler="eager")
        out["cache_compile_classmethod"] = same(g(x), x * 3.0 + 1.0)
        m = rc.This()
        h = serve(m, "this")
        out["this"] = same(h(x), x * 2.0)
        out["this_kw"] = same(h(x=x), x * 2.0)
    emit({"out": out, "stats": stats(), "frames": frames()})
    """
    cold, warm = both(run, tmp_path, code)
    assert all(cold["out"].values()), cold["out"]
    assert all(warm["out"].values()), warm["out"]
    assert warm["frames"] == 0 and warm["stats"]["bypass_loads"] == 3, warm["stats"]


def test_grad_mode_variants_both_served(run, tmp_path):
    code = """
    out = {}
    x = torch.randn(4)  # no input requires grad, no parameters: both grad modes are cacheable graphs
    f = serve(rc.no_params, "grad")
    with torch.no_grad():
        out["no_grad"] = same(f(x), (x * 2.0).cos())
    out["grad"] = same(f(x), (x * 2.0).cos())
    with torch.no_grad():
        out["no_grad_again"] = same(f(x), (x * 2.0).cos())
    emit({"out": out, "stats": stats(), "frames": frames()})
    """
    cold, warm = both(run, tmp_path, code)
    assert all(warm["out"].values()), warm["out"]
    assert cold["frames"] == 2, "grad mode is a guard: two variants"
    assert warm["frames"] == 0 and warm["stats"]["fallbacks"] == 0, warm["stats"]


def test_variants_merge_across_processes_and_warm_never_raises(run, tmp_path):
    code = """
    out = {}
    shapes = {"a": [(3, 4)], "b": [(5, 4), (6, 4)], "warm": [(3, 4), (5, 4), (6, 4), (9, 4)]}[os.environ["WHO"]]
    with torch.no_grad():
        c = tcb.cache_compile(rc.no_params, cache_dir=d("merge"), compiler="eager", dynamic=False)
        for s in shapes:
            x = torch.randn(*s)
            out[str(s)] = same(c(x), (x * 2.0).cos())
    emit({"out": out, "stats": stats(), "frames": frames(), "logs": LOGS})
    """
    env = {"ROOT": str(tmp_path), "PHASE": "x"}
    a = run(child(code), env=dict(env, WHO="a"))  # one static variant
    b = run(child(code), env=dict(env, WHO="b"))  # replays nothing of a's; adds two variants
    assert a["frames"] == 1 and b["frames"] == 2, (a["frames"], b["frames"])
    warm = run(child(code), env=dict(env, WHO="warm"))
    assert all(warm["out"].values()), warm["out"]
    # (3,4) from process a, (5,4)/(6,4) from b: all replayed; (9,4) none fits: compiled, no error
    assert warm["stats"]["bypass_loads"] == 1 and warm["stats"]["fallbacks"] == 1, warm["stats"]
    assert warm["frames"] == 1, "only the new shape may compile"


def test_properties_lambdas_buffers_replay_every_start(run, tmp_path):
    code = """
    out = {}
    x = torch.randn(4)
    with torch.no_grad():
        m = rc.WithProperty()
        out["property_lambda"] = same(serve(m, "prop")(x), x * 2.0 * 3.0)
        c = rc.Counter()
        f = serve(c, "counter")
        out["counter"] = same(f(x), x + 1.0) and same(f(x), x + 1.0) and int(c.n) == 2
    emit({"out": out, "stats": stats(), "frames": frames(), "logs": LOGS})
    """
    cold, warm = both(run, tmp_path, code)
    assert all(cold["out"].values()) and all(warm["out"].values()), (cold["out"], warm["out"])
    assert warm["frames"] == 0 and warm["stats"]["bypass_loads"] == 2, (warm["stats"], warm["logs"])
    again = run(child(code), env={"ROOT": str(tmp_path), "PHASE": "warm"})
    assert again["frames"] == 0 and again["stats"]["bypass_loads"] == 2


def test_instances_with_other_shapes_share_a_dir(run, tmp_path):
    code = """
    out = {}
    x = torch.randn(2, 4)
    ns = [int(n) for n in os.environ["NS"].split(",")]
    with torch.no_grad():
        for n in ns:
            m = rc.Proj(n)
            out[n] = same(tcb.load(m, d("inst"), compiler="eager")(x), m(x))
    emit({"out": out, "stats": stats(), "frames": frames(), "programs": programs(d("inst"))})
    """
    env = {"ROOT": str(tmp_path), "PHASE": "x"}
    run(child(code), env=dict(env, NS="3"))
    run(child(code), env=dict(env, NS="5"))  # must not delete the n=3 program's variant
    warm = run(child(code), env=dict(env, NS="3,5"))
    assert all(warm["out"].values()), warm["out"]
    assert warm["frames"] == 0 and warm["stats"]["bypass_loads"] == 2, warm["stats"]
    assert len(warm["programs"]) == 1


def test_graph_break_inside_a_closure_replays(run, tmp_path):
    code = """
    k = float(os.environ.get("K", "2.0"))
    fn = rc.make_closure(k)
    x = torch.randn(4)
    with torch.no_grad():
        f = serve(fn, "closure")
        y = f(x)
    ref = ((x * k + torch.full((4,), k)) * k).sin()
    emit({"ok": same(y, ref), "stats": stats(), "frames": frames(), "logs": LOGS})
    """
    cold, warm = both(run, tmp_path, code)
    assert cold["ok"] and warm["ok"]
    assert cold["frames"] == 2
    assert warm["frames"] == 0 and warm["stats"]["bypass_loads"] == 1, (warm["stats"], warm["logs"])
    assert not any("runs eagerly" in line for line in warm["logs"]), warm["logs"]
    # a new closure value: the guard on the captured float fails; never the stale k
    changed = run(child(code), env={"ROOT": str(tmp_path), "PHASE": "warm", "K": "3.0"})
    assert changed["ok"], "a changed closure value must not replay the old one"
    assert os.path.isdir(os.path.join(tmp_path, "closure"))
