"""Warm first call through the backend route vs ``load()`` (issue 18 item 1).

A transformers Llama (random weights, from a config) is compiled cold once with
``torch.compile(model, backend="npu_cached")`` (eager inner compiler), then fresh processes,
interleaved, measure the first call from the model built: ``eager``; ``load`` =
``tcb.load(model, dir)`` + the call; ``backend`` = the same ``torch.compile`` + the call (the
cached program installed into Dynamo's frame cache, no frame traced). ``torch.compile()`` itself
is timed apart (``compile_s``): it imports Dynamo's debug wrappers and with them AOTAutograd,
before any frame runs, on every backend. Median of ``--repeat`` fresh processes.

    python benchmarks/backend_route.py --sizes tiny,150m --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
#: (layers, hidden, heads, batch, seq, vocab); "tiny" is the issue's tiny Llama, "150m" its 155M row
SIZES = {"tiny": (4, 128, 4, 2, 24, 128), "150m": (8, 1024, 16, 1, 128, 32000)}
MODES = ("eager", "load", "backend")


def _child(mode: str, size: str, cache_dir: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, heads, batch, seq, vocab = SIZES[size]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                         max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    out: dict = {}
    with torch.no_grad():
        t0 = time.perf_counter()
        if mode == "eager":
            fn = model
        else:
            import torchair_cached_backend as tcb

            if mode == "load":
                fn = tcb.load(model, cache_dir, compiler="eager")
            else:
                fn = torch.compile(model, backend="npu_cached", options={"cache_dir": cache_dir, "compiler": "eager"})
        out["compile_s"] = time.perf_counter() - t0
        got = fn(input_ids=ids).logits
        out["first_call_s"] = time.perf_counter() - t0
        counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
        out["frames"] = counters["frames"].get("total", 0) if counters is not None else 0
        if mode != "eager":
            out["stats"] = {k: v for k, v in sys.modules["torchair_cached_backend"].stats().as_dict().items()
                            if k in ("bypass_loads", "fallbacks", "hits", "misses")}
        out["max_abs_diff"] = (got - model(input_ids=ids).logits).abs().max().item()
    return out


def _spawn(mode: str, size: str, cache_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, __file__, "--child", mode, size, cache_dir], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr[-2000:]}
    return json.loads(lines[-1])


def run(sizes: list[str], repeat: int) -> dict:
    doc: dict = {"repeat": repeat, "load_average": os.getloadavg(), "sizes": {}}
    for size in sizes:
        with tempfile.TemporaryDirectory() as cache_dir:
            cold = _spawn("backend", size, cache_dir)
            runs: dict[str, list[dict]] = {m: [] for m in MODES}
            for _ in range(repeat):
                for mode in MODES:
                    runs[mode].append(_spawn(mode, size, cache_dir))
        row: dict = {"cold_first_call_s": cold.get("first_call_s"), "cold_frames": cold.get("frames")}
        for mode, items in runs.items():
            good = [r for r in items if "error" not in r]
            row[mode] = {
                "first_call_s": statistics.median(r["first_call_s"] for r in good) if good else None,
                "compile_s": statistics.median(r["compile_s"] for r in good) if good else None,
                "all_s": [round(r["first_call_s"], 4) for r in good],
                "frames": [r["frames"] for r in good],
                "max_abs_diff": max((r["max_abs_diff"] for r in good), default=None),
                "errors": [r["error"][-300:] for r in items if "error" in r],
            }
        if row["load"]["first_call_s"] and row["backend"]["first_call_s"]:
            row["backend_over_load"] = row["backend"]["first_call_s"] / row["load"]["first_call_s"]
            row["backend_call_over_load"] = ((row["backend"]["first_call_s"] - row["backend"]["compile_s"])
                                             / row["load"]["first_call_s"])
        doc["sizes"][size] = row
        print(size, json.dumps(row)[:600], flush=True)
    return doc


def render(doc: dict) -> str:
    lines = [
        "# Backend route warm start vs `load()` (issue 18 item 1)",
        "",
        f"First call of a fresh process from the model built (seconds, median of {doc['repeat']}; eager inner "
        f"compiler; load average at start {doc['load_average'][0]:.1f}). `backend` = warm "
        "`torch.compile(model, backend=\"npu_cached\")`, the cached program installed into Dynamo's frame "
        "cache; `torch.compile()` = the part of it spent in the `torch.compile` call itself, before any frame.",
        "",
        "| model | eager | `load()` | backend route | of which `torch.compile()` | backend / load | (call only) / load "
        "| frames traced (backend) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, row in doc["sizes"].items():
        b = row["backend"]
        lines.append(
            f"| Llama {size} | {row['eager']['first_call_s']:.3f} | {row['load']['first_call_s']:.3f} | "
            f"{b['first_call_s']:.3f} | {b['compile_s']:.3f} | {row.get('backend_over_load', 0):.2f}x | "
            f"{row.get('backend_call_over_load', 0):.2f}x | {b['frames']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(*sys.argv[2:5])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,150m")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    doc = run(args.sizes.split(","), args.repeat)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "backend_route.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(RESULTS, "backend_route.md"), "w") as f:
        f.write(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
