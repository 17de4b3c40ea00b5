"""Steady-state cost per call: what the bypass loader's wrapper and input check add.

Guards and wrappers cost microseconds, so inputs are small (MLP batch 1, GPT
batch 1 x seq 8; by default the widths shrink too, ``--size tiny``, else the
compute would hide the overhead) and all variants run in one process, interleaved round by
round (rotating the order), each round timing a batch of calls; the median over
rounds is robust to a noisy neighbour. The npu_cached cache is filled by a
separate child process, as it would be in deployment.

usage: python benchmarks/per_call.py [--models mlp,gpt] [--size tiny|small] [--rounds 41] [--out PATH]
"""

from __future__ import annotations

import json
import os
import sys
import time

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1"}


def _prepare(model_name: str, size: str, cache_dir: str, compiler: str) -> None:
    """Child: cold-compile with npu_cached so the parent can warm-start from it."""
    import torch

    sys.path.insert(0, HERE)
    from models import build

    with torch.no_grad():
        m, x = build(model_name, size)
        torch.compile(m, backend="npu_cached", options={"cache_dir": cache_dir, "compiler": compiler})(x)


def _variants(model_name: str, size: str, cache_dir: str, compiler: str) -> tuple[dict, dict, tuple[int, ...]]:
    """name -> zero-arg callable, plus facts about the loaded function."""
    import torch

    import torchair_cached_backend as tcb

    sys.path.insert(0, HERE)
    from models import build

    def fresh():
        return build(model_name, size)

    m_eager, x = fresh()
    m_on, _ = fresh()
    m_off, _ = fresh()
    # load before anything imports Dynamo, so the flags below describe the bypass alone
    on = tcb.load(m_on, cache_dir, compiler=compiler, check_inputs=True, fallback=False)
    off = tcb.load(m_off, cache_dir, compiler=compiler, check_inputs=False, fallback=False)
    m_call, _ = fresh()
    every = tcb.load(m_call, cache_dir, compiler=compiler, guards="call", fallback=False)
    facts = {
        "bypass_imported_dynamo": "torch._dynamo" in sys.modules,
        "bypass_imported_inductor": "torch._inductor" in sys.modules,
    }
    # "compiled graph called directly": the replayed transformed function, no wrapper
    direct_fn = off._variants[0].fn
    prefix = getattr(off, "_prefix", (m_off,))
    m_ind, _ = fresh()
    compiled = torch.compile(m_ind, fullgraph=True)
    V = {
        "eager": lambda: m_eager(x),
        "inductor_guards": lambda: compiled(x),
        "ours_check_on": lambda: on(x),
        "ours_guards_call": lambda: every(x),
        "ours_check_off": lambda: off(x),
        "direct": lambda: direct_fn(*prefix, x),
    }
    ref = m_eager(x)
    facts["max_abs_diff"] = {k: (f() - ref).abs().max().item() for k, f in V.items()}
    return V, facts, tuple(x.shape)


def measure(V: dict, rounds: int, batch_ms: float, warmup: int) -> dict:
    """Median/min µs per call over interleaved rounds; batch size calibrated per variant."""
    import statistics

    calls = {}
    for name, f in V.items():
        for _ in range(warmup):
            f()
        t = time.perf_counter()
        for _ in range(20):
            f()
        per = (time.perf_counter() - t) / 20
        calls[name] = max(10, int(batch_ms / 1e3 / per))
    samples: dict[str, list[float]] = {k: [] for k in V}
    names = list(V)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            f, n = V[name], calls[name]
            t = time.perf_counter()
            for _ in range(n):
                f()
            samples[name].append((time.perf_counter() - t) / n * 1e6)
    return {
        k: {
            "median_us": statistics.median(v),
            "min_us": min(v),
            "calls_per_round": calls[k],
            "samples_us": [round(s, 2) for s in v],
        }
        for k, v in samples.items()
    }


def targets_for(model: str, res: dict) -> list[dict]:
    def med(k: str) -> float:
        return res[k]["median_us"]

    out = []
    v = med("ours_check_on") / med("inductor_guards")
    out.append({"name": f"{model}: ours (check on) / Inductor with guards", "value": v, "goal": "<= 1", "met": v <= 1})
    v = med("ours_check_off") / med("direct")
    out.append({"name": f"{model}: ours (check off) / direct", "value": v, "goal": "<= 1.05", "met": v <= 1.05})
    # issue 8: with the guards, checks on stay within 1.05x of the figure before them, measured
    # against the same run's direct call (ratios are stable across runs, absolute µs are not)
    before = BEFORE_GUARDS.get(model)
    if before is not None:
        v = med("ours_check_on") / med("direct")
        goal = round(before * 1.05, 3)
        out.append({"name": f"{model}: ours (guards on) / direct, vs {before:.3f} before guards",
                    "value": v, "goal": f"<= {goal}", "met": v <= goal})
    return out


#: ours_check_on / direct before per-call guards (benchmarks/results/per_call.json of 2026-11-30, tiny)
BEFORE_GUARDS = {"mlp": 46.2 / 42.2, "gpt": 241.8 / 233.5}


