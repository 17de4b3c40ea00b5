"""Warm start of real transformers models: family x route x inner compiler.

For each family (tiny random configs from ``tests/hf_tiny.py``), each route and each inner
compiler, one untimed cold process fills a cache, then fresh warm processes measure the first
call (model built -> first output, including ``import torchair_cached_backend``, the
``cache_compile`` / ``load`` call and loading artifacts). The reference is eager's first call in a
fresh process with the same model build. Every child is a new interpreter; the warm and eager
children of one repetition run round-robin.

Routes:
* ``cache_compile``: ``tcb.cache_compile(model.forward, cache_dir=d, compiler=c)`` in both processes;
* ``load``: ``torch.compile(model, backend="npu_cached", options=...)`` cold,
  ``tcb.load(model, d, compiler=c)`` warm;
* ``backend``: ``torch.compile(model, backend="npu_cached", options=...)`` in both processes (the
  warm one installs the cached program into Dynamo's frame cache).

``--import-first``: the warm process imports the package before it builds the model, as the
README writes it (the warm path's modules then import in the background meanwhile: ``preload``);
its first call is that import plus the call's (the build, paid by eager too, is left out).

"replayed" means the warm process compiled no Dynamo frame, loaded a program through the bypass
and counted no fallback. Goals (issue 18): warm first call within 1.5x eager's with the eager
inner compiler, within 2x with Inductor's (kernels loaded into an empty Inductor dir).

usage: python benchmarks/families.py [--families llama,bert] [--compilers eager,inductor]
       [--routes cache_compile,load,backend] [--size small|tiny] [--repeat 3] [--out PATH]
       python benchmarks/families.py --render PATH.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GOALS = {"eager": 1.5, "inductor": 2.0}
ROUTES = ("cache_compile", "load", "backend")
COMPILERS = ("eager", "inductor")
IMPORT_FIRST = "TCB_BENCH_IMPORT_FIRST"  # set by --import-first for the children


# --------------------------------------------------------------------------- child


def _child(action: str, family: str, route: str, compiler: str, cache_dir: str, size: str) -> dict:
    """One measurement in this fresh process: ``eager``, ``cold`` or ``warm``."""
    import logging

    import torch

    sys.path.insert(0, os.path.join(REPO, "tests"))
    import hf_tiny

    logs: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logs.append(record.getMessage())

    pkg_log = logging.getLogger("torchair_cached_backend")  # set up without importing the package
    pkg_log.addHandler(_Collect())
    pkg_log.setLevel(logging.INFO)

    out: dict = {}
    imported_s = 0.0
    if action in ("warm", "eager_warmed") and os.environ.get(IMPORT_FIRST) == "1":
        import transformers  # noqa: F401  (as hf_tiny.build does before the eager child's clock starts)

        t0 = time.perf_counter()
        import torchair_cached_backend  # noqa: F401

        # eager_warmed: eager with the package imported first (not counted), so it gets the background
        # thread's operator warm-up (``op_warmup``) a warm process gets
        imported_s = time.perf_counter() - t0 if action == "warm" else 0.0
    with torch.no_grad():
        model, inputs = hf_tiny.build(family, size=size)
        t0 = time.perf_counter() - imported_s
        if action in ("eager", "eager_warmed"):
            got = model(**inputs)
        else:
            import torchair_cached_backend as tcb

            if route == "cache_compile":
                fn = tcb.cache_compile(model.forward, cache_dir=cache_dir, compiler=compiler)
            elif action == "cold" or route == "backend":
                t_wrap = time.perf_counter()
                fn = torch.compile(model, backend="npu_cached", options={"cache_dir": cache_dir, "compiler": compiler})
                out["compile_call_s"] = time.perf_counter() - t_wrap  # torch.compile() itself (Dynamo's first use)
            else:
                fn = tcb.load(model, cache_dir, compiler=compiler)
            got = fn(**inputs)
        out["first_call_s"] = time.perf_counter() - t0
        out["imported_dynamo"] = "torch._dynamo" in sys.modules
        out["imported_inductor"] = "torch._inductor" in sys.modules
        frames = 0
        if "torch._dynamo.utils" in sys.modules:
            frames = sys.modules["torch._dynamo.utils"].counters["frames"].get("total", 0)
        out["frames"] = frames
        if action not in ("eager", "eager_warmed"):
            stats = sys.modules["torchair_cached_backend"].stats().as_dict()
            out["tcb_stats"] = stats
            out["replayed"] = frames == 0 and stats["bypass_loads"] >= 1 and stats["fallbacks"] == 0
            out["logs"] = logs[-8:]
        expected = model(**inputs)
        a, b = hf_tiny.output_tensor(family, got), hf_tiny.output_tensor(family, expected)
        out["max_abs_diff"] = (a - b).abs().max().item() if a.shape == b.shape else None
    return out


# --------------------------------------------------------------------------- driver


def _spawn(args: list[str], inductor_dir: str, timeout: float) -> dict:
    """One child process; its result dict, or ``{"error": ...}``. Never raises."""
    from warm_start import CHILD_ENV

    return harness.spawn(__file__, args, inductor_dir, timeout, CHILD_ENV)


def _reason(run: dict) -> str | None:
    """Why a warm run did not replay: the first log line that says so."""
    if "error" in run:
        return run["error"]
    if run.get("replayed"):
        return None
    for line in run.get("logs", []):
        if "compil" in line or "stale" in line or "not supported" in line:
            return line
    return f"frames={run.get('frames')} stats={run.get('tcb_stats')}"


def run_family(
    family: str, size: str, combos: list[tuple[str, str]], repeat: int, work: str, timeout: float, log
) -> list[dict]:
    from warm_start import _median

    wdir = os.path.join(work, family)
    colds: dict[tuple[str, str], dict] = {}
    for route, compiler in combos:
        cache = os.path.join(wdir, f"{route}_{compiler}")
        log(f"[{family}] cold {route}/{compiler} ...")
        colds[(route, compiler)] = _spawn(
            ["cold", family, route, compiler, cache, size], os.path.join(wdir, f"ind_cold_{route}_{compiler}"), timeout
        )
    eager: list[dict] = []
    eager_warmed: list[dict] = []
    warm: dict[tuple[str, str], list[dict]] = {c: [] for c in combos}
    for rep in range(repeat):
        eager.append(_spawn(["eager", family, "-", "-", "-", size], os.path.join(wdir, f"ind_eager_{rep}"), timeout))
        if os.environ.get(IMPORT_FIRST) == "1":
            eager_warmed.append(_spawn(["eager_warmed", family, "-", "-", "-", size],
                                       os.path.join(wdir, f"ind_eager_warmed_{rep}"), timeout))
        for route, compiler in combos:
            if "error" in colds[(route, compiler)]:
                continue
            cache = os.path.join(wdir, f"{route}_{compiler}")
            ind = os.path.join(wdir, f"ind_warm_{route}_{compiler}_{rep}")  # empty: nothing may be recompiled
            warm[(route, compiler)].append(_spawn(["warm", family, route, compiler, cache, size], ind, timeout))
        log(f"[{family}] rep {rep} done")
    eager_ok = [r["first_call_s"] for r in eager if "error" not in r]
    eager_s = _median(eager_ok)
    eager_warmed_s = _median([r["first_call_s"] for r in eager_warmed if "error" not in r])
    rows = []
    for route, compiler in combos:
        cold = colds[(route, compiler)]
        runs = warm[(route, compiler)]
        ok = [r for r in runs if "error" not in r]
        first = _median([r["first_call_s"] for r in ok])
        ratio = first / eager_s if first is not None and eager_s else None
        replayed = bool(ok) and all(r["replayed"] for r in ok)
        rows.append(
            {
                "family": family,
                "size": size,
                "route": route,
                "compiler": compiler,
                "replayed": replayed if ok else None,
                "eager_first_call_s": eager_s,
                "warm_first_call_s": first,
                "warm_first_call_all_s": [r["first_call_s"] for r in ok],
                "cold_first_call_s": cold.get("first_call_s"),
                "compile_call_s": _median([r["compile_call_s"] for r in ok if "compile_call_s" in r]),
                "warm_over_eager": ratio,
                "eager_warmed_first_call_s": eager_warmed_s,
                "warm_over_eager_warmed": first / eager_warmed_s if first is not None and eager_warmed_s else None,
                "goal": GOALS[compiler],
                "met": None if ratio is None else bool(replayed and ratio <= GOALS[compiler]),
                "max_abs_diff": max((r["max_abs_diff"] for r in ok if r["max_abs_diff"] is not None), default=None),
                "warm_frames": [r["frames"] for r in ok],
                "warm_imported_dynamo": [r["imported_dynamo"] for r in ok],
                "tcb_stats": ok[-1]["tcb_stats"] if ok else None,
                "not_replayed_because": None if replayed else _reason(ok[-1] if ok else cold),
                "errors": [r["error"] for r in [cold, *runs] if "error" in r],
            }
        )
    return rows


# --------------------------------------------------------------------------- rendering


def render_markdown(doc: dict) -> str:
    from warm_start import _fmt

    mach = doc["machine"]
    lines = [
        "# transformers families: warm start through the bypass",
        "",
        f"torch {doc['torch']}, transformers {doc['transformers']}, Python {mach['python']}, {mach['cpu']} "
        f"({mach['cores']} cores), created {doc['created']}; size {doc['config']['size']}, repeat {doc['config']['repeat']}. First call = model "
        "built -> first output, median over fresh processes; eager's is measured in its own fresh process. "
        + ("Warm processes import the package first, then build the model (`--import-first`): their first call "
           "adds that import. The package's background thread also calls the operators transformer graphs call "
           "once (`op_warmup`), which helps eager as much: the last two columns are an eager process that imported "
           "the package first too (not counted), and warm over it. " if doc["config"].get("import_first") else "")
        +
        f"Goal: warm / eager <= {GOALS['eager']} (eager inner compiler), <= {GOALS['inductor']} (inductor). "
        "`torch.compile()` ms: the backend route's call of `torch.compile(model, ...)` alone (Dynamo's own first "
        "use in the process: its skip lists, `compiler_bisector`; our backend's name resolved), part of its own cost.",
        "",
        "| family | route | compiler | replayed | eager first call s | warm first call s | warm / eager | goal met "
        "| replay's own cost ms | of which `torch.compile()` ms | cold first call s | max abs diff | not replayed because "
        "| eager first call, package imported first s | warm / that eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        met = "–" if r["met"] is None else ("yes" if r["met"] else "**no**")
        why = (r["not_replayed_because"] or "").replace("|", "\\|")
        own = (r["warm_first_call_s"] - r["eager_first_call_s"]) * 1e3 if r["warm_first_call_s"] and r[
            "eager_first_call_s"] else None
        wrap = r["compile_call_s"] * 1e3 if r.get("compile_call_s") is not None else None
        lines.append(
            f"| {r['family']} | {r['route']} | {r['compiler']} | {_fmt(r['replayed'])} | "
            f"{_fmt(r['eager_first_call_s'])} | {_fmt(r['warm_first_call_s'])} | {_fmt(r['warm_over_eager'], 2)} | "
            f"{met} | {_fmt(own, 1)} | {_fmt(wrap, 1)} | {_fmt(r['cold_first_call_s'], 2)} | {_fmt(r['max_abs_diff'], 2)} | {why[:160]} | "
            f"{_fmt(r.get('eager_warmed_first_call_s'))} | {_fmt(r.get('warm_over_eager_warmed'), 2)} |"
        )
    return "\n".join(lines) + "\n"


def write_outputs(doc: dict, out: str) -> None:
    harness.write_outputs(doc, out, render_markdown)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import datetime
    import shutil
    import tempfile

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from hf_tiny import FAMILIES
    from warm_start import machine_info

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--routes", default=",".join(ROUTES))
    p.add_argument("--compilers", default=",".join(COMPILERS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--size", default="small", choices=("tiny", "small"), help="model widths (tests/hf_tiny.py SIZES)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "families.json"))
    p.add_argument("--timeout", type=float, default=900, help="seconds per child process")
    p.add_argument("--workdir", help="where caches go (default: a temp dir, deleted afterwards)")
    p.add_argument("--import-first", action="store_true",
                   help="warm processes import the package before building the model (as the README does)")
    p.add_argument("--render", metavar="JSON", help="only re-render the .md from an existing JSON")
    a = p.parse_args(argv)
    if a.render:
        with open(a.render) as f:
            write_outputs(json.load(f), a.render)
        return 0
    families = [f for f in a.families.split(",") if f]
    routes = [r for r in a.routes.split(",") if r]
    compilers = [c for c in a.compilers.split(",") if c]
    for name, got, valid in (("families", families, FAMILIES), ("routes", routes, ROUTES), ("compilers", compilers, COMPILERS)):
        bad = sorted(set(got) - set(valid))
        if bad:
            p.error(f"unknown {name} {bad}; valid: {', '.join(valid)}")
    import torch
    import transformers

    if a.import_first:
        os.environ[IMPORT_FIRST] = "1"
    combos = [(r, c) for c in compilers for r in routes]
    machine = machine_info()
    work = a.workdir or tempfile.mkdtemp(prefix="tcb_families_")
    print(f"work dir {work}", flush=True)
    t0 = time.perf_counter()
    results: list[dict] = []
    try:
        for family in families:
            results += run_family(family, a.size, combos, a.repeat, work, a.timeout, lambda s: print(s, flush=True))
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    machine["loadavg_end"] = list(os.getloadavg())
    doc = {
        "machine": machine,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": {
            "families": families,
            "routes": routes,
            "compilers": compilers,
            "repeat": a.repeat,
            "size": a.size,
            "import_first": a.import_first,
            "grad": "torch.no_grad()",
            "suite_seconds": round(time.perf_counter() - t0, 1),
        },
        "results": results,
        "summary": {
            "replayed": sum(bool(r["replayed"]) for r in results),
            "goal_met": sum(bool(r["met"]) for r in results),
            "combinations": len(results),
        },
    }
    write_outputs(doc, a.out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 8 and sys.argv[1] == "--child":
        harness.report(_child(*sys.argv[2:8]))
    else:
        sys.exit(main())
