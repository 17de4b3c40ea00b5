"""Store maintenance and per-graph cost against the cache's size (issue 14).

For caches of 100, 1000 and 10 000 synthetic graph entries (a manifest plus two
blobs, 1 KiB and 4 KiB, as small graphs are) it measures, in this process:

* ``ls`` / ``validate`` (every checksum) / ``prune`` (a full scan that removes
  nothing) over the whole cache: these must grow linearly;
* a new graph's store cost, as the backend pays it on a miss: the key's lock, the
  save and ``max_size`` (with a bound the cache stays under): this must stay flat;
* a hit's load of one entry;
* a program miss (a function with no program, as the backend route looks up every frame the
  replayed code calls): explaining it must not read every program's manifest. The process's first
  miss lists the store's directory once (linear in entries, as ``ls``); later misses reuse that
  listing while the directory is unchanged, and must stay flat.

usage: python benchmarks/store_scale.py [--sizes 100,1000,10000] [--out benchmarks/results/store_scale]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from torchair_cached_backend import cli  # noqa: E402
from torchair_cached_backend.prune import bound, prune  # noqa: E402
from torchair_cached_backend.store import Store  # noqa: E402

BLOBS = {"graph.py": b"x" * 1024, "k.so": b"\x7fELF" * 1024}
NEW_GRAPHS = 20


def _fill(cache: str, n: int) -> None:
    """n entries written directly (the layout Store.save writes, without its fsyncs)."""
    gdir = os.path.join(cache, "graphs")
    os.makedirs(gdir, mode=0o700)
    os.chmod(cache, 0o700)
    infos = {name: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for name, d in BLOBS.items()}
    now = time.time()
    for i in range(n):
        key = hashlib.sha256(str(i).encode()).hexdigest()
        entry = os.path.join(gdir, key)
        os.makedirs(os.path.join(entry, "files"), mode=0o700)
        for name, data in BLOBS.items():
            with open(os.path.join(entry, "files", name), "wb") as f:
                f.write(data)
        manifest = {"identity": f"id{i % 50}", "compiler": "eager", "factors": {"n": i}, "versions": {},
                    "meta": {}, "key": key, "kind": "graphs", "files": infos, "created": now - i, "last_used": now - i}
        with open(os.path.join(entry, "manifest.json"), "w") as f:
            json.dump(manifest, f)
    with open(os.path.join(cache, "CACHEDIR.TAG"), "w") as f:
        f.write("Signature: 8a477f597d28d172789f06886806bc55\n")


def _fill_programs(cache: str, n: int) -> None:
    """n program entries of other functions (a manifest each, keyed as ``program_key`` keys them)."""
    from torchair_cached_backend.bypass.program import PROGRAM_FORMAT, function_prefix

    pdir = os.path.join(cache, "programs")
    os.makedirs(pdir, mode=0o700)
    now = time.time()
    for i in range(n):
        identity = {"module": f"models.m{i % 200}", "qualname": f"Layer{i}.forward", "receiver_type": None}
        key = function_prefix(identity, "eager") + hashlib.sha256(str(i).encode()).hexdigest()[16:]
        os.makedirs(os.path.join(pdir, key, "files"), mode=0o700)
        program = {"format": PROGRAM_FORMAT, "function": identity, "compiler": "eager", "fingerprint": str(i)}
        manifest = {"program": program, "key": key, "kind": "programs", "files": {}, "versions": {},
                    "created": now, "last_used": now}
        with open(os.path.join(pdir, key, "manifest.json"), "w") as f:
            json.dump(manifest, f)


def _program_miss_ms(cache: str) -> tuple[float, float]:
    """(a process's first program miss, a later one), ms, median of 5 each."""
    from torchair_cached_backend.bypass import loader_miss
    from torchair_cached_backend.bypass.program import PROGRAMS, function_prefix, program_store

    def absent(x):
        return x

    identity = {"module": __name__, "qualname": "absent", "receiver_type": None}
    key = function_prefix(identity, "eager") + "0" * 48
    store = program_store(cache)
    past = time.time() - 60  # as a warm start finds it: written by an earlier process
    os.utime(os.path.join(cache, PROGRAMS), (past, past))
    first, later = [], []
    for _ in range(5):
        loader_miss._listings.clear()  # a fresh process: no listing yet
        for times in (first, later):
            t0 = time.perf_counter()
            loader_miss._why_missing(store, identity, key, absent.__code__, "eager", cache, "absent")
            times.append(time.perf_counter() - t0)
    return sorted(first)[2] * 1e3, sorted(later)[2] * 1e3


def _quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def measure(n: int, work: str) -> dict:
    cache = os.path.join(work, f"c{n}")
    t0 = time.perf_counter()
    _fill(cache, n)
    fill_s = time.perf_counter() - t0
    store = Store(cache, "graphs")
    row = {"entries": n, "fill_seconds": round(fill_s, 3)}
    row["ls_seconds"] = _timed(_quiet, cli.main, ["ls", cache])
    row["validate_seconds"] = _timed(_quiet, cli.main, ["validate", cache])
    row["prune_scan_seconds"] = _timed(prune, cache, 1 << 50)
    bound(store, 1 << 50, "")  # max_size is on: the first store after start counts the cache once
    costs = []
    for i in range(NEW_GRAPHS):
        key = hashlib.sha256(f"new{n}-{i}".encode()).hexdigest()
        t0 = time.perf_counter()
        with store.lock(key):
            store.save(key, dict(BLOBS), {"identity": "id-new", "versions": {}})
            bound(store, 1 << 50, key)
        costs.append(time.perf_counter() - t0)
    costs.sort()
    row["new_graph_store_ms_median"] = costs[len(costs) // 2] * 1e3
    row["new_graph_store_ms_max"] = costs[-1] * 1e3
    key = store.keys()[n // 2]
    loads = sorted(_timed(store.load, key) for _ in range(20))
    row["hit_load_ms_median"] = loads[len(loads) // 2] * 1e3
    _fill_programs(cache, n)
    row["program_miss_ms"], row["program_miss_later_ms"] = _program_miss_ms(cache)
    for k in ("ls_seconds", "validate_seconds", "prune_scan_seconds"):
        row[k] = round(row[k], 3)
        row[k.replace("_seconds", "_us_per_entry")] = round(row[k] / n * 1e6, 1)
    for k in ("new_graph_store_ms_median", "new_graph_store_ms_max", "hit_load_ms_median", "program_miss_ms",
              "program_miss_later_ms"):
        row[k] = round(row[k], 2)
    shutil.rmtree(cache)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "store_scale"))
    parser.add_argument("--work", default=None, help="where to build the caches (default: a temp dir)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        for n in (int(s) for s in args.sizes.split(",")):
            rows.append(measure(n, work))
            print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "store_scale", "python": sys.version.split()[0], "cpus": os.cpu_count(), "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [
        "# Store scale (benchmarks/store_scale.py)",
        "",
        "Synthetic graph entries (manifest + 1 KiB + 4 KiB blobs). Maintenance over the whole cache "
        "(seconds, and microseconds per entry) and what one new graph costs the store on a miss "
        f"(lock + save + `max_size` via the size ledger; median / max of {NEW_GRAPHS}).",
        "",
        "| entries | ls s (us/entry) | validate s (us/entry) | prune scan s (us/entry) | new graph store ms (median / max) | hit load ms | program miss ms, first / later of a process (as many programs) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['entries']} | {r['ls_seconds']} ({r['ls_us_per_entry']}) | {r['validate_seconds']} "
            f"({r['validate_us_per_entry']}) | {r['prune_scan_seconds']} ({r['prune_scan_us_per_entry']}) | "
            f"{r['new_graph_store_ms_median']} / {r['new_graph_store_ms_max']} | {r['hit_load_ms_median']} | "
            f"{r['program_miss_ms']} / {r['program_miss_later_ms']} |"
        )
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