def render_markdown(doc: dict) -> str:
    cfg = doc["config"]
    lines = [
        "# Per-call overhead (steady state, one process)",
        "",
        f"torch {doc['torch']}, Python {doc['machine']['python']}, {doc['machine']['cpu']} "
        f"({doc['machine']['cores']} cores), created {doc['created']}. Median µs per call over "
        f"{cfg['rounds']} interleaved rounds of ~{cfg['batch_ms']} ms; model size `{cfg['size']}`; "
        f"inner compiler `{cfg['compiler']}`; env {cfg['env']}; torch.no_grad().",
        "",
    ]
    names = list(doc["results"][0]["variants"]) if doc["results"] else []
    head = (
        "| variant | " + " | ".join(f"{r['model']} {tuple(r['input_shape'])} µs (min)" for r in doc["results"]) + " |"
    )
    lines += [head, "|---" * (len(doc["results"]) + 1) + "|"]
    for n in names:
        cells = [f"{r['variants'][n]['median_us']:.1f} ({r['variants'][n]['min_us']:.1f})" for r in doc["results"]]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "| target | value | goal | met |", "|---|---|---|---|"]
    for t in doc["targets"]:
        lines.append(f"| {t['name']} | {t['value']:.3f} | {t['goal']} | {'yes' if t['met'] else '**no**'} |")
    lines += ["", "Variants: `eager` = the module; `inductor_guards` = `torch.compile(m)` (Dynamo guards + wrapper);"]
    lines += ["`ours_check_on/off` = `tcb.load(m, dir, check_inputs=True/False)` (on: the per-call guards of"]
    lines += ["`guards=\"load\"`); `ours_guards_call` = `guards=\"call\"` (every recorded guard on every call);"]
    lines += ["`direct` = the replayed transformed function called without our wrapper."]
    for r in doc["results"]:
        lines.append(
            f"\n{r['model']}: bypass load imported torch._dynamo: {r['facts']['bypass_imported_dynamo']}, "
            f"torch._inductor: {r['facts']['bypass_imported_inductor']}; max abs diff vs eager: "
            + ", ".join(f"{k} {v:.2g}" for k, v in r["facts"]["max_abs_diff"].items())
        )
    return "\n".join(lines) + "\n"


def _measure_child(cfg: dict) -> dict:
    """Child: load, compile and time every variant of one model in this process."""
    import torch

    with torch.no_grad():
        V, facts, shape = _variants(cfg["model"], cfg["size"], cfg["cache"], cfg["compiler"])
        res = measure(V, cfg["rounds"], cfg["batch_ms"], cfg["warmup"])
    return {
        "model": cfg["model"],
        "input_shape": list(shape),
        "variants": res,
        "facts": facts,
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse
    import datetime
    import shutil
    import subprocess
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,gpt")
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument(
        "--size",
        default="tiny",
        choices=("tiny", "small"),
        help="tiny: narrow models + small inputs (overhead dominates); small: benchmark widths, small inputs",
    )
    p.add_argument("--batch-ms", type=float, default=20.0, help="target duration of one round's batch per variant")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "per_call.json"))
    a = p.parse_args(argv)

    sys.path.insert(0, HERE)
    from warm_start import machine_info

    machine = machine_info()
    work = tempfile.mkdtemp(prefix="tcb_per_call_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(work, "inductor"), **ENV)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: .pyc files present
    me = os.path.abspath(__file__)
    results, targets = [], []
    try:
        for model in a.models.split(","):
            # one process per model, so "the bypass load imported X" is not polluted by another model's compile
            cfg = {"model": model, "size": a.size, "cache": os.path.join(work, f"npu_{model}"), "compiler": a.compiler}
            cfg.update(rounds=a.rounds, batch_ms=a.batch_ms, warmup=a.warmup)
            print(f"[{model}] preparing cache ...", flush=True)
            subprocess.run([sys.executable, me, "--prepare", json.dumps(cfg)], env=env, check=True)
            print(f"[{model}] measuring ...", flush=True)
            proc = subprocess.run(
                [sys.executable, me, "--measure", json.dumps(cfg)], env=env, check=True, capture_output=True, text=True
            )
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            for k, v in res["variants"].items():
                print(f"[{model}] {k:18s} {v['median_us']:9.1f} µs  (min {v['min_us']:.1f})", flush=True)
            results.append(res)
            targets += targets_for(model, res["variants"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    machine["loadavg_end"] = list(os.getloadavg())
    doc = {
        "machine": machine,
        "torch": results[0]["torch"] if results else None,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": {
            "rounds": a.rounds,
            "batch_ms": a.batch_ms,
            "warmup": a.warmup,
            "compiler": a.compiler,
            "size": a.size,
            "env": ENV,
        },
        "results": results,
        "targets": targets,
    }
    harness.write_outputs(doc, a.out, render_markdown)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--prepare":
        c = json.loads(sys.argv[2])
        _prepare(c["model"], c["size"], c["cache"], c["compiler"])
    elif len(sys.argv) == 3 and sys.argv[1] == "--measure":
        print(json.dumps(_measure_child(json.loads(sys.argv[2]))), flush=True)
    else:
        sys.exit(main())
