"""Issue 17's "never replays" (and hooks): every frame of a model replays on a warm
start, or runs as a counted fallback with its reason, never silently eagerly.

The cases live in tests/replay_round3_cases.py. One cold process runs them all (each
with its own cache dir), then a fresh warm process, then a second warm one; each
case reports what it saw (outputs equal to eager, Dynamo frames it compiled, stats
deltas, log lines), and each test asserts one case.
"""

from __future__ import annotations

import pytest

CASES = ("global_hook", "forward_assigned", "generate", "buckets_default_bound", "buckets_max_variants",
         "print_first", "cond", "checkpoint", "local_class", "staticmethod",
         "instances_with_break", "break_in_submodule",
         "late_read", "wrapped_roots", "break_in_function")

CHILD = """
import os, sys, traceback
import torch
import torchair_cached_backend as tcb
from child_helpers import LOGS, frames, stats
import replay_round3_cases as rc

phase, root = {phase!r}, {root!r}
results = {{}}
for name in {cases!r}:
    tcb.reset_stats()
    f0, l0 = frames(), len(LOGS)
    entry = {{"error": None}}
    try:
        with torch.no_grad():
            entry.update(getattr(rc, "case_" + name)(phase, os.path.join(root, name)))
    except Exception:
        entry["error"] = traceback.format_exc()[-3000:]
    entry["frames"] = frames() - f0
    entry["stats"] = stats()
    entry["logs"] = LOGS[l0:]
    results[name] = entry
emit(results)
"""


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    from subprocess_helpers import run_python

    root = str(tmp_path_factory.mktemp("round3"))
    runs = {}
    for phase in ("cold", "warm", "warm2"):
        runs[phase] = run_python(CHILD.format(phase=phase, root=root, cases=list(CASES)), timeout=600)
    return runs


def _why(entry: dict) -> str:
    logs = "\n  ".join(entry.get("logs") or ["(nothing logged)"])
    return f"\nlogs:\n  {logs}\nstats: {entry.get('stats')}\nerror: {entry.get('error')}"


def _replayed(entry: dict) -> None:
    """Warm: no Dynamo frame, a bypass load, no fallback, nothing compiled."""
    assert entry["error"] is None, _why(entry)
    assert entry["frames"] == 0, f"Dynamo compiled {entry['frames']} frame(s):{_why(entry)}"
    s = entry["stats"]
    assert s["bypass_loads"] >= 1 and s["fallbacks"] == 0 and s["misses"] == 0, _why(entry)
    assert not any("runs eagerly" in line for line in entry["logs"]), _why(entry)


def _cases(outcome, name: str) -> tuple[dict, dict, dict]:
    cold, warm, warm2 = (outcome[p][name] for p in ("cold", "warm", "warm2"))
    assert cold["error"] is None, _why(cold)
    assert cold.get("ok", True), f"cold output != eager:{_why(cold)}"
    for w in (warm, warm2):
        assert w["error"] is None, _why(w)
        assert w.get("ok", True), f"warm output != eager:{_why(w)}"
    return cold, warm, warm2


def test_global_hook_runs_around_submodules(outcome):
    cold, warm, warm2 = _cases(outcome, "global_hook")
    assert warm["calls"] == warm["eager_calls"] == ["Linear", "Linear", "TwoLinear"], warm
    # the cached graphs inlined the submodules without the hook: never replayed, a counted fallback
    assert warm["stats"]["fallback_reasons"].get("global module hooks registered (run eagerly)") == 1, _why(warm)


def test_forward_assigned_with_a_hook_runs_it_once_and_replays(outcome):
    cold, warm, warm2 = _cases(outcome, "forward_assigned")
    for entry in (cold, warm, warm2):
        assert entry["hook_calls"] == 2 and entry["installed"], entry
    assert cold["frames"] >= 1 and cold["stats"]["misses"] >= 1, "cold must compile through the stand-in"
    _replayed(warm)
    _replayed(warm2)


def test_transformers_generate_compile_config_replays(outcome):
    cold, warm, warm2 = _cases(outcome, "generate")
    assert cold["frames"] >= 1 and cold["stats"]["misses"] >= 1, _why(cold)
    _replayed(warm)
    _replayed(warm2)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "default", None])
def test_npu_cached_accepts_torch_compile_modes(tmp_path, mode, caplog):
    """transformers' CompileConfig passes mode="reduce-overhead": never an error; without
    graph capture in the inner compiler it compiles as default, saying so once."""
    import torch

    from torchair_cached_backend.backend import npu_cached

    def f(x):
        return (x * 2.0).sin() + 1.0

    x = torch.randn(8)
    with caplog.at_level("INFO", logger="torchair_cached_backend"):
        graph = npu_cached(torch.fx.symbolic_trace(f), [x], options={"compiler": "eager", "cache_dir": str(tmp_path)},
                           mode=mode)
    assert torch.allclose(graph(x), f(x))
    if mode not in (None, "default"):
        assert any("compiled as with the default mode" in r.getMessage() for r in caplog.records), caplog.text


