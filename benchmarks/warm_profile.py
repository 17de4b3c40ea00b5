"""Fixed cost of a warm start on a tiny transformers Llama: where the milliseconds go.

A tiny model makes eager's first call a few milliseconds, so what remains of a warm
``tcb.load`` start is the replay's own cost: importing the package (with Dynamo
already imported, as transformers does), ``tcb.load`` (read, verify, decode, checks,
load-time guards, graphs) and the first call. One untimed cold process fills the cache
(``torch.compile(model, backend="npu_cached")``, eager inner compiler); then fresh warm
and eager processes run round-robin. Warm children run with ``TCB_PROFILE=1`` and keep
the breakdown line it prints.

With several layer counts (``--layers 4,8,16``) the first gets the full table and every
count a row of the scaling table: guards recorded at load, checks the generated load-time
function evaluates, program manifest and guards blob sizes, ``tcb.load`` time.

usage: python benchmarks/warm_profile.py [--repeat 7] [--layers 4[,8,16]] [--out PATH]
       [--package-root DIR]   # measure the package at DIR (default: this checkout), e.g. an older commit
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CHILD_ENV = {"OMP_NUM_THREADS": "1"}


def _child(action: str, cache_dir: str, layers: int) -> dict:
    import torch

    out: dict = {}
    with torch.no_grad():
        model, inputs = harness.tiny_llama(layers)
        out["dynamo_imported_before"] = "torch._dynamo" in sys.modules
        if action == "eager":
            t0 = time.perf_counter()
            model(**inputs)
            out["first_call_s"] = time.perf_counter() - t0
            return out
        t0 = time.perf_counter()
        import torchair_cached_backend as tcb

        t1 = time.perf_counter()
        if action == "cold":
            fn = torch.compile(model, backend="npu_cached", options={"cache_dir": cache_dir, "compiler": "eager"})
        else:
            fn = tcb.load(model, cache_dir, compiler="eager", fallback=False)
        t2 = time.perf_counter()
        got = fn(**inputs)
        t3 = time.perf_counter()
        out.update(import_s=t1 - t0, load_s=t2 - t1, call_s=t3 - t2, first_call_s=t3 - t0, package=tcb.__file__)
        out["capture_imported"] = "torchair_cached_backend.bypass.capture" in sys.modules
        if action == "warm":
            out.update(_guard_counts(fn))
        expected = model(**inputs)
        out["max_abs_diff"] = (got.logits - expected.logits).abs().max().item()
    return out


def _guard_counts(fn: object) -> dict:
    """Guards recorded for load time and checks the load-time function holds (after the timing)."""
    variants = getattr(fn, "_variants", None) or []
    checks = getattr(variants[0], "checks", None) if variants else None
    if checks is None:
        return {}
    out = {"load_guards": sum(1 for g in checks.meta if g["scope"] == "load")}
    count = checks.namespace.get("___load_checks")
    out["load_checks"] = count if count is not None else out["load_guards"]  # before format 4: one check a guard
    return out


def _sizes(cache_dir: str) -> dict:
    """Bytes on disk of the program entry: its manifest and its guards blobs."""
    out = {"manifest_bytes": 0, "guards_bytes": 0, "program_files_bytes": 0}
    programs = os.path.join(cache_dir, "programs")
    for key in os.listdir(programs) if os.path.isdir(programs) else ():
        out["manifest_bytes"] += os.path.getsize(os.path.join(programs, key, "manifest.json"))
        files = os.path.join(programs, key, "files")
        for name in os.listdir(files):
            size = os.path.getsize(os.path.join(files, name))
            out["program_files_bytes"] += size
            if name.endswith(".guards"):
                out["guards_bytes"] += size
    return out


_FIRST_CALL = re.compile(r"first call ([\d.]+) ms \(check ([\d.]+), run ([\d.]+)\)")
_BEFORE = re.compile(r"imported before the load: ([\d.]+) ms \((\d+) modules\)")


def parse_profile(line: str) -> dict[str, float]:
    """The ``TCB_PROFILE`` line's numbers, ms (module counts as numbers too): ``load`` and each
    load phase, ``first call`` with its ``check`` and ``run``, ``imported before the load``."""
    out: dict[str, float] = {}
    head, _, rest = line.partition(" ms = ")
    out["load"] = float(head.rsplit(" ", 1)[-1])
    phases = rest.split(" | ", 1)[0]
    for part in phases.split(" + "):
        words = part.split(" (")[0].rsplit(" ", 1)
        if len(words) == 2:
            out[words[0]] = float(words[1])
        modules = re.search(r"\((\d+) modules\)", part)
        if modules:
            out[f"{words[0]}: modules"] = float(modules.group(1))
    first = _FIRST_CALL.search(line)
    if first:
        out["first call"], out["first call: check"], out["first call: run"] = map(float, first.groups())
    before = _BEFORE.search(line)
    if before:
        out["imported before the load"] = float(before.group(1))
        out["imported before the load: modules"] = float(before.group(2))
    return out


def _profile_table(lines: list[str]) -> list[str]:
    """Median (min-max) of each number of the profile lines, in the line's order."""
    parsed = [parse_profile(line) for line in lines]
    names: list[str] = []
    for p in parsed:
        names += [n for n in p if n not in names]
    rows = ["| `TCB_PROFILE` part | median | min | max |", "|---|---|---|---|"]
    for name in names:
        values = [p[name] for p in parsed if name in p]
        fmt = "{:.0f}" if name.endswith("modules") else "{:.2f}"
        rows.append(f"| {name} | " + " | ".join(fmt.format(v) for v in (statistics.median(values), min(values),
                                                                          max(values))) + " |")
    return rows


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def render(doc: dict) -> str:
    rows = [
        "# Warm-start fixed cost (tiny transformers Llama, bypass route, eager inner compiler)",
        "",
        f"{doc['layers']} layers, d=128, input (2, 24); fresh processes, median of {doc['repeat']} "
        "(min-max). Times in ms." + (f" {doc['note']}" if doc.get("note") else ""),
        "",
        "| measure | median | min | max |",
        "|---|---|---|---|",
    ]
    for key, runs in (("eager first call", doc["eager"]), ("import torchair_cached_backend", doc["warm"]),
                      ("tcb.load", doc["warm"]), ("first call of the replay", doc["warm"]),
                      ("warm total (import + load + call)", doc["warm"])):
        field = {"eager first call": "first_call_s", "import torchair_cached_backend": "import_s",
                 "tcb.load": "load_s", "first call of the replay": "call_s"}.get(key, "first_call_s")
        values = [r[field] * 1e3 for r in runs if field in r]
        if values:
            rows.append(f"| {key} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")
    eager, warm = _median(doc["eager"], "first_call_s"), _median(doc["warm"], "first_call_s")
    if eager and warm:
        rows += ["", f"warm / eager first call: {warm / eager:.2f}x; replay's own cost: "
                 f"{(warm - eager) * 1e3:.2f} ms"]
    profiles = [r["profile"] for r in doc.get("warm_profiled", []) if r.get("profile")]
    if profiles:
        rows += ["", "`TCB_PROFILE=1` breakdown of one warm start:", "", "```", profiles[len(profiles) // 2], "```",
                 "", f"The same lines' numbers over the {len(profiles)} profiled warm starts, ms (phases exclusive: "
                 "they add up to the load; imports are our modules', timed from the finders' search to the end of "
                 "the module's body; those `tcb.load` itself imported are \"imported before the load\"):", ""]
        rows += _profile_table(profiles)
    baseline = doc.get("baseline") or {}
    if baseline:
        rows += ["", f"## Against the baseline package ({doc.get('baseline_root')}), round-robin in the same run", "",
                 "| layers | load-time checks, baseline -> now | guards blob KB, baseline -> now "
                 "| tcb.load median ms, baseline -> now | tcb.load min ms, baseline -> now "
                 "| warm total (import + load + call) median ms, baseline -> now |", "|---|---|---|---|---|---|"]
        for layers, base_runs in sorted(baseline.items(), key=lambda kv: int(kv[0])):
            now_runs = (doc.get("scaling") or {}).get(layers, {}).get("warm") or doc["warm"]
            sizes = (doc.get("scaling") or {}).get(layers, {})

            def stat(runs: list[dict], key: str, fn: Callable[[list[float]], float]) -> str:
                values = [r[key] * 1e3 for r in runs if key in r]
                return f"{fn(values):.2f}" if values else "-"

            def first(runs: list[dict], key: str) -> str:
                return str(next((r[key] for r in runs if key in r), "-"))

            blob = (f"{sizes['baseline_sizes']['guards_bytes'] / 1e3:.0f} -> {sizes['sizes']['guards_bytes'] / 1e3:.0f}"
                    if "baseline_sizes" in sizes else "-")
            rows.append(f"| {layers} | {first(base_runs, 'load_checks')} -> {first(now_runs, 'load_checks')} | {blob} "
                        f"| {stat(base_runs, 'load_s', statistics.median)} -> {stat(now_runs, 'load_s', statistics.median)} "
                        f"| {stat(base_runs, 'load_s', min)} -> {stat(now_runs, 'load_s', min)} "
                        f"| {stat(base_runs, 'first_call_s', statistics.median)} -> "
                        f"{stat(now_runs, 'first_call_s', statistics.median)} |")
    scaling = doc.get("scaling") or {}
    if scaling:
        rows += ["", "## How the load grows with the layer count", "",
                 "| layers | load-time guards | checks evaluated at load | program manifest, KB | guards blob, KB "
                 "| tcb.load median, ms | tcb.load min, ms |", "|---|---|---|---|---|---|---|"]
        for layers, row in sorted(scaling.items(), key=lambda kv: int(kv[0])):
            loads = [r["load_s"] * 1e3 for r in row["warm"] if "load_s" in r]
            first = next((r for r in row["warm"] if "load_guards" in r), {})
            rows.append(f"| {layers} | {first.get('load_guards', '-')} | {first.get('load_checks', '-')} "
                        f"| {row['sizes']['manifest_bytes'] / 1e3:.1f} | {row['sizes']['guards_bytes'] / 1e3:.1f} "
                        f"| {statistics.median(loads):.2f} | {min(loads):.2f} |" if loads else f"| {layers} | - |")
    return "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--layers", default="4", help="layer count(s), comma-separated: the first gets the full table")
    p.add_argument("--note", default="", help="a line for the markdown (e.g. the machine's load)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "warm_profile.json"))
    p.add_argument("--package-root", default=REPO)
    p.add_argument("--baseline-root", default="",
                   help="another package dir (e.g. an older commit's) whose warm starts run round-robin with ours")
    p.add_argument("--child", nargs=3)
    a = p.parse_args()
    if a.child:
        harness.report(_child(a.child[0], a.child[1], int(a.child[2])))
        return
    work = tempfile.mkdtemp(prefix="tcb_warm_profile_")
    ind = os.path.join(work, "inductor")
    env = dict(CHILD_ENV, PYTHONPATH=os.path.abspath(a.package_root))
    counts = [int(n) for n in a.layers.split(",")]
    caches = {n: os.path.join(work, f"cache{n}") for n in counts}
    for n in counts:
        cold = _spawn_profiled(["cold", caches[n], str(n)], ind, env)
        if "error" in cold:
            sys.exit(f"cold run failed ({n} layers): {cold['error']}")
    main_layers, cache = counts[0], caches[counts[0]]
    doc: dict = {"layers": main_layers, "repeat": a.repeat, "package_root": a.package_root, "note": a.note,
                 "eager": [], "warm": [], "warm_profiled": [], "scaling": {}}
    base_env = dict(CHILD_ENV, PYTHONPATH=os.path.abspath(a.baseline_root)) if a.baseline_root else None
    base_caches = {n: os.path.join(work, f"base{n}") for n in counts}
    if base_env is not None:
        doc.update(baseline_root=a.baseline_root, baseline={str(n): [] for n in counts})
        for n in counts:
            cold = _spawn_profiled(["cold", base_caches[n], str(n)], ind, base_env)
            if "error" in cold:
                sys.exit(f"baseline cold run failed ({n} layers): {cold['error']}")
    for _ in range(a.repeat):  # round-robin: a noisy neighbour hits all alike
        doc["eager"].append(_spawn_profiled(["eager", cache, str(main_layers)], ind, env))
        doc["warm"].append(_spawn_profiled(["warm", cache, str(main_layers)], ind, env))
        doc["warm_profiled"].append(_spawn_profiled(["warm", cache, str(main_layers)], ind,
                                                    dict(env, TCB_PROFILE="1")))
        if base_env is not None:
            doc["baseline"][str(main_layers)].append(
                _spawn_profiled(["warm", base_caches[main_layers], str(main_layers)], ind, base_env))
        print(json.dumps(doc["warm"][-1]), flush=True)
    if len(counts) > 1:
        others = {n: [] for n in counts if n != main_layers}
        for _ in range(a.repeat):
            for n in others:
                others[n].append(_spawn_profiled(["warm", caches[n], str(n)], ind, env))
                if base_env is not None:
                    doc["baseline"][str(n)].append(_spawn_profiled(["warm", base_caches[n], str(n)], ind, base_env))
        for n in counts:
            warm = doc["warm"] if n == main_layers else others[n]
            doc["scaling"][str(n)] = {"sizes": _sizes(caches[n]), "warm": warm}
            if base_env is not None:
                doc["scaling"][str(n)]["baseline_sizes"] = _sizes(base_caches[n])
    harness.write_outputs(doc, a.out, render)
    print(render(doc))


def _spawn_profiled(args: list[str], ind: str, env: dict[str, str]) -> dict:
    """A child running the package found on ``env["PYTHONPATH"]``, keeping the
    ``TCB_PROFILE`` line it printed on stderr."""
    import subprocess

    os.makedirs(ind, exist_ok=True)
    full = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=ind, **env)
    full.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *args], env=full,
                          capture_output=True, text=True, timeout=300)
    result: dict = {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:500]}
    for line in proc.stdout.splitlines():
        if line.startswith(harness.RESULT_TAG):
            result = json.loads(line[len(harness.RESULT_TAG):])
    if "error" in result:
        return result
    result["profile"] = next((ln for ln in proc.stderr.splitlines() if "tcb profile" in ln), None)
    return result


if __name__ == "__main__":
    main()
