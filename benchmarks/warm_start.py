"""Warm-start benchmark: time to first output, one fresh process per measurement.

Start-up cost is mostly imports, file loading and (re)compiling kernels, all of
which a long-lived process hides; so every number here comes from a new child
python. Modes are interleaved round-robin within each repetition so that a
noisy neighbour on a shared machine hits all modes alike. Caches a mode warms
from are filled once per model by preparation runs that are not timed.

usage: python benchmarks/warm_start.py [--models mlp,gpt,gpt16] [--repeat 5]
       [--modes eager,npu_cached_bypass_inductor,...] [--out PATH]
       python benchmarks/warm_start.py --render PATH.json   # redo .md/.png only

The same file is the child (``--child``): top-level imports are kept to the few
stdlib modules the child needs, so ``import torch`` is timed from a clean start.
"""

from __future__ import annotations

import json
import os
import sys
import time

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT_TAG = "RESULT "


# --------------------------------------------------------------------------- child


def _child(action: str, model_name: str, paths: dict[str, str]) -> dict:
    """Run one action in this (fresh) process and return its measurements."""
    import resource

    t = time.perf_counter()
    import torch

    import_torch_s = time.perf_counter() - t
    sys.path.insert(0, HERE)
    from models import build

    out: dict = {"import_torch_s": import_torch_s}
    with torch.no_grad():  # inference: the caches under test serve no-grad graphs
        model, x = build(model_name)
        t0 = time.perf_counter()
        y = _ACTIONS[action](torch, model, x, paths, out)
        out["first_call_s"] = time.perf_counter() - t0
        # state of the process after the timed part, before the eager reference adds to it
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out["imported_dynamo"] = "torch._dynamo" in sys.modules
        out["imported_inductor"] = "torch._inductor" in sys.modules
        out["imported_inductor_compile_fx"] = "torch._inductor.compile_fx" in sys.modules
        out.update(_counters())
        out["max_abs_diff"] = (y - model(x)).abs().max().item()
    return out


def _counters() -> dict:
    """Hit/miss evidence: our stats, and Dynamo/Inductor counters if they were loaded."""
    found: dict = {}
    tcb = sys.modules.get("torchair_cached_backend")
    if tcb is not None:

        found["tcb_stats"] = tcb.stats().as_dict()
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is not None:
        groups = ("frames", "stats", "aot_autograd", "inductor")
        found["dynamo_counters"] = {g: dict(utils.counters[g]) for g in groups if utils.counters[g]}
    return found


def _run_eager(torch, m, x, paths, out):
    return m(x)


def _run_inductor(torch, m, x, paths, out):
    y = torch.compile(m, fullgraph=True)(x)
    if paths.get("mega_out"):  # preparation: keep the Mega-Cache blob of this cold compile
        blob, _info = torch.compiler.save_cache_artifacts()
        with open(paths["mega_out"], "wb") as f:
            f.write(blob)
    return y


def _run_mega_load(torch, m, x, paths, out):
    with open(paths["mega"], "rb") as f:
        torch.compiler.load_cache_artifacts(f.read())
    return torch.compile(m, fullgraph=True)(x)


def _run_aot_save(torch, m, x, paths, out):
    # compile the unbound forward and call it as aot(m, x): the form that works in 2.13
    aot = torch.compile(m.forward, fullgraph=True).aot_compile(((x,), {}))
    y = aot(m, x)
    aot.save_compiled_function(paths["aot"])
    return y


def _run_aot_load(torch, m, x, paths, out):
    with open(paths["aot"], "rb") as f:
        fn = torch.compiler.load_compiled_function(f)
    return fn(m, x)


def _run_npu_cached(torch, m, x, paths, out):
    opts = {"cache_dir": paths["npu_cache"], "compiler": paths["compiler"]}
    return torch.compile(m, backend="npu_cached", options=opts)(x)


def _run_bypass(torch, m, x, paths, out):
    import torchair_cached_backend as tcb

    fn = tcb.load(m, paths["npu_cache"], compiler=paths["compiler"], fallback=False)
    return fn(x)


_ACTIONS = {
    "eager": _run_eager,
    "inductor": _run_inductor,
    "mega_load": _run_mega_load,
    "aot_save": _run_aot_save,
    "aot_load": _run_aot_load,
    "npu_cached": _run_npu_cached,
    "bypass": _run_bypass,
}