def test_npu_cached_rejects_an_unknown_mode(tmp_path):
    import torch

    from torchair_cached_backend.backend import npu_cached
    from torchair_cached_backend.options import OptionError

    with pytest.raises(OptionError, match="valid modes"):
        npu_cached(torch.fx.symbolic_trace(lambda x: x + 1), [torch.randn(2)], options={"cache_dir": str(tmp_path)},
                   mode="turbo")


def test_more_buckets_than_max_variants_settle(outcome):
    """18 static buckets, default bound 16: a start never evicts what it compiled or
    replayed, so every warm start replays all 18."""
    cold, warm, warm2 = _cases(outcome, "buckets_default_bound")
    assert cold["frames"] == 18 and cold["stored"] == [18], (cold["frames"], cold["stored"])
    _replayed(warm)
    _replayed(warm2)
    assert warm2["stored"] == [18]


def test_max_variants_option_bounds_the_program(outcome):
    cold, warm, warm2 = _cases(outcome, "buckets_max_variants")
    assert cold["frames"] == 3 and cold["stored"] == [3], cold
    assert warm["frames"] == 2 and warm["stored"] == [2], _why(warm)  # buckets 1-3: not used here, evicted
    _replayed(warm2)


def test_max_variants_is_validated():
    from torchair_cached_backend.options import OptionError, parse_options

    assert parse_options({"max_variants": 64}).max_variants == 64
    assert parse_options({}).max_variants == 16
    for bad in (0, -1, True, "8"):
        with pytest.raises(OptionError, match="max_variants"):
            parse_options({"max_variants": bad})


def test_forward_starting_with_a_print_replays(outcome):
    """No graph before the first graph break: the root frame is recorded anyway (the
    capture is installed when Dynamo loads the backend, before the first frame)."""
    cold, warm, warm2 = _cases(outcome, "print_first")
    assert cold["frames"] == 2, cold
    _replayed(warm)
    _replayed(warm2)


@pytest.mark.parametrize("name", ["cond", "checkpoint"])
def test_cond_and_checkpoint_with_eager_replay(outcome, name):
    """The eager inner compiler stores higher-order-op subgraphs (a cond's branches, a
    checkpointed body) with the graph, as Inductor does: nothing refused, warm replays."""
    cold, warm, warm2 = _cases(outcome, name)
    assert not any("will not be replayed" in line for line in cold["logs"]), _why(cold)
    _replayed(warm)
    _replayed(warm2)


@pytest.mark.parametrize("name", ["local_class", "staticmethod"])
def test_local_class_and_staticmethod_replay(outcome, name):
    """A model class defined inside a function (its forward is in the program key, it
    need not be found by name); a staticmethod has no receiver (load(Cls.method) finds it)."""
    cold, warm, warm2 = _cases(outcome, name)
    assert cold["frames"] >= 1, cold
    _replayed(warm)
    _replayed(warm2)


def test_instances_of_one_class_with_a_graph_break_each_replay(outcome):
    """Six layers, each with its own cache_compile of a method with a graph break: the
    code after the break replays for every instance (the shared resume global routes by
    instance), none runs eagerly."""
    cold, warm, warm2 = _cases(outcome, "instances_with_break")
    _replayed(warm)
    _replayed(warm2)
    assert warm["stats"]["bypass_loads"] == 6, _why(warm)


def test_graph_break_inside_a_layer_or_helper_replays(outcome):
    """The callee's own program (stored cold) is installed and replayed warm: no Dynamo
    frame, nothing eager, for a root Dynamo skipped and for one it compiled."""
    cold, warm, warm2 = _cases(outcome, "break_in_submodule")
    _replayed(warm)
    _replayed(warm2)
    assert warm["stats"]["bypass_loads"] == 7, _why(warm)  # 2 roots, 3 + 1 layers, 1 helper


def test_graph_break_inside_a_module_level_helper_replays(outcome):
    """The forward calls the helper by its global name: the replayed forward calls the
    helper's replay (under a name of ours; the module's global is left alone)."""
    cold, warm, warm2 = _cases(outcome, "break_in_function")
    _replayed(warm)
    _replayed(warm2)
    assert warm["stats"]["bypass_loads"] == 2, _why(warm)


def test_value_read_after_a_graph_break_changes(outcome):
    """self.scale 2.0 cold, 3.0 warm, read only after the break: the first warm start
    compiles the continuation (one counted fallback, never eager), the next replays it."""
    cold, warm, warm2 = _cases(outcome, "late_read")
    assert warm["frames"] == 1, _why(warm)
    assert warm["stats"]["fallback_reasons"] == {"code after a graph break compiled (no cached variant fits)": 1}, \
        _why(warm)
    assert not any("runs eagerly" in line for line in warm["logs"]), _why(warm)
    _replayed(warm2)


def test_decorated_forwards_and_builtin_roots_replay(outcome):
    """@torch.no_grad()/@torch.inference_mode() forwards, nn.Sequential and
    nn.TransformerEncoderLayer roots: Dynamo compiles its wrap_inline frame, filed under
    the model (not one key for all); two Sequentials in one dir each get their own."""
    cold, warm, warm2 = _cases(outcome, "wrapped_roots")
    assert cold["frames"] == 5, cold
    _replayed(warm)
    _replayed(warm2)
    assert warm["stats"]["bypass_loads"] == 5 and all(warm["each"].values()), _why(warm)
