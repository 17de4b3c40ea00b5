"""Cost of sealing and verifying GE's run-time cache (``runtime_cache.py``).

A published graph entry gets a fake GE compiled model of ``--mb`` MB (random bytes, as
incompressible as an ``.om``) in ``files/ge_cache/``. Measured, median of ``--repeat``:

* seal: what the first run's return costs the process that created the cache (walk,
  sha256 of every file, the seal written atomically);
* verify: what a warm start pays before GE is pointed at the cache (``prepare``: walk
  by dir fds, seal parsed, sha256 of every file against it);
* recheck: the stat-only walk after the first run / at exit of a verified start;

each in ms and in µs per MB, with hashlib's bare sha256 over the same bytes in memory
for scale. Files are in the page cache (a warm start's usual case).

usage: python benchmarks/runtime_cache_seal.py [--mb 50] [--repeat 7] [--out benchmarks/results/runtime_cache_seal]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from torchair_cached_backend import runtime_cache as rc  # noqa: E402
from torchair_cached_backend.store import Store  # noqa: E402

KEY = "b" * 64


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(mb: int, repeat: int) -> dict:
    data = os.urandom(mb << 20)
    with tempfile.TemporaryDirectory() as tmp:
        entry = Store(os.path.join(tmp, "cache"), "graphs").save(KEY, {"torchair_graph.py": b"pass\n"}, {})
        files_dir = os.path.join(entry, "files")
        first = rc.prepare(files_dir, "ge_cache")
        with open(os.path.join(first.path, "model.om"), "wb") as f:
            f.write(data)
        with open(os.path.join(first.path, "model.idx"), "w") as f:
            f.write('{"graph": "g"}')
        first.after_run()  # sealed once (and the bytes in the page cache)

        def seal() -> None:
            assert first.seal()
            os.unlink(os.path.join(files_dir, "ge_cache.seal.json"))  # the next seal writes again

        seal_s = _median_s(seal, repeat)
        first.seal()
        caches = []

        def verify() -> None:
            cache = rc.prepare(files_dir, "ge_cache")
            assert cache is not None and not cache.writer
            caches.append(cache)

        verify_s = _median_s(verify, repeat)
        recheck_s = _median_s(lambda: caches[-1]._changed(), repeat)
        sha_s = _median_s(lambda: hashlib.sha256(data).hexdigest(), repeat)
    per_mb = lambda s: round(s * 1e6 / mb, 1)  # noqa: E731
    return {
        "mb": mb, "repeat": repeat,
        "seal_ms": round(seal_s * 1e3, 2), "seal_us_per_mb": per_mb(seal_s),
        "verify_ms": round(verify_s * 1e3, 2), "verify_us_per_mb": per_mb(verify_s),
        "recheck_stat_only_us": round(recheck_s * 1e6, 1),
        "sha256_in_memory_us_per_mb": per_mb(sha_s),
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "runtime_cache_seal"))
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    result = run(args.mb, args.repeat)
    result["note"] = args.note
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    md = [
        f"# GE run-time cache: seal and verify ({args.mb} MB fake .om, median of {args.repeat})",
        "",
        "| step | ms | µs per MB |",
        "|---|---|---|",
        f"| seal (first run returned: walk, sha256, atomic seal write) | {result['seal_ms']} | {result['seal_us_per_mb']} |",
        f"| verify (warm start, before GE is pointed at it) | {result['verify_ms']} | {result['verify_us_per_mb']} |",
        f"| bare sha256 in memory (for scale) | | {result['sha256_in_memory_us_per_mb']} |",
        "",
        f"Re-check after the first run / at exit (stat only): {result['recheck_stat_only_us']} µs.",
        "",
        f"{result['note']}",
    ]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
