"""Bundle round trip: build a cache once, pack it, unpack it on "another node", start warm.

Measures, for one model (default the 4-layer GPT with Inductor kernels): the cold
compile that fills the cache, pack seconds and bundle size per compression,
verify and unpack seconds, and the first call of a fresh process warm-started
from the unpacked cache with an empty TORCHINDUCTOR_CACHE_DIR (no Dynamo).

usage: python benchmarks/bundle_roundtrip.py [--model gpt] [--compiler inductor] [--out PATH]
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
RESULT_TAG = "RESULT "
CHILD_ENV = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1"}


def _child(action: str, model_name: str, cache: str, compiler: str) -> dict:
    t = time.perf_counter()
    import torch

    import torchair_cached_backend as tcb

    sys.path.insert(0, HERE)
    from models import build

    with torch.no_grad():
        model, x = build(model_name)
        t0 = time.perf_counter()
        if action == "cold":
            fn = torch.compile(model, backend="npu_cached", options={"cache_dir": cache, "compiler": compiler})
        else:
            fn = tcb.load(model, cache, compiler=compiler, fallback=False)
        y = fn(x)
        first = time.perf_counter() - t0
        diff = (y - model(x)).abs().max().item()
    return {
        "first_call_s": first,
        "process_to_first_output_s": time.perf_counter() - t,
        "max_abs_diff": diff,
        "imported_dynamo": "torch._dynamo" in sys.modules,
        "imported_inductor": "torch._inductor" in sys.modules,
        "stats": tcb.stats().as_dict(),
    }


def _spawn(action: str, model: str, cache: str, compiler: str, inductor_dir: str) -> dict:
    os.makedirs(inductor_dir, exist_ok=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, PYTHONPATH=REPO, **CHILD_ENV)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", action, model, cache, compiler]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return dict(json.loads(line[len(RESULT_TAG):]), wall_s=time.perf_counter() - t)
    raise RuntimeError(f"{action} child failed:\n{proc.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--compiler", default="inductor")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bundle_roundtrip.json"))
    parser.add_argument("--child", nargs=4, metavar=("ACTION", "MODEL", "CACHE", "COMPILER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(RESULT_TAG + json.dumps(_child(*args.child)))
        return 0

    sys.path.insert(0, REPO)
    from torchair_cached_backend.bundle import pack, unpack, verify
    from torchair_cached_backend.inventory import disk_size

    work = tempfile.mkdtemp(prefix="tcb_bundle_bench_")
    built, node = os.path.join(work, "built"), os.path.join(work, "node")
    doc: dict = {"model": args.model, "compiler": args.compiler, "loadavg_start": list(os.getloadavg())}
    doc["cold"] = _spawn("cold", args.model, built, args.compiler, os.path.join(work, "inductor_build"))
    doc["cache_bytes"] = disk_size(built)
    doc["pack"] = {}
    for compression, name in (("none", "cache.tar"), ("gz", "cache.tar.gz"), ("xz", "cache.tar.xz")):
        out = pack(built, os.path.join(work, name))
        doc["pack"][compression] = {"seconds": out["seconds"], "bundle_bytes": out["bundle_bytes"],
                                    "payload_bytes": out["payload_bytes"], "entries": out["entries"]}
    os.environ["TORCHAIR_CACHE_KEY"] = "benchmark-key"
    signed = pack(built, os.path.join(work, "signed.tar.gz"))
    doc["pack"]["gz_signed"] = {"seconds": signed["seconds"], "bundle_bytes": signed["bundle_bytes"]}
    doc["verify_gz_signed_s"] = verify(os.path.join(work, "signed.tar.gz"))["seconds"]
    t = time.perf_counter()
    unpacked = unpack(os.path.join(work, "signed.tar.gz"), node)
    doc["unpack_gz_signed"] = {"seconds": time.perf_counter() - t, "published": unpacked["published"]}
    doc["warm_from_bundle"] = _spawn("warm", args.model, node, args.compiler, os.path.join(work, "inductor_empty"))
    doc["warm_inductor_dir_files"] = len(os.listdir(os.path.join(work, "inductor_empty")))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