# --------------------------------------------------------------------------- driver

#: mode -> (child action, prep it needs, Inductor dir: "fresh" or "prep", extra paths)
MODES: dict[str, tuple[str, str | None, str, dict[str, str]]] = {
    "eager": ("eager", None, "fresh", {}),
    "inductor_cold": ("inductor", None, "fresh", {}),
    "inductor_warm": ("inductor", "inductor", "prep", {}),
    "megacache_empty_dir": ("mega_load", "inductor", "fresh", {}),
    "aot_precompile_same_dir": ("aot_load", "aot", "prep", {}),
    "aot_precompile_empty_dir": ("aot_load", "aot", "fresh", {}),
    "npu_cached_cold": ("npu_cached", None, "fresh", {"compiler": "inductor"}),
    "npu_cached_backend_warm": ("npu_cached", "npu_inductor", "fresh", {"compiler": "inductor"}),
    "npu_cached_bypass_eager": ("bypass", "npu_eager", "fresh", {"compiler": "eager"}),
    "npu_cached_bypass_inductor": ("bypass", "npu_inductor", "fresh", {"compiler": "inductor"}),
}
#: prep -> (child action, extra paths); run in this order, only if a chosen mode needs it.
#: ``aot`` shares the ``inductor`` prep's Inductor dir, so "same dir" holds both.
PREPS: dict[str, tuple[str, dict[str, str]]] = {
    "inductor": ("inductor", {"mega_out": "mega.bin"}),
    "aot": ("aot_save", {"aot": "aot.bin"}),
    "npu_inductor": ("npu_cached", {"npu_cache": "npu_inductor", "compiler": "inductor"}),
    "npu_eager": ("npu_cached", {"npu_cache": "npu_eager", "compiler": "eager"}),
}
CHILD_ENV = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1"}
#: an installed package has .pyc files; without them every child recompiles our
#: package's source (~70 ms), which is a property of this checkout, not of the cache
BYTECODE_CACHE = True


def _disk_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _spawn(action: str, model: str, paths: dict[str, str], inductor_dir: str, timeout: float) -> dict:
    """One child process; returns its result dict, or {"error": ...}. Never raises."""
    import subprocess

    os.makedirs(inductor_dir, exist_ok=True)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, **CHILD_ENV)
    if BYTECODE_CACHE:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", action, model, json.dumps(paths)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f}s", "wall_s": time.perf_counter() - t}
    wall = time.perf_counter() - t
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG) :])
            res["wall_s"] = wall
            return res
    tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}, no output"])[-1]
    return {"error": tail[:500], "wall_s": wall}


def _median(values: list[float]) -> float | None:
    import statistics

    return statistics.median(values) if values else None


def _summarize(model: str, mode: str, runs: list[dict], errors: list[str], disk: int | None) -> dict:
    ok = [r for r in runs if "error" not in r]
    first = [r["first_call_s"] for r in ok]
    imp = [r["import_torch_s"] for r in ok]
    last = ok[-1] if ok else {}
    return {
        "model": model,
        "mode": mode,
        "first_call_s": first,
        "median_first_call_s": _median(first),
        "min_first_call_s": min(first) if first else None,
        "max_first_call_s": max(first) if first else None,
        "import_torch_s": imp,
        "median_import_torch_s": _median(imp),
        "wall_s": [r["wall_s"] for r in ok],
        "median_wall_s": _median([r["wall_s"] for r in ok]),
        "peak_rss_mb": _median([r["peak_rss_mb"] for r in ok]),
        "disk_bytes": disk,
        "inductor_dir_written_bytes": _median(
            [r["inductor_dir_written_bytes"] for r in ok if "inductor_dir_written_bytes" in r]
        ),
        "imported_dynamo": _all_same([r["imported_dynamo"] for r in ok]),
        "imported_inductor": _all_same([r["imported_inductor"] for r in ok]),
        "imported_inductor_compile_fx": _all_same([r["imported_inductor_compile_fx"] for r in ok]),
        "max_abs_diff": max((r["max_abs_diff"] for r in ok), default=None),
        "tcb_stats": last.get("tcb_stats"),
        "dynamo_counters": last.get("dynamo_counters"),
        "errors": errors,
    }


