"""Warm start through the REAL torchair on CPU: ours vs torchair's own ``cache_compile``.

Both run the same model in fresh processes over CANN stub libraries (the
project's harness in tests/torchair_harness; GE execution is shimmed to return
zeros, so this measures everything but the device work): a cold process fills
each cache, then ``--repeat`` warm processes per side, interleaved.

    python benchmarks/torchair_warm_start.py [--repeat 5] [--out benchmarks/results/torchair_warm_start.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.torchair_harness.run import run_script  # noqa: E402

MODEL = """
import json, sys, time
t_start = time.perf_counter()
import torch, torch.nn as nn, torch.nn.functional as F
import torchair
t_imported = time.perf_counter()

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln(x))))

class Model(nn.Module):
    def __init__(self, cache_compile, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(64) for _ in range({layers}))
        self.head = nn.Linear(64, 16)
        self.cached = cache_compile(self.prompt, cache_dir={cache!r}, **kw)

    def forward(self, x):
        return self.cached(x)

    def prompt(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)
"""

SIDES = {
    "torchair": "from torchair.inference import cache_compile\nmodel = Model(cache_compile)\n",
    "ours": "import torchair_cached_backend as tcb\nmodel = Model(tcb.cache_compile, compiler='torchair')\n",
}

MEASURE = """
x = torch.ones(2, 8, 64)
t0 = time.perf_counter()
with torch.no_grad():
    out = model(x)
first = time.perf_counter() - t0
stats = None
if "torchair_cached_backend" in sys.modules:
    import torchair_cached_backend as tcb
    stats = tcb.stats().as_dict()
print(json.dumps({"first_call_s": first, "import_s": t_imported - t_start, "shape": list(out.shape),
                  "dynamo_imported": "torch._dynamo" in sys.modules, "stats": stats}))
"""


def run_side(side: str, cache: str, layers: int) -> dict:
    t0 = time.perf_counter()
    # an installed package has .pyc files: let both sides use them (None removes the variable)
    env = {"PYTHONDONTWRITEBYTECODE": None}
    proc = run_script(MODEL.format(cache=cache, layers=layers) + SIDES[side] + MEASURE, timeout=600, shim=True, env=env)
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    result["process_s"] = time.perf_counter() - t0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "torchair_warm_start.json"))
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="tcb-torchair-bench-")
    caches = {side: os.path.join(work, side) for side in SIDES}
    cold = {side: run_side(side, caches[side], args.layers) for side in SIDES}
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for _ in range(args.repeat):
        for side in SIDES:  # interleaved, so machine drift hits both alike
            runs[side].append(run_side(side, caches[side], args.layers))
    summary = {}
    for side, rs in runs.items():
        firsts = [r["first_call_s"] for r in rs]
        summary[side] = {
            "cold_first_call_s": cold[side]["first_call_s"],
            "first_call_s": firsts,
            "median_first_call_s": statistics.median(firsts),
            "median_process_s": statistics.median(r["process_s"] for r in rs),
            "median_import_torch_torchair_s": statistics.median(r["import_s"] for r in rs),
            "dynamo_imported": [r["dynamo_imported"] for r in rs],
            "last_stats": rs[-1]["stats"],
        }
    ratio = summary["ours"]["median_first_call_s"] / summary["torchair"]["median_first_call_s"]
    report = {
        "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "python": platform.python_version()},
        "model": f"{args.layers} MLP blocks d=64 + head, input (2, 8, 64), dynamic=True, GE max-autotune",
        "note": "real torchair Python over CANN stubs; GE execution shimmed (zeros)",
        "repeat": args.repeat,
        "results": summary,
        "ours_over_torchair_first_call": ratio,
        "target_ours_not_slower": ratio <= 1.0,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for side, s in summary.items():
        print(f"{side:9} cold {s['cold_first_call_s']:7.3f} s   warm first call median {s['median_first_call_s']:7.3f} s "
              f"(process {s['median_process_s']:.2f} s)   dynamo imported: {s['dynamo_imported'][-1]}")
    print(f"ours / torchair warm first call: {ratio:.3f}  -> {'met' if ratio <= 1.0 else 'NOT met'}  ({args.out})")


if __name__ == "__main__":
    main()
