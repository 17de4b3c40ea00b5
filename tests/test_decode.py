"""LLM decode, the serving case: greedy generation with a KV cache served by the bypass.

A tiny Llama generates greedily in a plain loop (``hf_tiny.greedy_decode``: one prefill call, then
16 decode calls of one token, the KV cache and the attention mask growing), calling the model's
forward as a server does: ``fn(input_ids=..., attention_mask=..., cache=..., use_cache=True)``
(transformers 5 renamed ``past_key_values`` to ``cache``; the old name is still accepted).

The cold process compiles with ``dynamic=True`` and caches; a fresh warm process generates through
the bypass: no Dynamo frame, no graph compiled, tokens and logits identical to eager's. It also
generates from a prompt of another length, which the cold process never saw: the dynamic variants
must cover it.

Both of transformers' KV cache classes, both routes (``cache_compile`` and ``torch.compile`` +
``load``). Dynamo makes a small set of graphs for this loop (the cold process's numbers are
checked): DynamicCache 3 (prefill with an empty cache; the first decode, where the cache length
is still specialized to the prompt length; then any decode length), StaticCache 2 (prefill;
decode, the cache buffers having fixed shapes).
"""

from __future__ import annotations

import os

import pytest

#: kv cache kind -> most graphs Dynamo makes for prefill + growing decode (dynamic=True)
GRAPHS = {"dynamic": 3, "static": 2}
STEPS = 16
COLD_PROMPT, WARM_PROMPTS = 8, (8, 5)

CHILD = """
import os, sys, traceback
import torch
import torchair_cached_backend as tcb
from child_helpers import LOGS, frames, stats
import hf_tiny

compiler, phase, root = {compiler!r}, {phase!r}, {root!r}
results = {{}}
for route, kind in {combos!r}:
    name = route + "-" + kind
    cache_dir = os.path.join(root, name)
    if "torch._dynamo" in sys.modules:
        # a fresh Dynamo per case, as in a user's process: transformers' decorator wrappers share one
        # code object across models, and Dynamo's per-code recompile_limit (8) would otherwise be
        # reached by the cases before this one (frames beyond it run eagerly, uncompiled)
        torch._dynamo.reset()
    tcb.reset_stats()
    frames_before, logs_before = frames(), len(LOGS)
    entry = results[name] = {{"error": None, "runs": []}}
    try:
        model, _ = hf_tiny.build("llama")
        with torch.no_grad():
            if route == "cache_compile":
                fn = tcb.cache_compile(model.forward, cache_dir=cache_dir, compiler=compiler, dynamic=True)
            elif phase == "cold":
                fn = torch.compile(model, backend="npu_cached", dynamic=True,
                                   options={{"cache_dir": cache_dir, "compiler": compiler}})
            else:
                fn = tcb.load(model, cache_dir, compiler=compiler, dynamic=True)
            for length in {prompts!r}:
                ids = hf_tiny.prompt(length)
                want, want_logits = hf_tiny.greedy_decode(model.forward, model, ids, kind, {steps})
                got, got_logits = hf_tiny.greedy_decode(fn, model, ids, kind, {steps})
                diff = max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits))
                entry["runs"].append({{"prompt": length, "eager": want, "got": got, "max_abs_diff": diff}})
    except Exception:
        entry["error"] = traceback.format_exc()[-3000:]
    entry["frames"] = frames() - frames_before
    entry["stats"] = stats()
    entry["logs"] = LOGS[logs_before:]
emit(results)
"""

#: compiler -> (route, kv cache kind) combinations; Inductor (slow) on a subset
COMBOS = {
    "eager": [("cache_compile", "dynamic"), ("cache_compile", "static"), ("load", "dynamic"), ("load", "static")],
    "inductor": [("cache_compile", "dynamic"), ("load", "static")],
}
TOLERANCE = {"eager": 1e-5, "inductor": 1e-4}


def _graph_dirs(root: str) -> int:
    """Graph entries a cache_compile / torch.compile cache dir holds (anywhere below ``root``)."""
    return sum(
        len([k for k in os.listdir(os.path.join(d, "graphs")) if not k.startswith(".")])
        for d, subdirs, _ in os.walk(root)
        if "graphs" in subdirs
    )


#: compiler -> outcome, shared by the cases of that compiler within this session
_DONE: dict[str, dict] = {}


@pytest.fixture
def decode_outcomes(run, tmp_path_factory: pytest.TempPathFactory):
    """``outcome(compiler)`` -> the cold and warm results: one cold and one warm fresh process per
    inner compiler, run on first use and shared by its (route, kv cache) cases."""
    done = _DONE

    def outcome(compiler: str) -> dict:
        if compiler not in done:
            tmp = tmp_path_factory.mktemp(f"decode_{compiler}")
            root = str(tmp / "cache")
            res = {}
            for phase, prompts in (("cold", (COLD_PROMPT,)), ("warm", WARM_PROMPTS)):
                ind = tmp / f"inductor_{phase}"
                ind.mkdir()
                code = CHILD.format(
                    compiler=compiler, phase=phase, root=root, combos=COMBOS[compiler], prompts=prompts, steps=STEPS
                )
                res[phase] = run(code, env={"TORCHINDUCTOR_CACHE_DIR": str(ind)}, timeout=900)
            res["graphs"] = {f"{r}-{k}": _graph_dirs(os.path.join(root, f"{r}-{k}")) for r, k in COMBOS[compiler]}
            done[compiler] = res
        return done[compiler]

    return outcome


def _why(entry: dict) -> str:
    lines = "\n  ".join(entry.get("logs") or ["(nothing logged)"])
    return f"\nlogs:\n  {lines}\nstats: {entry.get('stats')}\nerror: {entry.get('error')}"


def _cases() -> list:
    return [
        pytest.param(c, r, k, marks=[pytest.mark.slow] if c == "inductor" else [], id=f"{c}-{r}-{k}")
        for c, combos in COMBOS.items()
        for r, k in combos
    ]


@pytest.mark.parametrize("compiler,route,kind", _cases())
def test_greedy_decode_replays_in_a_warm_process(decode_outcomes, compiler: str, route: str, kind: str) -> None:
    res = decode_outcomes(compiler)
    name = f"{route}-{kind}"
    cold, warm = res["cold"][name], res["warm"][name]
    tol = TOLERANCE[compiler]

    assert cold["error"] is None, f"cold:{_why(cold)}"
    (run,) = cold["runs"]
    assert run["got"] == run["eager"] and len(run["got"]) == STEPS + 1, f"cold tokens differ from eager's: {run}"
    assert run["max_abs_diff"] <= tol, run
    assert 1 <= res["graphs"][name] <= GRAPHS[kind], f"{res['graphs'][name]} graphs cached:{_why(cold)}"

    assert warm["error"] is None, f"warm:{_why(warm)}"
    assert warm["frames"] == 0, f"warm: Dynamo compiled {warm['frames']} frame(s), no replay:{_why(warm)}"
    s = warm["stats"]
    assert s["bypass_loads"] >= 1, f"warm: no bypass load:{_why(warm)}"
    assert s["misses"] == 0 and s["fallbacks"] == 0, f"warm: compiled or fell back:{_why(warm)}"
    assert [r["prompt"] for r in warm["runs"]] == list(WARM_PROMPTS)
    for r in warm["runs"]:
        assert r["got"] == r["eager"], f"warm tokens (prompt {r['prompt']}) differ from eager's: {r}"
        assert r["max_abs_diff"] <= tol, r
