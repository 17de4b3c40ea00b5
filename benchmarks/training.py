"""First training step of a fresh process, and the steady-state step, through each route.

Modes (one fresh child per measurement; the step is forward + ``loss.backward()`` +
``opt.step()``; timed from the model built and the optimizer made to the first step done):

* ``eager``;
* ``compile_cold`` / ``compile_warm``: plain ``torch.compile`` (Inductor) with an empty
  Inductor cache dir, then again with that dir kept (its FX + AOTAutograd caches);
* ``ours_cold``: ``npu_cached`` with the ``inductor`` inner compiler, empty dirs;
* ``ours_warm``: the same in a fresh process (graph-level hits), an EMPTY Inductor dir;
* ``ours_load``: ``tcb.load(model, dir)`` (bytecode replay), an EMPTY Inductor dir;
* ``steady_ab``: the steady step of plain ``torch.compile`` (warm) and of ``tcb.load`` on two
  copies of the model in ONE process, alternating step by step (shared cores make steady
  steps of separate processes incomparable).

Targets (issue 15): warm backend route <= plain torch.compile's warm first step; warm
``load()`` first step within 3x eager's first step; steady-state step within 1.05x of
torch.compile's.

    python benchmarks/training.py [--models gpt,llama,gpt2_hf] [--repeat 1] [--steps 10]

``gpt2_hf``: transformers' GPT-2 trained with ``labels=`` (its loss property logs a warning once: a
graph break whose continuation Dynamo compiles nothing in; ``load()``'s warm start runs it as Python).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from harness import report, spawn, write_outputs  # noqa: E402

MODES = ("eager", "compile_cold", "compile_warm", "ours_cold", "ours_warm", "ours_load", "steady_ab")
MODELS = ("gpt", "llama", "gpt2_hf")


def _model(name: str):  # noqa: ANN202 - torch is imported inside the child only
    import torch

    torch.manual_seed(0)
    if name == "gpt":
        from models import GPT

        model = GPT(n_layer=2)
        idx = torch.randint(0, model.tok.num_embeddings, (2, 64))

        def loss_of(fn):  # noqa: ANN001, ANN202
            logits = fn(idx[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))

        return model.train(), loss_of
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        config._attn_implementation = "eager"
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, 256, (2, 32))
        return model.train(), lambda fn: fn(input_ids=ids, labels=ids).loss
    if name == "gpt2_hf":  # transformers GPT-2 with labels: its loss property logs once, a graph break
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        import hf_tiny

        model, inputs = hf_tiny.build("gpt2")
        return model.train(), lambda fn: fn(**inputs, labels=inputs["input_ids"]).loss
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _steady_ab(name: str, cache: str, steps: int) -> dict:
    import torch

    import torchair_cached_backend as tcb

    routes = {}
    for route in ("compile", "load"):
        model, loss_of = _model(name)
        fn = torch.compile(model) if route == "compile" else tcb.load(model, cache, compiler="inductor")
        routes[route] = (fn, loss_of, torch.optim.SGD(model.parameters(), lr=1e-3))
    times: dict[str, list[float]] = {r: [] for r in routes}
    for i in range(steps + 3):
        for route, (fn, loss_of, opt) in routes.items():
            t = time.perf_counter()
            loss_of(fn).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 3:
                times[route].append(time.perf_counter() - t)
    compile_step, load_step = (statistics.median(times[r]) for r in ("compile", "load"))
    return {"first_step": None, "steady_step": load_step, "compile_steady_step": compile_step,
            "ratio": load_step / compile_step}


def _child(mode: str, name: str, cache: str, steps: int) -> dict:
    import torch

    if mode == "steady_ab":
        return _steady_ab(name, cache, max(steps, 30))

    model, loss_of = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    if mode == "eager":
        fn = model
    elif mode.startswith("compile"):
        fn = torch.compile(model)
    else:
        import torchair_cached_backend as tcb

        if mode == "ours_load":
            fn = tcb.load(model, cache, compiler="inductor")
        else:
            fn = torch.compile(model, backend="npu_cached", options={"cache_dir": cache, "compiler": "inductor"})

    def step() -> float:
        loss = loss_of(fn)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    loss = step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    out = {"first_step": first, "steady_step": statistics.median(times) if times else None, "loss": loss}
    if mode.startswith("ours"):
        import torchair_cached_backend as tcb

        s = tcb.stats()
        out.update(misses=s.misses, hits=s.hits, bypass_loads=s.bypass_loads, uncached=s.uncached)
    inductor_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    out["inductor_dir_entries"] = len(os.listdir(inductor_dir)) if os.path.isdir(inductor_dir) else 0
    return out


def run_model(name: str, repeat: int, steps: int, work: str, timeout: float,
              modes: tuple[str, ...] = MODES) -> list[dict]:
    """Each repetition: cold runs fill their dirs, then warm runs read them (a warm mode needs
    its cold one among ``modes``)."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(repeat):
        base = os.path.join(work, f"{name}-{r}")
        plain_dir, ours_cache = os.path.join(base, "plain_inductor"), os.path.join(base, "ours")
        for mode in modes:
            if mode.startswith("compile") or mode == "steady_ab":
                inductor_dir = plain_dir  # empty for compile_cold, kept for compile_warm
            else:
                inductor_dir = os.path.join(base, f"empty-{mode}")
            res = spawn(__file__, [mode, name, ours_cache, str(steps)], inductor_dir, timeout,
                        {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": os.pathsep.join(
                            [os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")])})
            runs[mode].append(res)
            print(f"{name} {mode} #{r}: {res}", flush=True)
    rows = []
    for mode, results in runs.items():
        ok = [x for x in results if "error" not in x]
        rows.append({
            "model": name,
            "mode": mode,
            "first_step": statistics.median(x["first_step"] for x in ok) if ok and ok[0]["first_step"] is not None
            else None,
            "steady_step": statistics.median(x["steady_step"] for x in ok) if ok else None,
            "runs": results,
        })
    return rows


def _get(rows: list[dict], model: str, mode: str, field: str) -> float | None:
    return next((r[field] for r in rows if r["model"] == model and r["mode"] == mode), None)


def targets(rows: list[dict]) -> list[dict]:
    out = []
    for model in sorted({r["model"] for r in rows}):
        def add(name: str, value: float | None, limit: float | None, model: str = model) -> None:
            out.append({"model": model, "target": name, "value": value, "limit": limit,
                        "met": None if value is None or limit is None else value <= limit})

        add("ours_warm first step <= compile_warm first step (s)", _get(rows, model, "ours_warm", "first_step"),
            _get(rows, model, "compile_warm", "first_step"))
        eager = _get(rows, model, "eager", "first_step")
        add("ours_load first step <= 3x eager first step (s)", _get(rows, model, "ours_load", "first_step"),
            None if eager is None else 3 * eager)
        steady = _get(rows, model, "compile_warm", "steady_step")
        add("ours_warm steady step <= 1.05x torch.compile's (s, separate processes)",
            _get(rows, model, "ours_warm", "steady_step"), None if steady is None else 1.05 * steady)
        ab = next((r for r in rows if r["model"] == model and r["mode"] == "steady_ab"), None)
        ok = [x for x in (ab or {}).get("runs", []) if "ratio" in x]
        add("load() steady step / torch.compile's, same process, alternating (ratio)",
            statistics.median(x["ratio"] for x in ok) if ok else None, 1.05)
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else (f"{v:.4f}" if v < 1 else f"{v:.2f}")


def render(doc: dict) -> str:
    lines = [
        "# First training step and steady-state step (CPU)",
        "",
        f"{doc['machine']}; repeat {doc['repeat']}, steady step = median of {doc['steps']} steps after the first.",
        "Step = forward + loss.backward() + SGD step; first step timed from model and optimizer built.",
        "",
        "| model | mode | first step (s) | steady step (s) |",
        "|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(f"| {r['model']} | {r['mode']} | {_fmt(r['first_step'])} | {_fmt(r['steady_step'])} |")
    lines += ["", "| model | target | value | limit | met |", "|---|---|---|---|---|"]
    for t in doc["targets"]:
        met = "-" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['model']} | {t['target']} | {_fmt(t['value'])} | {_fmt(t['limit'])} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--modes", default=",".join(MODES), help="a subset, e.g. eager,ours_cold,ours_load")
    p.add_argument("--out", default=os.path.join(HERE, "results", "training.json"))
    a = p.parse_args(argv)
    modes = tuple(m for m in MODES if m in a.modes.split(","))
    work = tempfile.mkdtemp(prefix="tcb_training_bench_")
    try:
        rows = []
        for name in a.models.split(","):
            rows += run_model(name, a.repeat, a.steps, work, a.timeout, modes)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import platform

    doc = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, OMP_NUM_THREADS="
                      f"{os.environ.get('OMP_NUM_THREADS', 'unset')}", "repeat": a.repeat, "steps": a.steps,
           "rows": rows, "targets": targets(rows)}
    write_outputs(doc, a.out, render)
    print(render(doc))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        report(_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
    else:
        sys.exit(main())
