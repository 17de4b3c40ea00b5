"""The remote tier: a fresh node's first call from a local cache, from Redis, and cold; a fleet start.

A private ``redis-server`` on a loopback port. Each measurement is a fresh process
("node") with its own empty Inductor cache dir (GPT, 4 layers, Inductor kernels):

* ``cold``: empty local cache, no remote: compiles;
* ``local``: the cache dir filled by the cold node, bypass ``load()``;
* ``redis``: an empty local cache dir and the remote the cold node published to,
  bypass ``load()``: fetches the program and graphs (verified), writes them locally,
  loads them; bytes transferred are ``stats().remote_bytes_in``;
* ``fleet``: N nodes (separate cache dirs) start at once against one *empty*
  remote through ``torch.compile``: compile work summed over the nodes (one
  compile per graph fleet-wide when the single-flight lock works).

Reported: first call (model built -> first output; median of ``--repeat``), bytes,
misses/compile seconds. JSON + markdown into benchmarks/results/.

usage: python benchmarks/remote.py [--model gpt] [--repeat 3] [--nodes 8] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from harness import report, spawn, write_outputs  # noqa: E402


def _child(args: argparse.Namespace) -> None:
    import torch
    from models import build

    import torchair_cached_backend as tcb

    model, x = build(args.model)
    opts = {"compiler": "inductor"}
    if args.remote:
        opts["remote"] = args.remote
    if args.barrier:
        time.sleep(max(0.0, args.barrier - time.time()))
    t0 = time.perf_counter()
    with torch.no_grad():
        if args.route == "bypass":
            fn = tcb.load(model, args.cache, **opts)
        else:
            fn = torch.compile(model, backend="npu_cached", options=dict(opts, cache_dir=args.cache))
        y = fn(x)
        first = time.perf_counter() - t0
        diff = (y - model(x)).abs().max().item()
    s = tcb.stats()
    report({"first_call_s": first, "max_abs_diff": diff, "misses": s.misses, "hits": s.hits,
            "compile_seconds": s.compile_seconds, "remote_hits": s.remote_hits, "remote_faults": s.remote_faults,
            "remote_bytes_in": s.remote_bytes_in, "remote_bytes_out": s.remote_bytes_out,
            "bypass_loads": s.bypass_loads, "dynamo_imported": "torch._dynamo" in sys.modules,
            "inductor_imported": "torch._inductor" in sys.modules})


class Server:
    def __init__(self, workdir: str) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", workdir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def used_memory(self, db: int) -> int:
        import redis

        return int(redis.Redis(port=self.port, db=db).info("memory")["used_memory"])

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)


def _node(tmp: str, name: str, args: argparse.Namespace, *extra: str) -> dict:
    return spawn(__file__, ["--model", args.model, "--cache", os.path.join(tmp, name), *extra],
                 os.path.join(tmp, name + "-inductor"), 1800, _child_env())


def _child_env() -> dict[str, str]:
    """This checkout's package first (not whatever the venv has installed)."""
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
            "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", action="store_true")
    p.add_argument("--model", default="gpt")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--cache")
    p.add_argument("--remote")
    p.add_argument("--route", default="bypass")
    p.add_argument("--barrier", type=float, default=0.0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "remote.json"))
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    tmp = tempfile.mkdtemp(prefix="tcb_bench_remote_")
    os.chmod(tmp, 0o700)
    server = Server(tmp)
    try:
        url = server.url(1)
        cold = _node(tmp, "cold", args, "--route", "compile", "--remote", url)
        runs: dict[str, list[dict]] = {"local": [], "redis": []}
        for i in range(args.repeat):
            runs["local"].append(_node(tmp, "cold", args, "--route", "bypass"))
            runs["redis"].append(_node(tmp, f"fresh{i}", args, "--route", "bypass", "--remote", url))
        fleet_url = server.url(2)
        barrier = time.time() + 20  # after every node has imported torch
        procs = []
        for i in range(args.nodes):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--route", "compile",
                   "--cache", os.path.join(tmp, f"fleet{i}"), "--remote", fleet_url, "--barrier", str(barrier)]
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, f"fleet{i}-inductor"), **_child_env())
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        import json

        fleet = []
        for proc in procs:
            out, err = proc.communicate(timeout=3600)
            line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
            fleet.append(json.loads(line[7:]) if line else {"error": (err.strip().splitlines() or ["?"])[-1][:300]})
        wall = max((r.get("first_call_s", 0.0) for r in fleet), default=0.0)
        doc = {
            "model": args.model, "compiler": "inductor", "repeat": args.repeat, "cpus": os.cpu_count(),
            "cold": cold,
            "local": runs["local"], "redis": runs["redis"],
            "median_first_call_s": {
                "cold": cold.get("first_call_s"),
                "local": statistics.median(r.get("first_call_s", float("nan")) for r in runs["local"]),
                "redis": statistics.median(r.get("first_call_s", float("nan")) for r in runs["redis"]),
            },
            "bytes_from_redis": statistics.median(r.get("remote_bytes_in", 0) for r in runs["redis"]),
            "bytes_published_by_cold": cold.get("remote_bytes_out"),
            "fleet": {"nodes": args.nodes, "per_node": fleet,
                      "misses_total": sum(r.get("misses", 0) for r in fleet),
                      "compile_seconds_total": sum(r.get("compile_seconds", 0.0) for r in fleet),
                      "remote_hits_total": sum(r.get("remote_hits", 0) for r in fleet),
                      "slowest_first_call_s": wall,
                      "graphs": cold.get("misses")},
        }
        write_outputs(doc, args.out, render)
    finally:
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)


def render(doc: dict) -> str:
    med = doc["median_first_call_s"]
    fleet = doc["fleet"]
    red = doc["redis"][0] if doc["redis"] else {}
    lines = [
        f"# Remote tier: a fresh node's first call ({doc['model']}, Inductor kernels, {doc['cpus']} CPUs)",
        "",
        f"Fresh process per row, empty Inductor cache dir; first call = model built -> first output "
        f"(median of {doc['repeat']}; cold: 1 run).",
        "",
        "| node starts from | first call (s) | Dynamo / Inductor imported | bytes fetched |",
        "|---|---|---|---|",
        f"| cold (nothing cached) | {_s(med['cold'], '.2f')} | {_yn(doc['cold'])} | 0 |",
        f"| its local cache (bypass `load`) | {_s(med['local'])} | {_yn(doc['local'][0] if doc['local'] else {})} | 0 |",
        f"| Redis on localhost, empty local cache (bypass `load`) | {_s(med['redis'])} | {_yn(red)} | "
        f"{doc['bytes_from_redis']:,.0f} |",
        "",
        f"The cold node published {doc['bytes_published_by_cold'] or 0:,} bytes (records + content-addressed blobs).",
        "",
        f"## {fleet['nodes']} nodes starting at once against one empty remote (`torch.compile`, separate cache dirs)",
        "",
        "| graphs | compiles summed over nodes | compile seconds summed | entries served from Redis | slowest first call (s) |",
        "|---|---|---|---|---|",
        f"| {fleet['graphs']} | {fleet['misses_total']} | {fleet['compile_seconds_total']:.1f} | "
        f"{fleet['remote_hits_total']} | {fleet['slowest_first_call_s']:.1f} |",
        "",
    ]
    return "\n".join(lines)


def _s(value: object, fmt: str = ".3f") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "error"


def _yn(rep: dict) -> str:
    return f"{'yes' if rep.get('dynamo_imported') else 'no'} / {'yes' if rep.get('inductor_imported') else 'no'}"


if __name__ == "__main__":
    main()
