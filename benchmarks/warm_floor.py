"""Where the floor of a warm start's fixed cost is: what each module of the hit path costs to
import, what each load-time check costs, and what those imply for the replay's own cost.

The replay's own cost on a tiny model (first call of a warm process minus eager's) is the
package's imports, ``tcb.load`` and the difference of the first calls. This script splits it
into what scales with the hit path's *code* (each module of ours the warm start imports:
found, read, unmarshalled, run; fitted as a fixed cost per module plus a cost per KB of
``.pyc``), what scales with the *checks* (the load-time guards: one generated function over
the live objects) and the rest, in fresh processes (one untimed cold process fills the cache,
then warm and eager children round-robin). ``--layers 4,8,16`` shows how the checks grow.

usage: python benchmarks/warm_floor.py [--repeat 5] [--layers 4[,8,16]] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PACKAGE = "torchair_cached_backend"
CHILD_ENV = {"OMP_NUM_THREADS": "1"}


class _ModuleTimer:
    """First on ``sys.meta_path``: times each of our modules from the finders' search to the
    end of its body, less the imports of ours nested in it, and notes its ``.pyc`` size."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.nested: list[float] = []  # per module being imported: the time of ours nested in it

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            return None
        t0 = time.perf_counter()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is None:
                continue
            if spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            cached = getattr(spec, "cached", None)
            size = os.path.getsize(cached) if cached and os.path.exists(cached) else 0
            spec.loader = _TimedLoader(self, spec.loader, name, size, time.perf_counter() - t0)
            return spec
        return None


class _TimedLoader:
    def __init__(self, timer: _ModuleTimer, loader: Any, name: str, size: int, found: float) -> None:
        self.timer, self.loader, self.name, self.size, self.found = timer, loader, name, size, found

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.loader, attr)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        nested = self.timer.nested
        t1 = time.perf_counter()
        nested.append(0.0)
        try:
            self.loader.exec_module(module)
        finally:
            inner = nested.pop()
            whole = time.perf_counter() - t1
            if nested:
                nested[-1] += whole + self.found
        self.timer.rows.append({"module": self.name, "pyc_bytes": self.size, "find_us": self.found * 1e6,
                                "load_us": (whole - inner) * 1e6})


def _child(action: str, cache_dir: str, layers: int) -> dict:
    import torch

    out: dict = {}
    if action in ("top", "top_unguarded"):
        return _top(cache_dir, layers, "none" if action == "top_unguarded" else None)
    if action == "eager_warmed":  # the package imported first, as in ``_top``: the thread's warm-up helps eager too
        import transformers  # noqa: F401

        import torchair_cached_backend  # noqa: F401
    with torch.no_grad():
        model, inputs = harness.tiny_llama(layers)
        if action in ("eager", "eager_warmed"):
            t0 = time.perf_counter()
            model(**inputs)
            return {"first_call_s": time.perf_counter() - t0}
        if action == "cold":
            import torchair_cached_backend  # noqa: F401  (registers npu_cached)

            fn = torch.compile(model, backend="npu_cached", options={"cache_dir": cache_dir, "compiler": "eager"})
            fn(**inputs)
            return {}
        timer = _ModuleTimer()
        sys.meta_path.insert(0, timer)
        guard_s: list[float] = []
        t0 = time.perf_counter()
        import torchair_cached_backend as tcb

        t1 = time.perf_counter()
        from torchair_cached_backend.bypass import guard_runtime  # timed by ``timer`` (the load imports it)

        evaluate = guard_runtime.GuardChecks.load_failures

        def timed_failures(self: Any, local: Any) -> Any:
            s = time.perf_counter()
            try:
                return evaluate(self, local)
            finally:
                guard_s.append(time.perf_counter() - s)

        guard_runtime.GuardChecks.load_failures = timed_failures
        fn = tcb.load(model, cache_dir, compiler="eager", fallback=False)
        t3 = time.perf_counter()
        got = fn(**inputs)
        t4 = time.perf_counter()
        sys.meta_path.remove(timer)
        checks = fn._variants[0].checks
        out.update(import_s=t1 - t0, load_s=t3 - t1, call_s=t4 - t3, first_call_s=t4 - t0,
                   modules=timer.rows, guards_s=sum(guard_s),
                   load_checks=checks.namespace.get("___load_checks") if checks is not None else None)
        out["max_abs_diff"] = (got.logits - model(**inputs).logits).abs().max().item()
    return out


def _top(cache_dir: str, layers: int, guards: str | None = None) -> dict:
    """The package imported first, as the README writes it (``import torch, torchair_cached_backend``),
    then the model built, loaded and called: the warm path's modules import in the background
    while the model is built (``preload``). Its own cost is the package's import, the load and
    the first call (the model's build, paid by eager too, is left out). ``guards="none"``: the
    same replay without its checks (torchair's behaviour, never a default), which shows what the
    guard-equivalent checks cost of the own cost."""
    import torch
    import transformers  # noqa: F401  (the eager child has it imported before its clock starts too)

    t0 = time.perf_counter()
    import torchair_cached_backend as tcb
    from torchair_cached_backend import preload

    t1 = time.perf_counter()
    started = preload._thread is not None
    with torch.no_grad():
        model, inputs = harness.tiny_llama(layers)
        t2 = time.perf_counter()
        fn = tcb.load(model, cache_dir, compiler="eager", fallback=False, **({"guards": guards} if guards else {}))
        got = fn(**inputs)
        t3 = time.perf_counter()
        diff = (got.logits - model(**inputs).logits).abs().max().item()
    return {"first_call_s": (t1 - t0) + (t3 - t2), "preloaded": started, "max_abs_diff": diff}