def _all_same(values: list) -> object:
    """The common value, or "mixed" if runs disagree (None if no run succeeded)."""
    if not values:
        return None
    return values[0] if all(v == values[0] for v in values) else "mixed"


def machine_info() -> dict:
    import platform

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def run_model(model: str, modes: list[str], repeat: int, work: str, timeout: float, log) -> list[dict]:
    """Preparation runs, then ``repeat`` round-robin passes over ``modes``."""
    wdir = os.path.join(work, model)
    prep_ind = os.path.join(wdir, "prep_inductor")
    os.makedirs(wdir, exist_ok=True)
    files = {"mega": os.path.join(wdir, "mega.bin"), "aot": os.path.join(wdir, "aot.bin")}
    prep_errors: dict[str, str] = {}
    prep_disk: dict[str, int] = {}
    needed = {MODES[m][1] for m in modes} - {None}
    for prep in (p for p in PREPS if p in needed):
        action, extra = PREPS[prep]
        paths = {k: (v if k == "compiler" else os.path.join(wdir, v)) for k, v in extra.items()}
        ind = prep_ind if prep in ("inductor", "aot") else os.path.join(wdir, f"prep_{prep}_ind")
        log(f"[{model}] prepare {prep} ...")
        res = _spawn(action, model, paths, ind, timeout)
        if "error" in res:
            prep_errors[prep] = f"preparation {prep} failed: {res['error']}"
            log(f"[{model}]   FAILED: {res['error']}")
            continue
        log(f"[{model}]   done in {res['wall_s']:.1f}s")
        if prep == "inductor":
            prep_disk["inductor"] = _disk_bytes(prep_ind)  # before the aot prep adds to it
        elif prep == "aot":
            prep_disk["aot"] = _disk_bytes(files["aot"])
        else:
            prep_disk[prep] = _disk_bytes(paths["npu_cache"])

    runs: dict[str, list[dict]] = {m: [] for m in modes}
    errors: dict[str, list[str]] = {m: [] for m in modes}
    cold_disk: dict[str, list[int]] = {m: [] for m in modes}
    for rep in range(repeat):
        for mode in modes:
            action, prep, ind_kind, extra = MODES[mode]
            if prep in prep_errors:
                if rep == 0:
                    errors[mode].append(prep_errors[prep])
                continue
            rdir = os.path.join(wdir, f"r{rep}_{mode}")
            ind = prep_ind if ind_kind == "prep" else os.path.join(rdir, "inductor")
            paths = dict(files, **extra)
            if prep in ("npu_inductor", "npu_eager"):
                paths["npu_cache"] = os.path.join(wdir, prep)
            elif action == "npu_cached":
                paths["npu_cache"] = os.path.join(rdir, "npu_cache")
            res = _spawn(action, model, paths, ind, timeout)
            if ind_kind == "fresh":
                res["inductor_dir_written_bytes"] = _disk_bytes(ind)
            if "error" in res:
                errors[mode].append(f"rep {rep}: {res['error']}")
                log(f"[{model}] rep {rep} {mode:28s} ERROR {res['error']}")
            else:
                log(
                    f"[{model}] rep {rep} {mode:28s} first call {res['first_call_s']:8.4f}s  wall {res['wall_s']:6.2f}s"
                )
                if mode == "inductor_cold":
                    cold_disk[mode].append(_disk_bytes(ind))
                elif mode == "npu_cached_cold":
                    cold_disk[mode].append(_disk_bytes(paths["npu_cache"]))
            runs[mode].append(res)

    def disk(mode: str) -> int | None:
        prep = MODES[mode][1]
        if mode == "eager":
            return 0
        if mode in cold_disk and cold_disk[mode]:
            return int(_median(cold_disk[mode]))
        if mode == "megacache_empty_dir":
            return _disk_bytes(files["mega"]) if os.path.exists(files["mega"]) else None
        return prep_disk.get(prep)

    return [_summarize(model, m, runs[m], errors[m], disk(m)) for m in modes]


# --------------------------------------------------------------------------- ratios and targets


