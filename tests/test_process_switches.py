"""A process-wide switch read in forward is checked on every call, as Dynamo checks it.

``torch.backends.mkldnn.enabled``, ``torch.backends.cudnn.enabled``, ``torch.backends.mha``'s fast
path and ``torch.utils.deterministic.fill_uninitialized_memory`` are module attributes Dynamo guards
per call: a user flips them around a call (``with torch.backends.mkldnn.flags(enabled=False):``).
``load()`` checked them once, at load, as it checks the model's globals: a switch flipped after the
load replayed the branch the cold process traced, silently (``x + 1`` where eager gives ``x - 1``;
found by a probe round). Cold and warm are fresh processes, both routes.
"""

from __future__ import annotations

import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import os
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import frames, stats

    ROOT, PHASE, ROUTE = os.environ["ROOT"], os.environ["PHASE"], os.environ.get("ROUTE")
    det = torch.utils.deterministic

    def mkldnn_off():
        return torch.backends.mkldnn.flags(enabled=False)

    class Switched:  # set, then restored: a context manager over a setter
        def __init__(self, read, write, value):
            self.read, self.write, self.value = read, write, value
        def __enter__(self):
            self.old = self.read()
            self.write(self.value)
        def __exit__(self, *exc):
            self.write(self.old)

    CASES = {
        "mkldnn_enabled": (lambda: torch.backends.mkldnn.enabled, mkldnn_off),
        "cudnn_enabled": (lambda: torch.backends.cudnn.enabled,
                          lambda: Switched(lambda: torch.backends.cudnn.enabled,
                                           lambda v: setattr(torch.backends.cudnn, "enabled", v), False)),
        "mha_fastpath": (torch.backends.mha.get_fastpath_enabled,
                         lambda: Switched(torch.backends.mha.get_fastpath_enabled,
                                          torch.backends.mha.set_fastpath_enabled, False)),
        "fill_uninitialized": (lambda: det.fill_uninitialized_memory,
                               lambda: Switched(lambda: det.fill_uninitialized_memory,
                                                lambda v: setattr(det, "fill_uninitialized_memory", v), False)),
    }
    out = {}
    for name, (read, switched) in CASES.items():
        class M(torch.nn.Module):
            def forward(self, x):
                return x + 1 if read() else x - 1

        m = M()
        d = os.path.join(ROOT, name)
        tcb.reset_stats()
        frames_before = frames()
        if PHASE == "cold" or ROUTE == "backend":
            f = torch.compile(m, backend="npu_cached", options={"cache_dir": d, "compiler": "eager"})
        else:
            f = tcb.load(m, d, compiler="eager")
        x = torch.zeros(2)
        entry = out[name] = {"as_cold": [f(x).tolist(), m(x).tolist()], "replay_frames": frames() - frames_before}
        entry["replay_stats"] = stats()
        with switched():  # flipped after the load, around the next call
            entry["switched"] = [f(x).tolist(), m(x).tolist()]
        entry["restored"] = [f(x).tolist(), m(x).tolist()]
        entry["stats"] = stats()
    emit(out)
    """
)
CASES = ("mkldnn_enabled", "cudnn_enabled", "mha_fastpath", "fill_uninitialized")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from subprocess_helpers import cold_then_warm_routes

    return cold_then_warm_routes(CHILD, tmp_path_factory.mktemp("switches"), {})


@pytest.mark.parametrize("route", ["load", "backend"])
@pytest.mark.parametrize("case", CASES)
def test_a_switch_flipped_after_the_warm_start_is_seen_on_the_next_call(runs, route, case):
    cold, warm = runs
    entry = warm[route][case]
    assert cold[case]["as_cold"] == [[1.0, 1.0], [1.0, 1.0]]
    assert cold[case]["switched"][0] == cold[case]["switched"][1] == [-1.0, -1.0]
    # the warm start replays what the cold process traced (the switch as it was then)
    assert entry["as_cold"] == [[1.0, 1.0], [1.0, 1.0]]
    assert entry["replay_stats"]["bypass_loads"] >= 1 and entry["replay_stats"]["fallbacks"] == 0, entry
    assert entry["replay_frames"] == 0, entry
    # flipped after the load: the other branch, as eager (was [1, 1] on the load route)
    assert entry["switched"][0] == entry["switched"][1] == [-1.0, -1.0], entry
    assert entry["restored"][0] == entry["restored"][1] == [1.0, 1.0], entry
