"""Real-size warm start: random-init transformers Llama at ~150M and ~850M parameters.

Every measurement is a fresh child process. A child builds the Llama (random weights, fast
init), then serves one greedy generation with a ``StaticCache`` (``dynamic=False``): a
128-token prefill, then ``--steps`` decode calls of one token each; then ``--rounds`` more
generations give the steady state. Modes (how the child runs the model):

* ``eager``: ``model.forward``;
* ``inductor_cold`` / ``inductor_warm``: plain ``torch.compile(model, dynamic=False)``, empty /
  the cold run's Inductor dir (FX graph + AOTAutograd caches);
* ``caching_precompile_warm``: PyTorch's caching precompile (``torch._dynamo.config.caching_precompile``)
  over the cold run's Mega-Cache blob and Inductor dir;
* ``npu_cached_cold`` / ``npu_cached_backend_warm``: ``torch.compile(model, backend="npu_cached")``
  cold / over the cold run's cache, empty Inductor dir;
* ``bypass_inductor`` / ``bypass_eager``: ``tcb.load(model, dir, compiler=...)`` over the cache of
  an ``npu_cached`` cold run with that inner compiler, empty Inductor dir.

The cold modes are the preparation runs that fill the caches the warm modes read, once per
configuration (size x dtype): one process each, reused by every repetition. The warm modes and
eager run ``--repeats`` times, round-robin within a repetition. Each child's result is written as
one JSON row into ``<workdir>/rows/`` as soon as it exists, and a rerun skips the rows and
preparations that are done (``--force`` redoes them), so an interrupted run resumes.

Per child: ``first_call_s`` (model built -> the prefill's output, i.e. compile / load + the
prefill: the first token of a fresh server), ``first_decode_s`` (the first decode call: loads or
compiles the decode graph), ``first_generation_s``, steady ``prefill_ms`` and ``per_token_ms``
(median over the timed generations), ``peak_rss_mb`` (the child's ru_maxrss), the tokens (compared
with eager's), Dynamo frames compiled, and for the bypass modes the seconds inside ``tcb.load``.
One extra ``TCB_PROFILE=1`` child per bypass mode and configuration records the load's phase
breakdown (not part of the medians).

usage: python benchmarks/scale.py [--sizes 150m,850m] [--dtypes fp32,bf16] [--modes ...]
       [--repeats 5] [--quick] [--force] [--workdir DIR] [--out PATH]
       python benchmarks/scale.py --render benchmarks/results/scale.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import harness

T_START = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

#: name -> Llama config: layers, hidden, heads, kv heads (GQA 4:1), MLP width, vocab
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(layers=4, hidden=128, heads=4, kv_heads=2, inter=352, vocab=1000),
    "150m": dict(layers=8, hidden=1024, heads=16, kv_heads=4, inter=2816, vocab=32000),
    "850m": dict(layers=16, hidden=2048, heads=16, kv_heads=4, inter=5632, vocab=32000),
}
DTYPES = ("fp32", "bf16")
#: mode -> (child action, inner compiler, the preparation whose cache it reads)
MODES: dict[str, tuple[str, str | None, str | None]] = {
    "eager": ("eager", None, None),
    "inductor_cold": ("inductor", None, None),
    "inductor_warm": ("inductor", None, "inductor_cold"),
    "caching_precompile_warm": ("precompile", None, "caching_precompile_cold"),
    "npu_cached_cold": ("npu_cached", "inductor", None),
    "npu_cached_backend_warm": ("npu_cached", "inductor", "npu_cached_cold"),
    "bypass_inductor": ("bypass", "inductor", "npu_cached_cold"),
    "bypass_eager": ("bypass", "eager", "npu_cached_eager_cold"),
}
#: preparations (cold runs, one per configuration), each also a measured row
PREPS: dict[str, tuple[str, str | None]] = {
    "inductor_cold": ("inductor", None),
    "caching_precompile_cold": ("precompile", None),
    "npu_cached_cold": ("npu_cached", "inductor"),
    "npu_cached_eager_cold": ("npu_cached", "eager"),
}
#: the rows' order in the tables
ORDER = ("eager", "inductor_cold", "inductor_warm", "caching_precompile_cold", "caching_precompile_warm",
         "npu_cached_cold", "npu_cached_backend_warm", "bypass_inductor", "npu_cached_eager_cold", "bypass_eager")
CHILD_ENV = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1"}
RESULT_TAG = "RESULT "


# --------------------------------------------------------------------------- child


def build_llama(size: str, dtype_name: str):
    """A random-init LlamaForCausalLM in eval mode, the same weights in every process.

    The init is skipped (``no_init_weights``) and every weight is filled from one seeded
    random block (norms with ones): 850M parameters take well under a second instead of
    the ~10 s of transformers' own init."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    s = SIZES[size]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    config = LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    with no_init_weights():
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    period = 1_000_003  # prime: rows of a weight never line up with the block
    block = torch.randn(period + 4096, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(dtype)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if p.dim() == 1:
                p.fill_(1.0)
                continue
            flat, n = p.view(-1), p.numel()
            src = block[(i * 131) % 4096 :][:period]
            whole = n - n % period
            if whole:
                flat[:whole].view(-1, period).copy_(src)
            if n % period:
                flat[whole:].copy_(src[: n % period])
    return model.eval(), config


def _make(action: str, compiler: str | None, model, paths: dict, out: dict):
    import torch

    if action == "eager":
        return model.forward
    if action == "inductor":
        return torch.compile(model, dynamic=False)
    if action == "precompile":
        torch._dynamo.config.caching_precompile = True
        blob = paths.get("mega")
        if blob and os.path.exists(blob) and not paths.get("save_mega"):
            with open(blob, "rb") as f:
                torch.compiler.load_cache_artifacts(f.read())
        return torch.compile(model, dynamic=False)
    opts = {"cache_dir": paths["npu_cache"], "compiler": compiler}
    if action == "npu_cached":
        return torch.compile(model, backend="npu_cached", dynamic=False, options=opts)
    import torchair_cached_backend as tcb

    t = time.perf_counter()
    fn = tcb.load(model, paths["npu_cache"], compiler=compiler, dynamic=False, fallback=False)
    out["load_s"] = time.perf_counter() - t
    return fn


def _child(action: str, compiler: str | None, cfg: dict) -> dict:
    """One fresh process: build, first generation (timed call by call), steady generations."""
    import resource
    import statistics

    t = time.perf_counter()
    import torch

    out: dict = {"import_torch_s": time.perf_counter() - t}
    t = time.perf_counter()
    from transformers import StaticCache

    model, config = build_llama(cfg["size"], cfg["dtype"])
    out["build_s"] = time.perf_counter() - t
    out["params"] = sum(p.numel() for p in model.parameters())
    prompt = torch.randint(3, config.vocab_size, (1, cfg["prompt"]), generator=torch.Generator().manual_seed(3))
    steps = cfg["steps"]
    cache = StaticCache(config=config, max_cache_len=cfg["prompt"] + steps + 1)
    # allocated now, as a server does once: a lazily initialised cache is a different input to the
    # first prefill than to every later one (one more graph, and a recompile in the steady state)
    head_dim = config.hidden_size // config.num_attention_heads
    cache.early_initialization(1, config.num_key_value_heads, head_dim, model.dtype, torch.device("cpu"))

    def generate(fn, timings: list[float]) -> list[int]:
        cache.reset()
        ids, tokens = prompt, []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            logits = fn(input_ids=ids, cache=cache, use_cache=True).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(ids.item()))
            timings.append(time.perf_counter() - t0)
        return tokens

    with torch.no_grad():
        t0 = time.perf_counter()
        fn = _make(action, compiler, model, cfg["paths"], out)
        out["make_s"] = time.perf_counter() - t0
        first: list[float] = []
        tokens = generate(fn, first)
        first[0] += out["make_s"]
        out["first_call_s"] = first[0]
        out["ttft_from_process_start_s"] = t0 - T_START + first[0]
        out["first_decode_s"] = first[1] if len(first) > 1 else None
        out["first_generation_s"] = sum(first)
        out["rss_after_first_generation_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        frames_first = _frames()
        if cfg["paths"].get("save_mega"):
            blob, _info = torch.compiler.save_cache_artifacts()
            with open(cfg["paths"]["mega"], "wb") as f:
                f.write(blob)
        prefill, decode = [], []
        for _ in range(cfg["rounds"]):
            timings: list[float] = []
            got = generate(fn, timings)
            out.setdefault("tokens_stable", True)
            out["tokens_stable"] = out["tokens_stable"] and got == tokens
            prefill.append(timings[0])
            decode += timings[1:]
    out.update(
        tokens=tokens,
        prefill_ms=statistics.median(prefill) * 1e3 if prefill else None,
        per_token_ms=statistics.median(decode) * 1e3 if decode else None,
        per_token_min_ms=min(decode) * 1e3 if decode else None,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        frames_first_generation=frames_first,
        frames_steady=_frames() - frames_first,
        imported_dynamo="torch._dynamo" in sys.modules,
        imported_inductor="torch._inductor" in sys.modules,
    )
    tcb = sys.modules.get("torchair_cached_backend")
    if tcb is not None:
        s = tcb.stats().as_dict()
        out["tcb_stats"] = s
        if action == "bypass":
            out["replayed"] = frames_first == 0 and s["bypass_loads"] >= 1 and s["fallbacks"] == 0
    return out


def _frames() -> int:
    utils = sys.modules.get("torch._dynamo.utils")
    return utils.counters["frames"].get("total", 0) if utils is not None else 0


# --------------------------------------------------------------------------- driver


def _disk_bytes(path: str) -> int | None:
    if not os.path.exists(path):
        return None
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


def _spawn(action: str, compiler: str | None, cfg: dict, inductor_dir: str, timeout: float,
           extra_env: dict | None = None) -> dict:
    """One child; its result dict (plus wall time and ``tcb profile`` stderr lines) or {"error": ...}."""
    import subprocess

    env = harness.child_environ(inductor_dir, {**CHILD_ENV, **(extra_env or {})})
    if "TCB_PROFILE" not in (extra_env or {}):
        env.pop("TCB_PROFILE", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", action, compiler or "-", json.dumps(cfg)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f}s", "wall_s": time.perf_counter() - t}
    wall = time.perf_counter() - t
    profile = [ln for ln in proc.stderr.splitlines() if ln.startswith("tcb profile")]
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG) :])
            res.update(wall_s=wall, profile=profile)
            return res
    err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    # the exception line, not the last frame: "crashes" must say with what, and where
    at = next((i for i in range(len(err) - 1, -1, -1) if not err[i].startswith(" ") and ":" in err[i]), None)
    if at is None:
        return {"error": (err[-1] if err else f"exit code {proc.returncode}, no output")[:600], "wall_s": wall}
    where = next((ln.strip() for ln in reversed(err[:at]) if ln.lstrip().startswith("File \"/")), "")
    return {"error": err[at][:400], "error_at": where[:300], "wall_s": wall}


