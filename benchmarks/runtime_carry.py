"""Carrying a large GE run-time cache (``runtime_carry.py``): bundles and the Redis tier.

A graph entry gets a fake GE compiled model of ``--mb`` MiB (random bytes in 1 MiB pieces,
as incompressible as an ``.om``), sealed. Each step runs in a fresh interpreter that reports
its wall time and its peak-RSS growth (``ru_maxrss`` after the imports, before and after):

* pack: ``bundle.pack`` of the cache (plain tar);
* unpack: ``bundle.unpack`` of that bundle into an empty dir (every byte checked, staged, renamed);
* publish: ``RedisRemote.put_runtime`` to a private ``redis-server`` (chunks of ``chunk`` bytes);
* fetch: a fresh node's ``runtime_cache.prepare`` taking it from the remote (streamed into a
  staging dir, checked against the seal, renamed, verified again as installed).

Median and min-max of ``--repeat`` rounds (round-robin). usage:
python benchmarks/runtime_carry.py [--mb 256] [--repeat 7] [--out benchmarks/results/runtime_carry.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's package, as the children

from harness import report, spawn, write_outputs  # noqa: E402

KEY = "d" * 64
STEPS = ("pack", "unpack", "publish", "fetch")


def _child(step: str, a: str, b: str, url: str, mb: int) -> None:
    import resource

    import redis  # noqa: F401 - imported before the baseline

    from torchair_cached_backend import bundle, runtime_cache, runtime_carry
    from torchair_cached_backend.remote import RedisRemote
    from torchair_cached_backend.store import Store

    def rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    if step == "setup":
        files = os.path.join(Store(a, "graphs").save(KEY, {"g.py": b"1"}, {"compiler": "torchair"}), "files")
        cache = runtime_cache.prepare(files, "ge_cache")
        with open(os.path.join(cache.path, "model.om"), "wb") as f:
            for _ in range(mb):
                f.write(os.urandom(1 << 20))
        cache.after_run()
        report({"files": files})
        return
    before, t0 = rss(), time.perf_counter()
    if step == "pack":
        bundle.pack(a, b)
    elif step == "unpack":
        bundle.unpack(a, b)
    elif step == "publish":
        assert RedisRemote(url).put_runtime("graphs", KEY, runtime_carry.sealed_caches(a)[0]["ge_cache"])
    elif step == "fetch":
        files = os.path.join(Store(b, "graphs").save(KEY, {"g.py": b"1"}, {"compiler": "torchair"}), "files")
        before, t0 = rss(), time.perf_counter()
        cache = runtime_cache.prepare(files, "ge_cache")
        assert cache is not None and not cache.writer, "not taken from the remote"
    report({"seconds": time.perf_counter() - t0, "rss_growth_mib": (rss() - before) / (1 << 20)})


def _redis(work: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", work],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.02)
    raise RuntimeError("redis-server did not start")


def run(mb: int, repeat: int) -> dict:
    script = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = _redis(tmp)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            src = os.path.join(tmp, "src")
            made = spawn(script, ["setup", src, "", url, str(mb)], os.path.join(tmp, "ind"), 600, {})
            if "error" in made:
                raise RuntimeError(made["error"])
            rounds: dict[str, list[dict]] = {s: [] for s in STEPS}
            for i in range(repeat):
                archive, target = os.path.join(tmp, f"b{i}.tar"), os.path.join(tmp, f"t{i}")
                args = {"pack": [src, archive], "unpack": [archive, target], "publish": [made["files"], ""],
                        "fetch": ["", os.path.join(tmp, f"f{i}")]}
                for step in STEPS:
                    env = {"TORCHAIR_CACHE_REMOTE": url} if step == "fetch" else {}
                    got = spawn(script, [step, *args[step], url, str(mb)], os.path.join(tmp, "ind"), 600, env)
                    if "error" in got:
                        raise RuntimeError(f"{step}: {got['error']}")
                    rounds[step].append(got)
                for path in (archive, target, os.path.join(tmp, f"f{i}")):
                    shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        finally:
            proc.kill()
            proc.wait()
    from torchair_cached_backend.remote import _PARAMS

    out = {}
    for step, got in rounds.items():
        secs, rss = [g["seconds"] for g in got], [g["rss_growth_mib"] for g in got]
        out[step] = {"seconds_median": statistics.median(secs), "seconds_min": min(secs), "seconds_max": max(secs),
                     "mib_per_s": mb / statistics.median(secs), "rss_growth_mib_median": statistics.median(rss),
                     "rss_growth_mib_max": max(rss)}
    return {"mb": mb, "repeat": repeat, "chunk_bytes": _PARAMS["chunk"], "steps": out,
            "load_avg_1min": os.getloadavg()[0], "python": platform.python_version()}


def render(doc: dict) -> str:
    lines = [f"# A {doc['mb']} MiB GE run-time cache carried (median of {doc['repeat']}, fresh process per step)", "",
             "| step | s (median) | s (min-max) | MiB/s | peak RSS growth, MiB (median / max) |", "|---|---|---|---|---|"]
    for step, r in doc["steps"].items():
        lines.append(f"| {step} | {r['seconds_median']:.2f} | {r['seconds_min']:.2f}-{r['seconds_max']:.2f} | "
                     f"{r['mib_per_s']:.0f} | {r['rss_growth_mib_median']:.1f} / {r['rss_growth_mib_max']:.1f} |")
    lines += ["", f"Remote chunks: {doc['chunk_bytes'] >> 20} MiB (one SET/GET each, loopback redis-server). Taken "
              f"with the 2 cores shared with other helpers' test runs (1-min load average {doc['load_avg_1min']:.2f}): "
              "upper bounds.", ""]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:6], int(sys.argv[6]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--out", default=os.path.join(HERE, "results", "runtime_carry.json"))
    args = p.parse_args()
    doc = run(args.mb, args.repeat)
    write_outputs(doc, args.out, render)
    print(render(doc))


if __name__ == "__main__":
    main()