def _fit(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Least squares ``import_us = fixed + per_kb * KB`` over the modules' imports."""
    xs = [r["pyc_bytes"] / 1024 for r in rows]
    ys = [r["find_us"] + r["load_us"] for r in rows]
    if len(rows) < 2 or len(set(xs)) < 2:
        return (statistics.mean(ys) if ys else 0.0), 0.0
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def summarize(warm: list[dict], eager: list[dict], top: list[dict] | None = None,
              eager_warmed: list[dict] | None = None, unguarded: list[dict] | None = None) -> dict[str, Any]:
    med = statistics.median
    per_module: dict[str, list[dict[str, Any]]] = {}
    for run in warm:
        for row in run["modules"]:
            per_module.setdefault(row["module"], []).append(row)
    modules = [{"module": name, "pyc_bytes": rows[0]["pyc_bytes"],
                "import_us": med(r["find_us"] + r["load_us"] for r in rows),
                "find_us": med(r["find_us"] for r in rows)} for name, rows in per_module.items()]
    fixed, per_kb = _fit([r for run in warm for r in run["modules"]])
    imports_ms = med(sum(r["find_us"] + r["load_us"] for r in run["modules"]) for run in warm) / 1e3
    guards_ms = med(r["guards_s"] for r in warm) * 1e3
    checks = warm[0].get("load_checks") or 0
    total = med(r["first_call_s"] for r in warm) * 1e3
    eager_ms = med(r["first_call_s"] for r in eager) * 1e3
    call_ms = med(r["call_s"] for r in warm) * 1e3
    top_ms = med(r["first_call_s"] for r in top) * 1e3 if top else None
    eager_warmed_ms = med(r["first_call_s"] for r in eager_warmed) * 1e3 if eager_warmed else None
    unguarded_ms = med(r["first_call_s"] for r in unguarded) * 1e3 if unguarded else None
    return {
        "modules": sorted(modules, key=lambda m: -m["import_us"]),
        "module_count": len(modules), "pyc_kb": sum(m["pyc_bytes"] for m in modules) / 1024,
        "fixed_us_per_module": fixed, "us_per_kb": per_kb, "imports_ms": imports_ms,
        "guards_ms": guards_ms, "load_checks": checks, "us_per_check": guards_ms * 1e3 / checks if checks else None,
        "warm_first_call_ms": total, "eager_first_call_ms": eager_ms, "replay_call_ms": call_ms,
        "own_cost_ms": total - eager_ms, "rest_ms": total - eager_ms - imports_ms - guards_ms - (call_ms - eager_ms),
        "own_cost_top_ms": top_ms - eager_ms if top_ms is not None else None,
        "own_cost_top_unguarded_ms": unguarded_ms - eager_ms if unguarded_ms is not None else None,
        "preloaded": all(r["preloaded"] for r in top) if top else None,
        "eager_warmed_first_call_ms": eager_warmed_ms,
        "own_cost_over_warmed_eager_ms": top_ms - eager_warmed_ms if top_ms is not None and eager_warmed_ms is not None
        else None,
    }


def render(doc: dict) -> str:
    main = doc["summary"][str(doc["layers"][0])]
    rows = [
        "# The floor of a warm start's fixed cost (tiny transformers Llama, `tcb.load`, eager inner compiler)",
        "",
        f"d=128, input (2, 24); fresh processes, median of {doc['repeat']}. {doc.get('note', '')}",
        "",
        "| layers | modules imported | .pyc KB | imports ms | load-time checks | checks ms | us / check "
        "| rest of the load ms | replay first call ms | eager first call ms | replay's own cost ms "
        "| own cost, package imported first ms | eager first call, package imported first ms "
        "| own cost over that eager ms | own cost, package imported first, without checks ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layers, s in sorted(doc["summary"].items(), key=lambda kv: int(kv[0])):
        per = f"{s['us_per_check']:.2f}" if s["us_per_check"] else "-"
        rows.append(f"| {layers} | {s['module_count']} | {s['pyc_kb']:.0f} | {s['imports_ms']:.2f} | "
                    f"{s['load_checks']} | {s['guards_ms']:.2f} | {per} | {s['rest_ms']:.2f} | "
                    f"{s['replay_call_ms']:.2f} | {s['eager_first_call_ms']:.2f} | {s['own_cost_ms']:.2f} | "
                    + (f"{s['own_cost_top_ms']:.2f} |" if s.get("own_cost_top_ms") is not None else "- |")
                    + "".join(f" {s[k]:.2f} |" if s.get(k) is not None else " - |"
                              for k in ("eager_warmed_first_call_ms", "own_cost_over_warmed_eager_ms",
                                        "own_cost_top_unguarded_ms")))
    rows += [
        "",
        "The split (imports, checks, rest) is measured with the background import off (`TCB_PRELOAD=0`): the "
        "package imported right before `tcb.load`, after the model is built, so every import is paid in the load. "
        "The last column imports the package first, as the README writes it, and builds the model after: the "
        "warm path's modules import on a background thread meanwhile (`preload`), and the own cost is the "
        "package's import, the load and the first call, less eager's first call. That thread also calls the "
        "operators transformer graphs call once (`op_warmup`: torch's own first use of each), which an eager "
        "process would gain from as well: the next two columns are an eager process that imported the package "
        "first too (its import not counted), and the own cost over it. The last column is the package-first "
        "process again with `guards=\"none\"` (no load-time or per-call checks: torchair's behaviour, never our "
        "default): the difference to the package-first column is what the guard-equivalent checks cost.",
        "",
        f"Imports fit ({main['module_count']} modules): **{main['fixed_us_per_module']:.0f} us per module + "
        f"{main['us_per_kb']:.1f} us per KB of .pyc** (found, read, unmarshalled, run; timed by a finder of this "
        "benchmark's in front of the others, whose own Python overhead is included).",
        "",
        "What a replay's own cost of 3 ms would need here, at these unit costs: the load-time checks alone take "
        f"{main['guards_ms']:.2f} ms and the imports {main['imports_ms']:.2f} ms; every module fewer saves "
        f"~{main['fixed_us_per_module']:.0f} us, every 10 KB of code fewer ~{10 * main['us_per_kb']:.0f} us.",
        "",
        f"## The modules of the hit path ({doc['layers'][0]} layers), by import time",
        "",
        "| module | .pyc bytes | import us (median) | of it finding, us |",
        "|---|---|---|---|",
    ]
    for m in main["modules"]:
        rows.append(f"| {m['module']} | {m['pyc_bytes']} | {m['import_us']:.0f} | {m['find_us']:.0f} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--layers", default="4")
    p.add_argument("--note", default="")
    p.add_argument("--out", default=os.path.join(HERE, "results", "warm_floor.json"))
    p.add_argument("--child", nargs=3)
    a = p.parse_args()
    if a.child:
        harness.report(_child(a.child[0], a.child[1], int(a.child[2])))
        return
    work = tempfile.mkdtemp(prefix="tcb_warm_floor_")
    ind = os.path.join(work, "inductor")
    counts = [int(n) for n in a.layers.split(",")]
    doc: dict = {"layers": counts, "repeat": a.repeat, "note": a.note, "runs": {}, "summary": {}}
    for n in counts:
        cache = os.path.join(work, f"cache{n}")
        cold = harness.spawn(__file__, ["cold", cache, str(n)], ind, 900, CHILD_ENV)
        if "error" in cold:
            sys.exit(f"cold run failed ({n} layers): {cold['error']}")
        warm: list[dict] = []
        eager: list[dict] = []
        top: list[dict] = []
        eager_warmed: list[dict] = []
        unguarded: list[dict] = []
        for _ in range(a.repeat):  # round-robin: a noisy neighbour hits all alike
            eager.append(harness.spawn(__file__, ["eager", cache, str(n)], ind, 900, CHILD_ENV))
            eager_warmed.append(harness.spawn(__file__, ["eager_warmed", cache, str(n)], ind, 900, CHILD_ENV))
            warm.append(harness.spawn(__file__, ["warm", cache, str(n)], ind, 900, {**CHILD_ENV, "TCB_PRELOAD": "0"}))
            top.append(harness.spawn(__file__, ["top", cache, str(n)], ind, 900, CHILD_ENV))
            unguarded.append(harness.spawn(__file__, ["top_unguarded", cache, str(n)], ind, 900, CHILD_ENV))
        bad = [r["error"] for r in warm + eager + top + eager_warmed + unguarded if "error" in r]
        if bad:
            sys.exit(f"a child failed ({n} layers): {bad[0]}")
        if any(r["max_abs_diff"] > 1e-5 for r in warm + top + unguarded):
            sys.exit(f"a warm replay's output differs from eager's ({n} layers)")
        doc["runs"][str(n)] = {"warm": warm, "eager": eager, "top": top, "eager_warmed": eager_warmed,
                               "top_unguarded": unguarded}
        doc["summary"][str(n)] = summarize(warm, eager, top, eager_warmed, unguarded)
        s = doc["summary"][str(n)]
        print(f"{n} layers: own cost {s['own_cost_ms']:.2f} ms, package imported first {s['own_cost_top_ms']:.2f} ms "
              f"(over an eager process that imported it too: {s['own_cost_over_warmed_eager_ms']:.2f} ms; "
              f"without checks {s['own_cost_top_unguarded_ms']:.2f} ms)", flush=True)
    harness.write_outputs(doc, a.out, render)


if __name__ == "__main__":
    main()
