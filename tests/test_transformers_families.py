"""Coverage suite: real transformers models (tiny random configs) are served by the bypass.

For each family, through every route, with both the ``eager`` and ``inductor`` inner compilers:

* route ``cache_compile``: ``tcb.cache_compile(model.forward, cache_dir=..., compiler=...)`` in
  the cold process and again in the warm one;
* route ``load``: ``torch.compile(model, backend="npu_cached", options=...)`` cold, then
  ``tcb.load(model, cache_dir, compiler=...)`` warm (default ``fallback=True``, as users call it,
  so a warm start that does not replay is visible as a Dynamo frame and a counted fallback);
* route ``backend`` (eager inner compiler): ``torch.compile(model, backend="npu_cached", options=...)``
  in both processes: the warm one installs the cached program into Dynamo's frame cache, no frame traced.

The cold and the warm process are fresh interpreters that build the same model from the same
seed. One cold and one warm process per (route, compiler) serve every family, each family in its
own cache dir (``load`` and ``backend`` fill the cache alike: one cold process, a copy of its cache each); the assertions are parametrized per family, so a failure names it.

The warm process must REPLAY: Dynamo compiled no frame, ``stats().bypass_loads >= 1``, no
fallback, no graph compiled, and the output equals eager's (same ModelOutput class). Inductor
runs a subset of the families (marked ``slow``; about 15 s of compile per family and route).
"""

from __future__ import annotations

import os
import shutil

import pytest
from hf_tiny import FAMILIES

ROUTES = ("cache_compile", "load", "backend")
#: the backend route (``torch.compile(model, backend="npu_cached")`` in both processes) with the eager
#: inner compiler: what it replays is what ``load()`` replays, only the entry into Dynamo's frame cache differs
EAGER_ONLY_ROUTES = ("backend",)
#: Inductor compiles take ~15 s per family and route on 2 busy cores: two decoders, two encoders
INDUCTOR_FAMILIES = ("llama", "gpt2", "bert", "t5_encoder")
#: called positionally, ``fn(input_ids, attention_mask)``: both are the first parameters of its forward
POSITIONAL = ("qwen2",)
TOLERANCE = {"eager": 1e-5, "inductor": 1e-4}

CHILD = """
import os, sys, traceback
import torch
import torchair_cached_backend as tcb
from child_helpers import LOGS, frames, stats
import hf_tiny

route, compiler, phase, root = {route!r}, {compiler!r}, {phase!r}, {root!r}
results = {{}}
for family in {families!r}:
    model, inputs = hf_tiny.build(family)
    cache_dir = os.path.join(root, family)
    if "torch._dynamo" in sys.modules:
        # a fresh Dynamo per case, as in a user's process: transformers' decorator wrappers share one
        # code object across models, and Dynamo's per-code recompile_limit (8) would otherwise be
        # reached by the cases before this one (frames beyond it run eagerly, uncompiled)
        torch._dynamo.reset()
    tcb.reset_stats()
    frames_before, logs_before = frames(), len(LOGS)
    entry = results[family] = {{"error": None}}
    try:
        with torch.no_grad():
            expected = model(**inputs)
            if route == "cache_compile":
                fn = tcb.cache_compile(model.forward, cache_dir=cache_dir, compiler=compiler)
            elif phase == "cold" or route == "backend":
                fn = torch.compile(model, backend="npu_cached", options={{"cache_dir": cache_dir, "compiler": compiler}})
            else:
                fn = tcb.load(model, cache_dir, compiler=compiler)
            if family in {positional!r}:
                got = fn(inputs["input_ids"], inputs["attention_mask"])
            else:
                got = fn(**inputs)
        a, b = hf_tiny.output_tensor(family, got), hf_tiny.output_tensor(family, expected)
        entry["type"] = [type(got).__name__, type(expected).__name__]
        entry["max_abs_diff"] = (a - b).abs().max().item() if a.shape == b.shape else None
    except Exception:
        entry["error"] = traceback.format_exc()[-3000:]
    entry["frames"] = frames() - frames_before
    entry["stats"] = stats()
    entry["logs"] = LOGS[logs_before:]
emit(results)
"""


def _run_phase(run, route: str, compiler: str, phase: str, root: str, families: tuple[str, ...], inductor_dir: str) -> dict:
    code = CHILD.format(
        route=route, compiler=compiler, phase=phase, root=root, families=list(families), positional=list(POSITIONAL)
    )
    return run(code, env={"TORCHINDUCTOR_CACHE_DIR": inductor_dir}, timeout=900)


