"""LLM decode: per-token latency of greedy generation with a KV cache, per way of running the model.

A Llama from ``tests/hf_tiny.py`` (``--size small``: hidden 256, 4 layers; ``tiny``: hidden 32,
2 layers) generates greedily in a plain serving loop (``hf_tiny.greedy_decode``: prefill, then
one token per call, the KV cache and attention mask growing), with transformers' DynamicCache and
StaticCache. Variants, each in its own fresh process:

* ``eager``: ``model.forward``;
* ``inductor_guards``: ``torch.compile(model, dynamic=True)`` (Dynamo's guards on every call);
* ``npu_cached_dynamo_{eager,inductor}``: ``torch.compile(model, backend="npu_cached",
  dynamic=True, options=...)`` over a warm cache (graph-level hits, Dynamo's guards on every call);
* ``bypass_{eager,inductor}``: ``tcb.load(model, dir, compiler=..., dynamic=True)`` over the same
  warm cache: replayed bytecode, our per-call input check instead of guards.

After one untimed generation (compiles, loads), ``--rounds`` generations are timed call by call;
per-token latency is the median over every decode call of every round (the prefill is reported
apart). Tokens are compared with eager's in the same process. ``replayed`` (bypass variants): no
Dynamo frame in the process, a bypass load, no fallback.

usage: python benchmarks/decode.py [--size small|tiny] [--kinds dynamic,static] [--variants ...]
       [--steps 32] [--prompt 16] [--rounds 5] [--out PATH]
"""

from __future__ import annotations

import json
import os
import sys
import time

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
VARIANTS = (
    "eager",
    "inductor_guards",
    "npu_cached_dynamo_eager",
    "npu_cached_dynamo_inductor",
    "bypass_eager",
    "bypass_inductor",
)
KINDS = ("dynamic", "static")


# --------------------------------------------------------------------------- child


def _inner_compiler(variant: str) -> str | None:
    """The npu_cached inner compiler a variant uses (``prep_eager`` -> ``eager``), if any."""
    if variant.startswith(("prep_", "npu_cached_dynamo_", "bypass_")):
        return variant.rsplit("_", 1)[1]
    return None


def _make(variant: str, model, cache_dir: str):
    import torch

    compiler = _inner_compiler(variant)
    if variant == "eager":
        return model.forward
    if variant == "inductor_guards":
        return torch.compile(model, dynamic=True)
    if variant.startswith(("prep_", "npu_cached_dynamo_")):
        return torch.compile(model, backend="npu_cached", dynamic=True, options={"cache_dir": cache_dir, "compiler": compiler})
    import torchair_cached_backend as tcb

    return tcb.load(model, cache_dir, compiler=compiler, dynamic=True)


def _child(variant: str, kind: str, cfg: dict) -> dict:
    """One variant in this fresh process (``prep_<compiler>`` fills the cache)."""
    import statistics

    import torch

    sys.path.insert(0, os.path.join(REPO, "tests"))
    import hf_tiny

    with torch.no_grad():
        model, _ = hf_tiny.build("llama", size=cfg["size"])
        ids = hf_tiny.prompt(cfg["prompt"])
        steps = cfg["steps"]
        want, _ = hf_tiny.greedy_decode(model.forward, model, ids, kind, steps)
        fn = _make(variant, model, cfg["cache_dir"])
        t0 = time.perf_counter()
        first, _ = hf_tiny.greedy_decode(fn, model, ids, kind, steps)
        out: dict = {"first_generation_s": time.perf_counter() - t0, "tokens_equal_eager": first == want}
        frames_after_first = _frames()
        if variant.startswith("prep_"):
            out["frames"] = frames_after_first
            return out
        prefill, decode = [], []
        for _ in range(cfg["rounds"]):
            timings: list[float] = []
            got, _ = hf_tiny.greedy_decode(fn, model, ids, kind, steps, timings=timings)
            out["tokens_equal_eager"] = out["tokens_equal_eager"] and got == want
            prefill.append(timings[0])
            decode += timings[1:]
    out.update(
        per_token_ms=statistics.median(decode) * 1e3,
        per_token_min_ms=min(decode) * 1e3,
        prefill_ms=statistics.median(prefill) * 1e3,
        frames=_frames(),
        frames_during_timed_rounds=_frames() - frames_after_first,
        imported_dynamo="torch._dynamo" in sys.modules,
    )
    tcb = sys.modules.get("torchair_cached_backend")
    if tcb is not None:
        s = tcb.stats().as_dict()
        out["tcb_stats"] = s
        if variant.startswith("bypass"):
            out["replayed"] = out["frames"] == 0 and s["bypass_loads"] >= 1 and s["fallbacks"] == 0
    return out


