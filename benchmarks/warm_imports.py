"""What a warm start imports of ours, and what that costs: two package trees, A/B round-robin.

A fresh process that already imported torch and transformers (hence Dynamo) builds a
tiny transformers Llama, then times ``import torchair_cached_backend``, a warm
``tcb.load(model, dir, compiler="eager")`` and its first call, and lists the modules of
ours that came in with them. Deterministic measures beside the times: how many modules,
and the KB of their compiled code (``marshal`` of each module's code object: what its
``.pyc`` holds, without the 16-byte header). With ``--route`` the backend route's warm
start (``torch.compile(model, backend="npu_cached")`` on a warm cache, first call) is
measured the same way; then the imports alone (each tree's warm-load modules, imported in a
fresh process). Each tree fills its own cache in one untimed cold process first. Every round
also times eager's first call (the same model, no package): the replay's own cost (issue 18's
measure, target <= 3 ms) is a warm start's import + load + first call minus that.

usage: python benchmarks/warm_imports.py [--repeat 7] [--layers 4] [--route]
       [--package-root DIR] [--baseline-root DIR] [--note TEXT] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import marshal
import os
import statistics
import subprocess
import sys
import tempfile
import time

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PACKAGE = "torchair_cached_backend"


def _code_bytes(module: object) -> int:
    """Bytes of the module's compiled code (its .pyc body), from its source."""
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return 0
    with open(path, encoding="utf-8") as f:
        return len(marshal.dumps(compile(f.read(), path, "exec")))


def _child(action: str, cache_dir: str, layers: int) -> dict:
    import torch
    import transformers  # noqa: F401  (imports Dynamo, as in every transformers process)

    if action == "imports":  # only the imports: the modules a warm load of this tree imported, in order
        import importlib

        with open(cache_dir) as f:
            names = json.load(f)
        t0, c0 = time.perf_counter(), time.thread_time()
        for name in names:
            importlib.import_module(name)
        return {"imports_s": time.perf_counter() - t0, "imports_cpu_s": time.thread_time() - c0, "modules": names}

    out: dict = {}
    with torch.no_grad():
        model, inputs = harness.tiny_llama(layers)
        if action == "eager":
            t0, c0 = time.perf_counter(), time.thread_time()
            model(**inputs)
            return {"eager_call_s": time.perf_counter() - t0, "eager_call_cpu_s": time.thread_time() - c0}
        before = set(sys.modules)
        c0, t0 = time.thread_time(), time.perf_counter()
        import torchair_cached_backend as tcb

        t1, c1 = time.perf_counter(), time.thread_time()
        options = {"cache_dir": cache_dir, "compiler": "eager"}
        if action in ("cold", "route"):
            fn = torch.compile(model, backend="npu_cached", options=options)
        else:
            fn = tcb.load(model, cache_dir, compiler="eager", fallback=False)
        t2, c2 = time.perf_counter(), time.thread_time()
        got = fn(**inputs)
        t3, c3 = time.perf_counter(), time.thread_time()
        if action == "cold":
            return {"ok": True}
        ours = sorted(m for m in set(sys.modules) - before if m == PACKAGE or m.startswith(PACKAGE + "."))
        sizes = {m: _code_bytes(sys.modules[m]) for m in ours}
        out.update(import_s=t1 - t0, load_s=t2 - t1, call_s=t3 - t2, total_s=t3 - t0, import_cpu_s=c1 - c0,
                   load_cpu_s=c2 - c1, call_cpu_s=c3 - c2, total_cpu_s=c3 - c0, package=tcb.__file__,
                   modules=ours, module_bytes=sizes, total_bytes=sum(sizes.values()))
        out["max_abs_diff"] = (got.logits - model(**inputs).logits).abs().max().item()
        if "torch._dynamo" in sys.modules:
            from torch._dynamo.utils import counters

            out["frames_traced"] = counters["frames"].get("total", 0)
    return out


def _spawn(root: str, args: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.abspath(root))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # .pyc used as by an installed package
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *args], env=env,
                          capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith(harness.RESULT_TAG):
            return json.loads(line[len(harness.RESULT_TAG):])
    return {"error": (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1][:500]}


def _stats(runs: list[dict], key: str) -> str:
    values = [r[key] * 1e3 for r in runs if key in r]
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _table(doc: dict, clock: str) -> list[str]:
    """The routes' rows in wall-clock time (``clock`` "s") or the child's thread CPU time ("cpu_s")."""
    rows = ["| route, package | our modules imported | KB of their compiled code | import | load / compile() | "
            "first call | import + load + first call | replay's own cost (that - eager's first call) |",
            "|---|---|---|---|---|---|---|---|"]
    eager = [r[f"eager_call_{clock}"] for r in doc["runs"].get("eager", []) if f"eager_call_{clock}" in r]
    eager_median = statistics.median(eager) if eager else None
    for route in doc["routes"]:
        for label in ("baseline", "now"):
            runs = doc["runs"].get(f"{route}:{label}") or []
            ok = [r for r in runs if f"total_{clock}" in r]
            if not ok:
                continue
            first = ok[0]
            own = "-"
            if eager_median is not None:
                own = f"{(statistics.median(r[f'total_{clock}'] for r in ok) - eager_median) * 1e3:.2f}"
            rows.append(f"| {route}, {label} | {len(first['modules'])} | {first['total_bytes'] / 1024:.0f} "
                        f"| {_stats(ok, f'import_{clock}')} | {_stats(ok, f'load_{clock}')} "
                        f"| {_stats(ok, f'call_{clock}')} | {_stats(ok, f'total_{clock}')} | {own} |")
    if eager:
        rows += ["", f"Eager's first call (same model, round-robin with the above): "
                 f"{_stats(doc['runs']['eager'], f'eager_call_{clock}')} ms."]
    return rows