def _families(compiler: str) -> tuple[str, ...]:
    return INDUCTOR_FAMILIES if compiler == "inductor" else tuple(FAMILIES)


#: (route, compiler) -> outcome, shared by the families of that combination within this session
_DONE: dict[tuple[str, str], dict] = {}
#: (cold route, compiler) -> (cold outcome, an untouched copy of its cache): the ``load`` and ``backend``
#: routes fill the cache the same way (``torch.compile(model, backend="npu_cached")``), so one cold
#: process serves both, each warm process on its own copy
_COLD: dict[tuple[str, str], tuple[dict, str]] = {}


def _cold_route(route: str) -> str:
    return route if route == "cache_compile" else "torch.compile"


@pytest.fixture
def outcomes(run, tmp_path_factory: pytest.TempPathFactory):
    """``outcome(route, compiler)`` -> ``{"cold": {family: ...}, "warm": {family: ...}}``: one cold
    and one warm fresh process per (route, compiler), run on first use and shared by its families."""
    done = _DONE

    def outcome(route: str, compiler: str) -> dict:
        if (route, compiler) not in done:
            tmp = tmp_path_factory.mktemp(f"{route}_{compiler}")
            root = str(tmp / "cache")
            families = _families(compiler)
            # each phase gets its own empty Inductor dir: the warm process must not need Inductor's caches
            (tmp / "inductor_warm").mkdir()
            shared = _COLD.get((_cold_route(route), compiler))
            if shared is None:
                (tmp / "inductor_cold").mkdir()
                cold = _run_phase(run, route, compiler, "cold", root, families, str(tmp / "inductor_cold"))
                pristine = str(tmp / "cold_cache")
                os.makedirs(root, exist_ok=True)  # (a cold process that stored nothing: an empty copy)
                shutil.copytree(root, pristine)
                _COLD[(_cold_route(route), compiler)] = (cold, pristine)
            else:
                cold, pristine = shared
                shutil.copytree(pristine, root)
            warm = _run_phase(run, route, compiler, "warm", root, families, str(tmp / "inductor_warm"))
            done[(route, compiler)] = {"cold": cold, "warm": warm}
        return done[(route, compiler)]

    return outcome


def _why(entry: dict) -> str:
    lines = "\n  ".join(entry.get("logs") or ["(nothing logged)"])
    return f"\nlogs:\n  {lines}\nstats: {entry.get('stats')}\nerror: {entry.get('error')}"


def _cases() -> list:
    cases = []
    for compiler in ("eager", "inductor"):
        marks = [pytest.mark.slow] if compiler == "inductor" else []
        for route in ROUTES:
            if compiler != "eager" and route in EAGER_ONLY_ROUTES:
                continue
            for family in _families(compiler):
                cases.append(pytest.param(route, compiler, family, marks=marks, id=f"{route}-{compiler}-{family}"))
    return cases


@pytest.mark.parametrize("route,compiler,family", _cases())
def test_warm_process_replays(outcomes, route: str, compiler: str, family: str) -> None:
    result = outcomes(route, compiler)
    cold, warm = result["cold"][family], result["warm"][family]
    tol = TOLERANCE[compiler]

    assert cold["error"] is None, f"cold {family}:{_why(cold)}"
    assert cold["max_abs_diff"] is not None and cold["max_abs_diff"] <= tol, f"cold {family} != eager:{_why(cold)}"
    assert cold["stats"]["misses"] >= 1, f"cold {family} compiled nothing into the cache:{_why(cold)}"

    assert warm["error"] is None, f"warm {family}:{_why(warm)}"
    assert warm["frames"] == 0, f"warm {family}: Dynamo compiled {warm['frames']} frame(s), no replay:{_why(warm)}"
    s = warm["stats"]
    assert s["bypass_loads"] >= 1, f"warm {family}: no bypass load:{_why(warm)}"
    assert s["fallbacks"] == 0 and s["misses"] == 0, f"warm {family}: fell back / compiled:{_why(warm)}"
    assert warm["type"][0] == warm["type"][1], f"warm {family} returned {warm['type'][0]}, eager {warm['type'][1]}"
    assert warm["max_abs_diff"] is not None and warm["max_abs_diff"] <= tol, f"warm {family} != eager:{_why(warm)}"