def _first(results: list[dict], model: str, mode: str) -> float | None:
    for r in results:
        if r["model"] == model and r["mode"] == mode:
            return r["median_first_call_s"]
    return None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios_and_targets(results: list[dict]) -> tuple[dict, list[dict]]:
    """Ratios of medians from this run, and the project's warm-start goals."""
    models = list(dict.fromkeys(r["model"] for r in results))
    modes = list(dict.fromkeys(r["mode"] for r in results))
    ratios: dict = {
        "vs_eager": {
            m: {mo: _div(_first(results, m, mo), _first(results, m, "eager")) for mo in modes} for m in models
        },
        "vs_inductor_cold": {
            m: {mo: _div(_first(results, m, mo), _first(results, m, "inductor_cold")) for mo in modes} for m in models
        },
    }
    if "gpt" in models and "gpt16" in models:
        ratios["gpt16_over_gpt"] = {mo: _div(_first(results, "gpt16", mo), _first(results, "gpt", mo)) for mo in modes}

    targets: list[dict] = []

    def target(name: str, value: float | None, goal: str, ok) -> None:
        targets.append({"name": name, "value": value, "goal": goal, "met": None if value is None else bool(ok(value))})

    for m in ("gpt", "gpt16"):
        if m in models:
            v = _div(_first(results, m, "npu_cached_bypass_eager"), _first(results, m, "eager"))
            target(f"{m}: bypass_eager first call / eager", v, "<= 2", lambda v: v <= 2)
    if "gpt" in models:
        byp = _first(results, "gpt", "npu_cached_bypass_inductor")
        target("gpt: bypass_inductor first call (s)", byp, "<= 0.25", lambda v: v <= 0.25)
        v = _div(_first(results, "gpt", "aot_precompile_same_dir"), byp)
        target("gpt: aot_precompile_same_dir / bypass_inductor", v, ">= 9", lambda v: v >= 9)
        v = _div(_first(results, "gpt", "aot_precompile_empty_dir"), byp)
        target("gpt: aot_precompile_empty_dir / bypass_inductor", v, ">= 30", lambda v: v >= 30)
    for m in models:
        v = _div(_first(results, m, "npu_cached_backend_warm"), _first(results, m, "inductor_warm"))
        target(f"{m}: npu_cached_backend_warm / inductor_warm", v, "<= 1", lambda v: v <= 1)
        v = _div(_first(results, m, "npu_cached_cold"), _first(results, m, "inductor_cold"))
        target(f"{m}: npu_cached_cold / inductor_cold", v, "<= 1.1", lambda v: v <= 1.1)
    return ratios, targets


# --------------------------------------------------------------------------- rendering


def _fmt(v, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v and abs(v) < 1e-3:
            return f"{v:.2g}"
        if abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.{digits}f}".rstrip("0").rstrip(".")
    return str(v)


def _kb(n: int | None) -> str:
    return "–" if n is None else f"{n / 1024:.0f}"


def render_markdown(doc: dict) -> str:
    """Tables for humans; the JSON is the source of truth."""
    mach = doc["machine"]
    lines = [
        "# Warm start: time to first output in a fresh process",
        "",
        f"torch {doc['torch']}, Python {mach['python']}, {mach['cpu']} ({mach['cores']} cores), "
        f"created {doc['created']}; repeat {doc['config']['repeat']}, child env {doc['config']['child_env']}. "
        "Seconds are medians over fresh processes; first call = model built -> first output, "
        "including torch.compile() / cache loading.",
        "",
    ]
    vs_eager = doc["ratios"]["vs_eager"]
    for model in dict.fromkeys(r["model"] for r in doc["results"]):
        lines += [
            f"## {model}",
            "",
            "| mode | first call s (median) | min | max | × eager | import torch s | process wall s | peak RSS MB "
            "| disk KB | Inductor dir written KB | dynamo | inductor | max abs diff | hits/misses/bypass | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in doc["results"] if r["model"] == model):
            st = r.get("tcb_stats") or {}
            hm = f"{st['hits']}/{st['misses']}/{st['bypass_loads']}" if st else "–"
            lines.append(
                f"| {r['mode']} | {_fmt(r['median_first_call_s'])} | {_fmt(r['min_first_call_s'])} | "
                f"{_fmt(r['max_first_call_s'])} | {_fmt(vs_eager[model].get(r['mode']), 3)} | "
                f"{_fmt(r['median_import_torch_s'], 3)} | {_fmt(r['median_wall_s'], 3)} | {_fmt(r['peak_rss_mb'], 0)} | "
                f"{_kb(r['disk_bytes'])} | {_kb(r['inductor_dir_written_bytes'])} | {_fmt(r['imported_dynamo'])} | "
                f"{_fmt(r['imported_inductor'])} | {_fmt(r['max_abs_diff'], 2)} | {hm} | {len(r['errors'])} |"
            )
        lines.append("")
    lines += ["## Targets", "", "| target | value | goal | met |", "|---|---|---|---|"]
    for t in doc["targets"]:
        met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['name']} | {_fmt(t['value'], 3)} | {t['goal']} | {met} |")
    scaling = doc["ratios"].get("gpt16_over_gpt")
    if scaling:
        lines += ["", "## Scaling: gpt16 / gpt first call", "", "| mode | ratio |", "|---|---|"]
        lines += [f"| {mode} | {_fmt(v, 3)} |" for mode, v in scaling.items()]
    errs = [(r["model"], r["mode"], e) for r in doc["results"] for e in r["errors"]]
    if errs:
        lines += ["", "## Errors", ""] + [f"- {m} / {mo}: `{e}`" for m, mo, e in errs]
    return "\n".join(lines) + "\n"


