"""The ``guards`` option: ``"load"`` (default), ``"call"`` and ``"none"``, cold in one fresh
process and warm in another (the invalidation matrix, tests/test_guards_matrix.py, covers
what ``"load"`` detects)."""

from __future__ import annotations

import textwrap

import pytest

CODE = textwrap.dedent(
    """
    import os, sys
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, same, stats

    class Scaled(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 4)
            self.scale = scale

        def forward(self, x):
            return self.lin(x) * self.scale

    ROOT, PHASE, MODE = os.environ["ROOT"], os.environ["PHASE"], os.environ.get("MODE", "load")
    m = Scaled(float(os.environ.get("SCALE", "2.0")))
    x = torch.randn(2, 4)
    out = {}
    with torch.no_grad():
        if PHASE == "cold":
            f = torch.compile(m, backend="npu_cached", options={"cache_dir": ROOT, "compiler": "eager"})
            out["cold"] = same(f(x), m(x))
        else:
            f = tcb.load(m, ROOT, compiler="eager", guards=MODE)
            out["first"] = same(f(x), m(x))
            replayed = frames() == 0
            if os.environ.get("MUTATE"):
                m.scale = 5.0  # after the warm start served its first call
                out["after_mutation"] = same(f(x), m(x))
            out["replayed_first"] = replayed
            if os.environ.get("DETERMINISTIC"):
                torch.use_deterministic_algorithms(True)  # after the first call: the load-time checks ran
                out["deterministic"] = same(f(x), m(x))
    emit({"out": out, "stats": stats(), "frames": frames(), "logs": LOGS})
    """
)


def test_guards_call_checks_everything_on_every_call(run, tmp_path):
    env = {"ROOT": str(tmp_path)}
    run(CODE, env=dict(env, PHASE="cold"))
    warm = run(CODE, env=dict(env, PHASE="warm", MODE="call", MUTATE="1"))
    assert all(warm["out"].values()), warm["out"]
    assert warm["stats"]["bypass_loads"] == 1 and warm["stats"]["fallbacks"] == 1, warm["stats"]
    assert any("self.scale: 2.0 -> 5.0" in line for line in warm["logs"]), warm["logs"]


def test_deterministic_algorithms_switched_on_after_the_load_are_checked_per_call(run, tmp_path):
    """A variant traced without deterministic algorithms (its kernels lowered without them, as
    Inductor and GE lower) is not replayed once the process turns them on, as Dynamo's guard
    would not replay it: the default ``guards="load"`` checks the mode on every call."""
    env = {"ROOT": str(tmp_path)}
    run(CODE, env=dict(env, PHASE="cold"))
    warm = run(CODE, env=dict(env, PHASE="warm", DETERMINISTIC="1"))
    assert all(warm["out"].values()), warm["out"]
    assert warm["out"]["replayed_first"] and warm["stats"]["bypass_loads"] == 1, warm
    assert warm["stats"]["fallbacks"] == 1, warm["stats"]  # the second call: no variant with that mode yet
    assert any("deterministic algorithms" in line for line in warm["logs"]), warm["logs"]


def test_guards_none_is_torchairs_unchecked_replay_and_says_so(run, tmp_path):
    env = {"ROOT": str(tmp_path)}
    run(CODE, env=dict(env, PHASE="cold"))
    # unchanged: replays
    same = run(CODE, env=dict(env, PHASE="warm", MODE="none"))
    assert same["out"]["first"] and same["frames"] == 0
    assert sum("guards='none'" in line for line in same["logs"]) == 1, same["logs"]
    # changed: with the checks off the cached program is replayed as is (torchair's behaviour):
    # nothing is compiled and the log said that nothing is checked
    changed = run(CODE, env=dict(env, PHASE="warm", MODE="none", SCALE="3.0"))
    assert changed["frames"] == 0 and changed["stats"]["bypass_loads"] == 1
    assert not changed["out"]["first"], "guards='none' must not check (it is the opt-out)"
    # the default checks it
    checked = run(CODE, env=dict(env, PHASE="warm", SCALE="3.0"))
    assert checked["out"]["first"] and checked["stats"]["bypass_loads"] == 0
    assert any("self.scale: 2.0 -> 3.0" in line for line in checked["logs"]), checked["logs"]


def test_guards_option_is_validated(tmp_path):
    import torchair_cached_backend as tcb

    with pytest.raises(tcb.OptionError, match="'guards' must be one of"):
        tcb.parse_options({"guards": "always"})
    with pytest.raises(tcb.OptionError, match="'guards'"):
        tcb.cache_compile(lambda x: x, cache_dir=str(tmp_path), guards=False)
    with pytest.raises(tcb.OptionError, match="'guards'"):
        tcb.load(lambda x: x, str(tmp_path), guards="sometimes")