def render(doc: dict) -> str:
    rows = [
        "# What a warm start imports of ours (tiny transformers Llama, eager inner compiler)",
        "",
        f"{doc['layers']} layers, d=128, input (2, 24); fresh processes that imported torch and transformers "
        f"first; A/B round-robin, median (min-max) of {doc['repeat']} each, ms."
        + (f" {doc['note']}" if doc.get("note") else ""),
        "",
        *_table(doc, "s"),
    ]
    if any("total_cpu_s" in r for runs in doc["runs"].values() for r in runs):
        rows += ["", "The same runs in the child's thread CPU time (`time.thread_time`: what a busy neighbour's "
                 "time slices do not inflate), ms:", "", *_table(doc, "cpu_s")]
    imports = {label: [r for r in doc["runs"].get(f"imports:{label}", []) if "imports_s" in r]
               for label in ("baseline", "now")}
    if any(imports.values()):
        rows += ["", "Importing only the modules of ours each warm `load()` imported (same order, fresh "
                 "processes after torch + transformers, round-robin), ms: "
                 + "; ".join(f"{label} {_stats(runs, 'imports_s')} (thread CPU {_stats(runs, 'imports_cpu_s')})"
                             for label, runs in imports.items() if runs)]
    for route in doc["routes"]:
        now = next((r for r in doc["runs"].get(f"{route}:now", []) if "modules" in r), None)
        base = next((r for r in doc["runs"].get(f"{route}:baseline", []) if "modules" in r), None)
        if now is None:
            continue
        rows += ["", f"## {route}: modules of ours imported (KB of compiled code)", ""]
        names = sorted(set(now["modules"]) | set(base["modules"] if base else []),
                       key=lambda m: -max(now["module_bytes"].get(m, 0), (base or {}).get("module_bytes", {}).get(m, 0)))
        rows += ["| module | baseline | now |", "|---|---|---|"]
        for m in names:
            b = (base or {}).get("module_bytes", {}).get(m)
            n = now["module_bytes"].get(m)
            rows.append(f"| {m[len(PACKAGE):] or PACKAGE} | {'-' if b is None else f'{b / 1024:.1f}'} "
                        f"| {'-' if n is None else f'{n / 1024:.1f}'} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--route", action="store_true", help="also the backend route's warm start")
    p.add_argument("--package-root", default=REPO)
    p.add_argument("--baseline-root", default="")
    p.add_argument("--note", default="")
    p.add_argument("--out", default=os.path.join(HERE, "results", "warm_imports.json"))
    p.add_argument("--child", nargs=3)
    a = p.parse_args()
    if a.child:
        harness.report(_child(a.child[0], a.child[1], int(a.child[2])))
        return
    work = tempfile.mkdtemp(prefix="tcb_warm_imports_")
    roots = {"now": a.package_root}
    if a.baseline_root:
        roots["baseline"] = a.baseline_root
    routes = ["load()"] + (["backend route"] if a.route else [])
    doc: dict = {"layers": a.layers, "repeat": a.repeat, "note": a.note, "roots": roots, "routes": routes, "runs": {}}
    caches = {label: os.path.join(work, label) for label in roots}
    for label, root in roots.items():
        cold = _spawn(root, ["cold", caches[label], str(a.layers)])
        if "error" in cold:
            sys.exit(f"cold run failed ({label}): {cold['error']}")
    for _ in range(a.repeat):
        doc["runs"].setdefault("eager", []).append(_spawn(a.package_root, ["eager", "-", str(a.layers)]))
        for route in routes:
            for label, root in roots.items():
                action = "warm" if route == "load()" else "route"
                doc["runs"].setdefault(f"{route}:{label}", []).append(_spawn(root, [action, caches[label], str(a.layers)]))
    for label in roots:  # the imports alone, of what each tree's warm load imported
        first = next((r for r in doc["runs"].get(f"load():{label}", []) if "modules" in r), None)
        if first is not None:
            with open(os.path.join(work, f"{label}.modules.json"), "w") as f:
                json.dump(first["modules"], f)
    for _ in range(a.repeat):
        for label, root in roots.items():
            names = os.path.join(work, f"{label}.modules.json")
            if os.path.exists(names):
                doc["runs"].setdefault(f"imports:{label}", []).append(_spawn(root, ["imports", names, "0"]))
    harness.write_outputs(doc, a.out, render)


if __name__ == "__main__":
    main()