def render_png(doc: dict, path: str) -> str | None:
    """Grouped log-scale bars; returns a note instead if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no PNG written"
    models = list(dict.fromkeys(r["model"] for r in doc["results"]))
    modes = list(dict.fromkeys(r["mode"] for r in doc["results"]))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(modes)), 5))
    width = 0.8 / max(1, len(models))
    for i, model in enumerate(models):
        vals = [_first(doc["results"], model, mode) or 0 for mode in modes]
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(modes))]
        ax.bar(xs, vals, width, label=model)
    ax.set_yscale("log")
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels(modes, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("first call, s (median, log)")
    ax.set_title(f"Warm start in a fresh process (torch {doc['torch']})")
    ax.legend()
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_outputs(doc: dict, out: str) -> None:
    harness.write_outputs(doc, out, render_markdown, render_png)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import datetime
    import shutil
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,gpt,gpt16")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=os.path.join(HERE, "results", "warm_start.json"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    p.add_argument("--workdir", help="where caches go (default: a temp dir, deleted afterwards)")
    p.add_argument("--render", metavar="JSON", help="only re-render .md/.png from an existing JSON")
    p.add_argument(
        "--no-bytecode-cache",
        action="store_true",
        help="keep PYTHONDONTWRITEBYTECODE for children (default: unset it, as an installed package has .pyc files)",
    )
    a = p.parse_args(argv)
    global BYTECODE_CACHE
    BYTECODE_CACHE = not a.no_bytecode_cache
    if a.render:
        with open(a.render) as f:
            write_outputs(json.load(f), a.render)
        return 0
    models = [m for m in a.models.split(",") if m]
    modes = [m for m in a.modes.split(",") if m]
    bad = sorted(set(modes) - set(MODES))
    if bad:
        p.error(f"unknown modes {bad}; valid: {', '.join(MODES)}")
    if "eager" not in modes:
        modes.insert(0, "eager")  # every ratio is relative to it
    import torch

    machine = machine_info()
    work = a.workdir or tempfile.mkdtemp(prefix="tcb_warm_start_")
    print(f"work dir {work}", flush=True)
    t0 = time.perf_counter()
    results: list[dict] = []
    try:
        for model in models:
            results += run_model(model, modes, a.repeat, work, a.timeout, lambda s: print(s, flush=True))
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    ratios, targets = ratios_and_targets(results)
    machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    doc = {
        "machine": machine,
        "torch": torch.__version__,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": {
            "models": models,
            "modes": modes,
            "repeat": a.repeat,
            "child_env": CHILD_ENV,
            "bytecode_cache": BYTECODE_CACHE,
            "grad": "torch.no_grad()",
            "timeout_s": a.timeout,
            "suite_seconds": round(time.perf_counter() - t0, 1),
        },
        "results": results,
        "ratios": ratios,
        "targets": targets,
    }
    write_outputs(doc, a.out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "--child":
        result = _child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
        print(RESULT_TAG + json.dumps(result), flush=True)
    else:
        sys.exit(main())