class Run:
    """One configuration's work dir: caches, per-row JSON, resumable."""

    def __init__(self, work: str, size: str, dtype: str, args, log) -> None:
        self.size, self.dtype, self.args, self.log = size, dtype, args, log
        self.dir = os.path.join(work, f"{size}_{dtype}")
        self.rows = os.path.join(work, "rows")
        os.makedirs(self.rows, exist_ok=True)
        self.cfg = {"size": size, "dtype": dtype, "prompt": args.prompt, "steps": args.steps, "rounds": args.rounds}

    def row_path(self, mode: str, rep: int | str) -> str:
        return os.path.join(self.rows, f"{self.size}_{self.dtype}_{mode}_{rep}.json")

    def paths(self, prep: str | None) -> dict:
        d = self.dir
        p = {"mega": os.path.join(d, "mega_precompile.bin")}
        if prep in ("npu_cached_cold", "npu_cached_eager_cold"):
            p["npu_cache"] = os.path.join(d, prep)
        return p

    def prep_inductor_dir(self, prep: str) -> str:
        return os.path.join(self.dir, f"ind_{prep}")

    def run_row(self, mode: str, rep: int | str, action: str, compiler: str | None, paths: dict, ind: str,
                extra_env: dict | None = None) -> dict:
        path = self.row_path(mode, rep)
        if os.path.exists(path) and not self.args.force:
            with open(path) as f:
                return json.load(f)
        res = _spawn(action, compiler, dict(self.cfg, paths=paths), ind, self.args.timeout, extra_env)
        res.update(size=self.size, dtype=self.dtype, mode=mode, rep=rep,
                   loadavg=list(os.getloadavg()), created=time.strftime("%Y-%m-%dT%H:%M:%S"))
        if "error" in res:
            self.log(f"[{self.size} {self.dtype}] {mode} {rep}: ERROR {res['error']}")
        else:
            self.log(f"[{self.size} {self.dtype}] {mode} {rep}: first call {res['first_call_s']:.3f}s "
                     f"per token {res['per_token_ms']:.1f} ms, wall {res['wall_s']:.1f}s")
        with open(path + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(path + ".tmp", path)
        return res

    def prepare(self, modes: list[str]) -> None:
        needed = {MODES[m][2] for m in modes} | {m for m in modes if m in PREPS}
        for prep in (p for p in PREPS if p in needed):
            action, compiler = PREPS[prep]
            paths = self.paths(prep)
            if action == "precompile":
                paths["save_mega"] = "1"
            if self.args.force or not os.path.exists(self.row_path(prep, "prep")):
                import shutil  # a cold run starts from nothing, also after an interrupted one

                for d in (paths.get("npu_cache"), self.prep_inductor_dir(prep)):
                    if d:
                        shutil.rmtree(d, ignore_errors=True)
            res = self.run_row(prep, "prep", action, compiler, paths, self.prep_inductor_dir(prep))
            if "error" not in res and "disk_bytes" not in res:
                res["disk_bytes"] = {
                    "inductor_dir": _disk_bytes(self.prep_inductor_dir(prep)),
                    "npu_cache": _disk_bytes(paths["npu_cache"]) if "npu_cache" in paths else None,
                    "mega_blob": _disk_bytes(paths["mega"]) if action == "precompile" else None,
                }
                with open(self.row_path(prep, "prep"), "w") as f:
                    json.dump(res, f)

    def measure(self, modes: list[str]) -> None:
        warm = [m for m in modes if m not in PREPS]
        for rep in range(self.args.repeats):
            for mode in warm:
                action, compiler, prep = MODES[mode]
                if prep is not None and "error" in self._prep_row(prep):
                    continue
                paths = self.paths(prep)
                fresh = os.path.join(self.dir, f"r{rep}_{mode}_ind")
                same_dir = mode in ("inductor_warm", "caching_precompile_warm")
                ind = self.prep_inductor_dir(prep) if same_dir else fresh
                self.run_row(mode, rep, action, compiler, paths, ind)
        for mode in (m for m in warm if m.startswith("bypass")):
            action, compiler, prep = MODES[mode]
            if "error" not in self._prep_row(prep):
                ind = os.path.join(self.dir, f"profile_{mode}_ind")
                self.run_row(mode, "profile", action, compiler, self.paths(prep), ind, {"TCB_PROFILE": "1"})

    def _prep_row(self, prep: str) -> dict:
        path = self.row_path(prep, "prep")
        if not os.path.exists(path):
            return {"error": "not prepared"}
        with open(path) as f:
            return json.load(f)


# --------------------------------------------------------------------------- aggregation


def _stats(values: list[float]) -> dict | None:
    import statistics

    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def aggregate(rows: list[dict], sizes: list[str], dtypes: list[str], modes: list[str]) -> list[dict]:
    """One summary per (size, dtype, mode): medians and spread over the fresh processes."""
    out = []
    for size in sizes:
        for dtype in dtypes:
            cfg_rows = [r for r in rows if r["size"] == size and r["dtype"] == dtype]
            eager_ok = [r for r in cfg_rows if r["mode"] == "eager" and "error" not in r]
            eager_tokens = eager_ok[0]["tokens"] if eager_ok else None
            eager_rss = _stats([r["peak_rss_mb"] for r in eager_ok])
            for mode in modes:
                runs = [r for r in cfg_rows if r["mode"] == mode and r["rep"] != "profile"]
                if not runs:
                    continue
                ok = [r for r in runs if "error" not in r]
                prof = next((r for r in cfg_rows if r["mode"] == mode and r["rep"] == "profile"), None)
                prep = MODES[mode][2] if mode in MODES else None
                prep_row = next((r for r in cfg_rows if r["mode"] == prep and r["rep"] == "prep"), None)
                disk_src = runs[0] if mode in PREPS else prep_row
                s = {
                    "size": size, "dtype": dtype, "mode": mode,
                    "params": ok[0]["params"] if ok else None,
                    "runs": len(runs), "crashes": len(runs) - len(ok),
                    "errors": sorted({r["error"] + (f" (at {r['error_at']})" if r.get("error_at") else "")
                                      for r in runs if "error" in r}),
                    "first_call_s": _stats([r["first_call_s"] for r in ok]),
                    "first_decode_s": _stats([r["first_decode_s"] for r in ok]),
                    "first_generation_s": _stats([r["first_generation_s"] for r in ok]),
                    "ttft_from_process_start_s": _stats([r["ttft_from_process_start_s"] for r in ok]),
                    "prefill_ms": _stats([r["prefill_ms"] for r in ok]),
                    "per_token_ms": _stats([r["per_token_ms"] for r in ok]),
                    "peak_rss_mb": _stats([r["peak_rss_mb"] for r in ok]),
                    "load_s": _stats([r.get("load_s") for r in ok]),
                    "disk_bytes": (disk_src or {}).get("disk_bytes"),
                    "tokens_equal_eager": (all(r["tokens"] == eager_tokens for r in ok) if ok and eager_tokens
                                           else None),
                    "frames_first_generation": sorted({r["frames_first_generation"] for r in ok}),
                    "frames_steady": sorted({r["frames_steady"] for r in ok}),
                    "imported_dynamo": sorted({r["imported_dynamo"] for r in ok}),
                    "replayed": all(r.get("replayed") for r in ok) if ok and mode.startswith("bypass") else None,
                    "profile": (prof or {}).get("profile"),
                    "loadavg": [r["loadavg"][0] for r in runs],
                }
                # per repetition against the eager process of the same repetition (adjacent in time, so a
                # neighbour's load hits both alike), then the median: steadier than a ratio of medians
                eager_by_rep = {r["rep"]: r["first_call_s"] for r in eager_ok}
                paired = [r["first_call_s"] / eager_by_rep[r["rep"]] for r in ok if r["rep"] in eager_by_rep]
                s["first_call_over_eager_paired"] = _stats(paired)
                # the start-up cost against this process's own steady prefill (seconds apart, same process):
                # what compiling / loading added to the first call, the figure least moved by a neighbour
                s["startup_s"] = _stats([r["first_call_s"] - r["prefill_ms"] / 1e3 for r in ok if r["prefill_ms"]])
                if s["peak_rss_mb"] and eager_rss:
                    s["rss_over_eager_mb"] = s["peak_rss_mb"]["median"] - eager_rss["median"]
                out.append(s)
    return out


# --------------------------------------------------------------------------- rendering


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if abs(v) >= 100 or digits == 0:
            return f"{v:.0f}".replace("-0", "0") if round(v) == 0 else f"{v:.0f}"
        return f"{v:.{digits}f}".rstrip("0").rstrip(".") if v else "0"
    return str(v)


def _cell(st: dict | None, scale: float = 1.0, digits: int = 3) -> str:
    if not st:
        return "–"
    if st["n"] == 1:
        return _fmt(st["median"] * scale, digits)
    return f"{_fmt(st['median'] * scale, digits)} ({_fmt(st['min'] * scale, digits)}–{_fmt(st['max'] * scale, digits)})"


def _mb(n: int | None) -> str:
    return "–" if n is None else f"{n / 2**20:.1f}"


def render_markdown(doc: dict) -> str:
    c, m = doc["config"], doc["machine"]
    lines = [
        "# At real scale: random-init transformers Llama, 128-token prefill + greedy decode (StaticCache)",
        "",
        f"torch {doc['torch']}, transformers {doc['transformers']}, {m['cpu']} ({m['cores']} cores), "
        f"created {doc['created']}; child env {c['child_env']}; prompt {c['prompt']} tokens, {c['steps']} decode "
        f"steps, {c['rounds']} steady generations; `dynamic=False`; torch.no_grad().",
        "",
        f"**Measured under load**: {doc['load_note']}" if doc.get("load_note") else "",
        "",
        "Each cell: median over fresh processes (min–max); n = processes. First call = model built -> the "
        "prefill's output (compile or load + the 128-token prefill: a fresh server's time to first token); "
        "the cold rows are one process each (they fill the caches the warm rows read). × eager = ratio of the "
        "medians; × eager, paired = the median over repetitions of first call / the same repetition's eager "
        "first call; start-up = first call minus the same process's steady prefill (seconds apart: what "
        "compiling or loading added, the figure a loaded machine moves least). "
        "First decode = the first "
        "one-token call (loads / compiles the decode graph). Per token / prefill = steady state. RSS = the "
        "child's peak ru_maxrss; Δ eager = its median minus eager's.",
        "",
    ]
    for size in c["sizes"]:
        for dtype in c["dtypes"]:
            rows = [r for r in doc["summary"] if r["size"] == size and r["dtype"] == dtype]
            if not rows:
                continue
            eager = next((r for r in rows if r["mode"] == "eager"), None)
            params = next((r["params"] for r in rows if r["params"]), None)
            sz = SIZES[size]
            lines += [
                f"## {size} {dtype}: {params / 1e6:.0f}M parameters ({sz['layers']} layers, d={sz['hidden']}, "
                f"vocab {sz['vocab']})" if params else f"## {size} {dtype}",
                "",
                "| mode | n | first call s | × eager | × eager, paired | start-up s | first decode s | per token ms | prefill ms | peak RSS MB | "
                "Δ eager MB | cache on disk MB | tokens = eager | Dynamo frames | crashes |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            e_first = eager["first_call_s"]["median"] if eager and eager["first_call_s"] else None
            for r in rows:
                f = r["first_call_s"]
                ratio = f["median"] / e_first if f and e_first else None
                d = r.get("disk_bytes") or {}
                disk = d.get("npu_cache") if d.get("npu_cache") is not None else (
                    d.get("mega_blob") if d.get("mega_blob") is not None else d.get("inductor_dir"))
                crash = f"{r['crashes']}/{r['runs']}" if r["crashes"] else "0"
                lines.append(
                    f"| {r['mode']} | {r['runs'] - r['crashes']} | {_cell(f)} | {_fmt(ratio, 2)} | "
                    f"{_cell(r.get('first_call_over_eager_paired'), 1, 2)} | {_cell(r.get('startup_s'))} | "
                    f"{_cell(r['first_decode_s'])} | {_cell(r['per_token_ms'], 1, 1)} | {_cell(r['prefill_ms'], 1, 0)} | "
                    f"{_cell(r['peak_rss_mb'], 1, 0)} | {_fmt(r.get('rss_over_eager_mb'), 0)} | "
                    f"{'–' if r['mode'] == 'eager' else _mb(disk)} | {_fmt(r['tokens_equal_eager'])} | "
                    f"{','.join(map(str, r['frames_first_generation'])) or '–'} | {crash} |"
                )
            lines.append("")
    lines += ["## The warm path does not scale with the parameters", "",
              "Seconds inside `tcb.load(model, dir)` (median, min–max) and the `TCB_PROFILE=1` breakdown of one "
              "extra process, per size: what a load reads, verifies, decodes and checks is the program and the "
              "compiled code, never the weights.", "",
              "| size | dtype | mode | params | tcb.load s | first call s | load profile (one process) |",
              "|---|---|---|---|---|---|---|"]
    for r in doc["summary"]:
        if r["mode"].startswith("bypass"):
            prof = "<br>".join(p.replace("|", "/") for p in (r.get("profile") or [])) or "–"
            lines.append(
                f"| {r['size']} | {r['dtype']} | {r['mode']} | {_fmt((r['params'] or 0) / 1e6, 0)}M | "
                f"{_cell(r['load_s'], 1, 4)} | {_cell(r['first_call_s'])} | {prof} |"
            )
    byp = [r for r in doc["summary"] if r["mode"].startswith("bypass") and r["load_s"] and r["params"]]
    pairs = []
    for r in byp:
        for big in byp:
            if (big["mode"], big["dtype"]) == (r["mode"], r["dtype"]) and big["params"] > r["params"]:
                pairs.append((r, big))
    if pairs:
        lines += ["", "| mode | dtype | sizes | parameters × | `tcb.load` × (medians) | eager first call × |",
                  "|---|---|---|---|---|---|"]
        for small, big in pairs:
            def eager_first(r: dict) -> float | None:
                e = next((x for x in doc["summary"] if (x["size"], x["dtype"], x["mode"]) ==
                          (r["size"], r["dtype"], "eager")), None)
                return e["first_call_s"]["median"] if e and e["first_call_s"] else None

            ef = (eager_first(big) / eager_first(small)) if eager_first(big) and eager_first(small) else None
            lines.append(
                f"| {small['mode']} | {small['dtype']} | {big['size']} / {small['size']} | "
                f"{big['params'] / small['params']:.1f} | {big['load_s']['median'] / small['load_s']['median']:.2f} | "
                f"{_fmt(ef, 2)} |"
            )
    errs = [(r["size"], r["dtype"], r["mode"], e) for r in doc["summary"] for e in r["errors"]]
    if errs:
        lines += ["", "## Crashes and errors", ""] + [f"- {s} {d} / {mo}: `{e}`" for s, d, mo, e in errs]
    return "\n".join(lines) + "\n"


def render_png(doc: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e .[bench]): no PNG written"
    summary = doc["summary"]
    configs = list(dict.fromkeys((r["size"], r["dtype"]) for r in summary))
    modes = list(dict.fromkeys(r["mode"] for r in summary))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(modes)), 5))
    width = 0.8 / max(1, len(configs))
    crashed: set[float] = set()
    for i, (size, dtype) in enumerate(configs):
        vals, lo, hi = [], [], []
        for mode in modes:
            r = next((r for r in summary if (r["size"], r["dtype"], r["mode"]) == (size, dtype, mode)), None)
            st = r["first_call_s"] if r else None
            v = st["median"] if st else 0
            vals.append(v)
            lo.append(v - st["min"] if st else 0)
            hi.append(st["max"] - v if st else 0)
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(modes))]
        ax.bar(xs, vals, width, yerr=[lo, hi], capsize=2, label=f"{size} {dtype}")
        crashed.update({x for x, mode in zip(xs, modes, strict=True) if any(
            (r["size"], r["dtype"], r["mode"]) == (size, dtype, mode) and r["runs"] and r["crashes"] == r["runs"]
            for r in summary)})
    ax.set_yscale("log")
    for x in crashed:
        ax.text(x, ax.get_ylim()[0] * 1.15, "crashes", rotation=90, ha="center", va="bottom", fontsize=7, color="red")
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels(modes, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("first call (prefill), s — median, min–max; log")
    ax.set_title(f"Llama warm start in a fresh process (torch {doc['torch']}){' — under load' if doc.get('load_note') else ''}")
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(doc: dict, out: str) -> None:
    harness.write_outputs(doc, out, render_markdown, render_png)


def _collect(work: str, sizes: list[str], dtypes: list[str], modes: list[str]) -> list[dict]:
    rows = []
    rdir = os.path.join(work, "rows")
    for name in sorted(os.listdir(rdir)) if os.path.isdir(rdir) else []:
        if name.endswith(".json"):
            with open(os.path.join(rdir, name)) as f:
                r = json.load(f)
            if r["size"] in sizes and r["dtype"] in dtypes and r["mode"] in set(modes) | set(PREPS):
                rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    import datetime

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="150m,850m", help="comma-separated: " + ", ".join(SIZES))
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    p.add_argument("--repeats", type=int, default=5, help="fresh processes per warm mode and configuration")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="steady-state generations after the first")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny size, fp32, 1 repeat, 4 steps")
    p.add_argument("--force", action="store_true", help="redo rows and preparations already done")
    p.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "tcb_scale"),
                   help="caches and per-row JSON (kept: a rerun resumes)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "scale.json"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child")
    p.add_argument("--load-note", default=None, help="how loaded the machine was (printed in the results)")
    p.add_argument("--render", metavar="JSON", help="only re-render .md/.png from an existing JSON")
    p.add_argument("--no-run", action="store_true",
                   help="run no child: write the outputs from the rows already in --workdir (e.g. while a run goes on)")
    a = p.parse_args(argv)
    if a.render:
        with open(a.render) as f:
            write_outputs(json.load(f), a.render)
        return 0
    if a.quick:
        a.sizes, a.dtypes, a.repeats, a.steps, a.rounds = "tiny", "fp32", 1, 4, 1
        if a.out == p.get_default("out"):
            a.out = os.path.join(a.workdir, "scale_quick.json")
    sizes = [s for s in a.sizes.split(",") if s]
    dtypes = [d for d in a.dtypes.split(",") if d]
    modes = [m for m in a.modes.split(",") if m]
    bad = sorted(set(sizes) - set(SIZES)) + sorted(set(dtypes) - set(DTYPES)) + sorted(set(modes) - set(MODES))
    if bad:
        p.error(f"unknown {bad}; sizes: {list(SIZES)}, dtypes: {list(DTYPES)}, modes: {list(MODES)}")
    if "eager" not in modes:
        modes.insert(0, "eager")  # every ratio is relative to it
    import torch
    import transformers

    sys.path.insert(0, HERE)
    from warm_start import machine_info

    machine = machine_info()
    t0 = time.perf_counter()
    work = os.path.abspath(a.workdir)
    print(f"work dir {work}", flush=True)
    for dtype in [] if a.no_run else dtypes:  # fp32 at both sizes first: the scaling claim needs the pair
        for size in sizes:
            run = Run(work, size, dtype, a, lambda s: print(s, flush=True))
            run.prepare(modes)
            run.measure(modes)
    machine["loadavg_end"] = list(os.getloadavg())
    rows = _collect(work, sizes, dtypes, modes)
    summary = aggregate(rows, sizes, dtypes, list(ORDER))
    doc = {
        "machine": machine,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_note": a.load_note,
        "config": {"sizes": sizes, "dtypes": dtypes, "modes": modes, "repeats": a.repeats, "prompt": a.prompt,
                   "steps": a.steps, "rounds": a.rounds, "child_env": CHILD_ENV,
                   "suite_seconds": round(time.perf_counter() - t0, 1)},
        "summary": summary,
        "rows": rows,
    }
    write_outputs(doc, a.out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "--child":
        comp = None if sys.argv[3] == "-" else sys.argv[3]
        print(RESULT_TAG + json.dumps(_child(sys.argv[2], comp, json.loads(sys.argv[4]))), flush=True)
    else:
        sys.exit(main())
