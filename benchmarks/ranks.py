"""Ranks sharing compiles: ``torchrun --nproc-per-node N`` (gloo, CPU) with ``cache_compile``.

Three runs of the same job: N ranks with one shared cache root (each distinct
graph compiled once, the other ranks wait and load it), N ranks with a cache
root each (every rank compiles everything, as separate caches do), and a warm
restart of the shared one. Reported per run: the sum over ranks of compile
seconds (``stats().compile_seconds``), misses and hits, the slowest rank's first
call and the job's wall time.

usage: python benchmarks/ranks.py [--model gpt] [--compiler inductor] [--ranks 4] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _rank_main(root: str, out_dir: str, model_name: str, compiler: str, separate: bool) -> None:
    import torch
    import torch.distributed as dist

    import torchair_cached_backend as tcb

    sys.path.insert(0, HERE)
    from models import build

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, x = build(model_name)
    cache = os.path.join(root, f"rank{rank}") if separate else root
    fn = tcb.cache_compile(model.forward, cache_dir=cache, compiler=compiler)
    dist.barrier()
    t0 = time.perf_counter()
    with torch.no_grad():
        y = fn(x)
    first = time.perf_counter() - t0
    s = tcb.stats()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"first_call_s": first, "compile_seconds": s.compile_seconds, "misses": s.misses, "hits": s.hits,
                   "bypass_loads": s.bypass_loads, "max_abs_diff": (y - model(x)).abs().max().item()}, f)
    dist.barrier()
    dist.destroy_process_group()


def _job(work: str, name: str, root: str, args: argparse.Namespace, separate: bool) -> dict:
    out = os.path.join(work, name)
    os.makedirs(out)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", TORCHINDUCTOR_VEC_ISA_OK="1",
               TORCHINDUCTOR_CACHE_DIR=os.path.join(work, f"inductor_{name}"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
           os.path.abspath(__file__), "--rank-child", root, out, args.model, args.compiler, str(int(separate))]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-4000:]}")
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.ranks)]
    return {
        "wall_s": wall,
        "total_compile_s": sum(r["compile_seconds"] for r in ranks),
        "misses": sum(r["misses"] for r in ranks),
        "hits": sum(r["hits"] for r in ranks),
        "bypass_loads": sum(r["bypass_loads"] for r in ranks),
        "slowest_first_call_s": max(r["first_call_s"] for r in ranks),
        "max_abs_diff": max(r["max_abs_diff"] for r in ranks),
        "per_rank": ranks,
    }


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--rank-child":
        root, out, model, compiler, separate = sys.argv[2:7]
        _rank_main(root, out, model, compiler, separate == "1")
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--compiler", default="inductor")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "ranks.json"))
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="tcb_ranks_bench_")
    doc: dict = {"model": args.model, "compiler": args.compiler, "ranks": args.ranks, "cores": os.cpu_count(),
                 "loadavg_start": list(os.getloadavg())}
    doc["separate_caches_cold"] = _job(work, "separate", os.path.join(work, "separate"), args, separate=True)
    doc["shared_cache_cold"] = _job(work, "shared", os.path.join(work, "shared"), args, separate=False)
    doc["shared_cache_warm"] = _job(work, "shared_warm", os.path.join(work, "shared"), args, separate=False)
    doc["compile_seconds_saved"] = doc["separate_caches_cold"]["total_compile_s"] - doc["shared_cache_cold"]["total_compile_s"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "per_rank"}
                      for k, v in doc.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