def _frames() -> int:
    utils = sys.modules.get("torch._dynamo.utils")
    return utils.counters["frames"].get("total", 0) if utils is not None else 0


# --------------------------------------------------------------------------- driver


def _spawn(variant: str, kind: str, cfg: dict, inductor_dir: str, timeout: float) -> dict:
    from warm_start import CHILD_ENV

    return harness.spawn(__file__, [variant, kind, json.dumps(cfg)], inductor_dir, timeout, CHILD_ENV)


def render_markdown(doc: dict) -> str:
    from warm_start import _fmt

    c = doc["config"]
    lines = [
        "# LLM decode: per-token latency",
        "",
        f"torch {doc['torch']}, transformers {doc['transformers']}, {doc['machine']['cpu']} "
        f"({doc['machine']['cores']} cores), created {doc['created']}. Llama size {c['size']}, prompt {c['prompt']}, "
        f"{c['steps']} decode steps, {c['rounds']} timed rounds; medians.",
        "",
        "| kv cache | variant | per token ms | × eager | prefill ms | tokens = eager | replayed | Dynamo frames "
        "(timed rounds) | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        eager = next((e for e in doc["results"] if e["kind"] == r["kind"] and e["variant"] == "eager"), {})
        ratio = r.get("per_token_ms") / eager["per_token_ms"] if r.get("per_token_ms") and eager.get("per_token_ms") else None
        lines.append(
            f"| {r['kind']} | {r['variant']} | {_fmt(r.get('per_token_ms'), 3)} | {_fmt(ratio, 2)} | "
            f"{_fmt(r.get('prefill_ms'), 3)} | {_fmt(r.get('tokens_equal_eager'))} | {_fmt(r.get('replayed'))} | "
            f"{r.get('frames', '–')} ({r.get('frames_during_timed_rounds', '–')}) | {r.get('error', '')[:120]} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import datetime
    import shutil
    import tempfile

    from warm_start import machine_info

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=("tiny", "small"))
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.path.join(HERE, "results", "decode.json"))
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--workdir")
    a = p.parse_args(argv)
    kinds = [k for k in a.kinds.split(",") if k]
    variants = [v for v in a.variants.split(",") if v]
    bad = sorted(set(kinds) - set(KINDS)) + sorted(set(variants) - set(VARIANTS))
    if bad:
        p.error(f"unknown {bad}; kinds: {KINDS}; variants: {VARIANTS}")
    if "eager" not in variants:
        variants.insert(0, "eager")
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from hf_tiny import MAX_CACHE_LEN

    if a.prompt + a.steps + 1 > MAX_CACHE_LEN:
        p.error(f"--prompt + --steps + 1 must fit the StaticCache ({MAX_CACHE_LEN} tokens)")
    import torch
    import transformers

    machine = machine_info()
    work = a.workdir or tempfile.mkdtemp(prefix="tcb_decode_")
    t0 = time.perf_counter()
    results = []
    try:
        for kind in kinds:
            caches = {}
            for compiler in sorted({_inner_compiler(v) for v in variants} - {None}):
                caches[compiler] = os.path.join(work, f"{kind}_{compiler}")
                cfg = dict(size=a.size, prompt=a.prompt, steps=a.steps, rounds=a.rounds, cache_dir=caches[compiler])
                print(f"[{kind}] prepare npu_cached/{compiler} ...", flush=True)
                prep = _spawn(f"prep_{compiler}", kind, cfg, os.path.join(work, f"ind_prep_{kind}_{compiler}"), a.timeout)
                print(f"[{kind}]   {prep}", flush=True)
            for variant in variants:
                cache_dir = caches.get(_inner_compiler(variant) or "", "")
                cfg = dict(size=a.size, prompt=a.prompt, steps=a.steps, rounds=a.rounds, cache_dir=cache_dir)
                res = _spawn(variant, kind, cfg, os.path.join(work, f"ind_{kind}_{variant}"), a.timeout)
                res.update(kind=kind, variant=variant)
                print(f"[{kind}] {variant:28s} {res.get('per_token_ms', res.get('error'))}", flush=True)
                results.append(res)
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    machine["loadavg_end"] = list(os.getloadavg())
    doc = {
        "machine": machine,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": dict(size=a.size, kinds=kinds, variants=variants, steps=a.steps, prompt=a.prompt, rounds=a.rounds,
                       suite_seconds=round(time.perf_counter() - t0, 1)),
        "results": results,
    }
    harness.write_outputs(doc, a.out, render_markdown)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "--child":
        harness.report(_child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4])))
    else:
        sys.exit(main())
