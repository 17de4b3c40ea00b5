"""Warm start of a model with a graph break in every layer, by layer count.

A transformers Llama (random init, d=128, input (2, 24)) whose registered attention
function breaks the graph: every layer's attention and decoder-layer forwards are frames
of their own, replayed as callees, and Dynamo compiled the attention once per layer index,
so its program holds a variant per layer. Each layer's replay loads that program; this
measures how the warm first call grows with the layer count (the loads of one program
share it since ``bypass/shared_load.py``; before, every layer read, decoded and checked
every variant: O(layers^2)).

Per layer count and route (``load``, ``backend``): one untimed cold process fills the
cache and two untimed warm processes settle it (the first warm start compiles the attention
once more, see ``tests/test_callee_reach.py``); then fresh warm and eager processes
round-robin. With ``--baseline DIR`` (a checkout of an older commit) its package is
measured the same way, on its own cache, in the same round-robin.

usage: python benchmarks/layer_breaks.py [--layers 4,8,16] [--repeat 5] [--routes load,backend]
       [--baseline DIR] [--out benchmarks/results/layer_breaks.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CHILD_ENV = {"OMP_NUM_THREADS": "1"}


def _child(action: str, route: str, cache_dir: str, layers: int) -> dict:
    import torch
    import transformers  # noqa: F401  (imports Dynamo, as in every transformers process)
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def breaking_sdpa(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        torch._dynamo.graph_break()  # e.g. a kernel Dynamo cannot trace
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("breaking_sdpa", breaking_sdpa)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import hf_tiny

    hf_tiny.SIZES[f"breaks{layers}"] = hf_tiny.Size(128, layers, 4, 2, 24)
    out: dict = {}
    with torch.no_grad():
        model, inputs = hf_tiny.build("llama", size=f"breaks{layers}")
        model.config._attn_implementation = "breaking_sdpa"
        t0 = time.perf_counter()
        if action == "eager":
            model(**inputs)
            out["first_call_s"] = time.perf_counter() - t0
            return out
        from torch._dynamo.utils import counters

        import torchair_cached_backend as tcb

        if route == "load":
            fn = tcb.load(model, cache_dir, compiler="eager")
        else:
            fn = torch.compile(model, backend="npu_cached", options={"cache_dir": cache_dir, "compiler": "eager"})
        got = fn(**inputs)
        out["first_call_s"] = time.perf_counter() - t0
        s = tcb.stats().as_dict()
        out.update(frames=counters["frames"]["total"], bypass_loads=s["bypass_loads"], fallbacks=s["fallbacks"],
                   load_s=s["load_seconds"], package=os.path.dirname(tcb.__file__))
        out["max_abs_diff"] = (got.logits - model(**inputs).logits).abs().max().item()
    return out


def _spawn(action: str, route: str, cache_dir: str, layers: int, package_root: str, scratch: str) -> dict:
    env = dict(CHILD_ENV, PYTHONPATH=os.pathsep.join([os.path.abspath(package_root), HERE]))
    return harness.spawn(__file__, [action, route, cache_dir, str(layers)], os.path.join(scratch, "inductor"),
                         timeout=900, child_env=env)


def _median_ms(runs: list[dict], key: str = "first_call_s") -> float | None:
    values = [r[key] * 1e3 for r in runs if key in r]
    return statistics.median(values) if values else None


def render(doc: dict) -> str:
    rows = ["# Warm start with a graph break in every layer (transformers Llama, eager inner compiler)", "",
            f"d=128, input (2, 24); first call = model built -> first output (warm: import + load + call), median "
            f"of {doc['repeat']} fresh processes, ms. Baseline: {doc.get('baseline') or 'none'}. {doc.get('note', '')}", "",
            "| layers | route | eager | warm (now) | now / eager | warm (baseline) | baseline / eager "
            "| loads ms (now, `stats().load_seconds`) | bypass loads | frames traced | fallbacks | max abs diff |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in doc["rows"]:
        eager, now, base = row["eager_ms"], row["now_ms"], row.get("baseline_ms")
        last = row["now_runs"][-1] if row["now_runs"] else {}

        def ratio(x: float | None, eager: float | None = eager) -> str:
            return f"{x / eager:.2f}" if x and eager else "-"

        rows.append(f"| {row['layers']} | {row['route']} | {eager:.1f} | {now:.1f} | {ratio(now)} | "
                    f"{'-' if base is None else f'{base:.1f}'} | {ratio(base)} | "
                    f"{_median_ms(row['now_runs'], 'load_s') or 0:.1f} | {last.get('bypass_loads', '-')} | "
                    f"{last.get('frames', '-')} | {last.get('fallbacks', '-')} | {last.get('max_abs_diff', '-')} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        harness.report(_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="4,8,16")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--routes", default="load,backend")
    p.add_argument("--baseline", default=None, help="a checkout of an older commit to measure alongside")
    p.add_argument("--out", default=os.path.join(HERE, "results", "layer_breaks.json"))
    a = p.parse_args()
    doc: dict = {"repeat": a.repeat, "baseline": a.baseline, "rows": []}
    with tempfile.TemporaryDirectory(prefix="tcb-layer-breaks-") as scratch:
        for layers in map(int, a.layers.split(",")):
            for route in a.routes.split(","):
                packages = {"now": REPO, **({"baseline": a.baseline} if a.baseline else {})}
                caches = {name: os.path.join(scratch, f"{name}-{layers}-{route}") for name in packages}
                for name, root in packages.items():
                    for action in ("cold", "warm", "warm"):
                        _spawn(action, route, caches[name], layers, root, scratch)
                runs: dict[str, list[dict]] = {"eager": [], **{name: [] for name in packages}}
                for _ in range(a.repeat):
                    runs["eager"].append(_spawn("eager", route, caches["now"], layers, REPO, scratch))
                    for name, root in packages.items():
                        runs[name].append(_spawn("warm", route, caches[name], layers, root, scratch))
                row = {"layers": layers, "route": route, "eager_ms": _median_ms(runs["eager"]),
                       "now_ms": _median_ms(runs["now"]), "now_runs": runs["now"]}
                if a.baseline:
                    row.update(baseline_ms=_median_ms(runs["baseline"]), baseline_runs=runs["baseline"])
                doc["rows"].append(row)
                print(f"layers {layers} {route}: eager {row['eager_ms']:.1f} ms, now {row['now_ms']:.1f} ms"
                      + (f", baseline {row['baseline_ms']:.1f} ms" if a.baseline else ""), flush=True)
    harness.write_outputs(doc, a.out, render)


if __name__ == "__main__":
    main()
