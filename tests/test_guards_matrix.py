"""Invalidation matrix (issue 8): a warm start is never served by a stale program.

Every case caches a program in a cold fresh process, then a warm fresh process changes ONE
thing and calls it. The warm output must equal the eager output of the CHANGED program
(computed in the warm process on the same inputs) or be a clear error (an exception of this
package whose message names the problem) — never the cached program's stale answer. Each case
also runs unchanged in a third fresh process, which must replay it (no frame compiled) with
the output of eager; and the light cases of that process must not import ``torch._dynamo``.

Compilers: ``eager`` and ``inductor``. Routes: ``cache_compile`` (``tcb.cache_compile(m.inner,
cache_dir=..., compiler=..., dynamic=...)`` cold and warm) for every case, and ``load``
(``torch.compile(m, backend="npu_cached", options={...})`` cold, ``tcb.load(m, cache_dir,
compiler=...)`` warm) for the subset ``guard_cases.LOAD_ROUTE`` (``INDUCTOR_LOAD_ROUTE`` with
Inductor, where every warm change is a real compile), and ``backend`` (the same ``torch.compile`` cold
and warm: a warm frame whose program is cached is installed into Dynamo's frame cache with our checks
as its guard, ``bypass/frame_install.py``) for ``LOAD_ROUTE`` with the ``eager`` inner compiler only
(the checks are what differ from ``load``; the graphs are the same). On the ``backend`` route the
unchanged process replays with no Dynamo frame traced, but imports Dynamo (``torch.compile`` does).
All cases of one (compiler, route) share
one cold, one unchanged and one warm process (tests/guard_child.py); each case has its own
classes and cache dir. The Inductor cold processes share one ``TORCHINDUCTOR_CACHE_DIR``; every
warm process gets an empty one. A process that dies inside a case reports that case as a crash
and a fresh process runs the remaining ones.

| case | what changes between the cold and the warm process |
|---|---|
| attr_float | float attribute `self.scale` 2.0 -> 3.0 |
| attr_int | int attribute `self.reps` 2 -> 3 (the output width) |
| attr_bool | bool attribute `self.residual` True -> False |
| attr_str | str attribute choosing a branch `self.act` 'relu' -> 'sigmoid' |
| attr_none | optional attribute `self.offset` None -> 0.5 |
| attr_tuple | tuple attribute `self.coefs` (2.0, 1.0) -> (3.0, -1.0) |
| attr_enum | enum attribute `self.mode` Mode.SIN -> Mode.COS |
| sub_attr | attribute of a submodule `self.sub.k` 2 -> 5 |
| cfg_attr | field of a config object held by the module `self.cfg.use_bias` True -> False |
| hf_config | field of a transformers `PretrainedConfig` `config.hidden_act` 'silu' -> 'gelu' |
| global_same | global of the forward's own module (set from an environment variable at import) 1.0 -> 4.0 |
| global_other | global of another module `guard_flags.USE_FAST_PATH` (environment variable at import) False -> True |
| closure_cell | closure cell of a helper the forward calls: `make_scaler(2.0)` -> `make_scaler(3.0)` |
| train_before | `model.train()` before the warm start, `if self.training:` in forward |
| train_after | `model.train()` after the warm start served its first call (same process) |
| grad_mode | a call with grad enabled after a no_grad warm call (inputs not requiring grad) |
| autocast | warm call under `torch.autocast("cpu", dtype=torch.bfloat16)`, captured without |
| default_dtype | `torch.set_default_dtype(torch.float64)` around the warm call; forward calls `torch.ones` |
| modulelist_len | `nn.ModuleList` of 2 -> 3 parameter-free layers (same parameters) |
| moduledict_keys | `nn.ModuleDict` keys ['a', 'bb'] -> ['a', 'cccc'] (same parameters) |
| kwarg_alpha | non-tensor argument `fn(x, alpha=3.0)` after caching `alpha=1.0` |
| kwarg_alpha_second | `alpha=3.0` as the second call of a warm process that served `alpha=1.0` first |
| use_cache | `use_cache=True` cached, `use_cache=False` warm (output structure changes) |
| output_attentions_none | `output_attentions=True` cached, `output_attentions=None` warm (default False) |
| hook_before | forward hook on a submodule registered before the warm start |
| hook_after | forward hook on a submodule registered after the first warm call (same process; `guards="call"`, since the default `"load"` checks hooks when the warm start loads) |
| hook_top | forward hook on the loaded module itself, before the warm start (`load` and `backend` routes only) |
| decode_branch | dynamic=True, `if h.size(1) == 1: return h * 0.5` decode path: cached on seq 16, warm seq 1 |
| shape_gt4 | dynamic=True, branch on `x.shape[1] > 4`: cached at 8, warm at 3 |
| equal_dims | dynamic=True, two inputs with equal dims at capture (5, 5), warm (5, 2): Inductor must not crash |
| transposed | dynamic=True, a transposed (non-contiguous) input of the cached shape |
| transposed_static | dynamic=False, a transposed (non-contiguous) input of the cached shape |
| cond_branches | two functions whose `torch.cond` branches compute sin vs exp()*100, cached in one dir |
| option_dropped | cached with `custom_decompositions` (sin -> cos), warm start without the option |
| option_kept | cached with `custom_decompositions` (sin -> cos), warm start with it (must still be applied) |
| option_added | cached without options, warm start with `custom_decompositions` (sin -> cos) |
| default_arg | edited default argument of a helper, `factor=2.0` -> `3.0` in the source file |
| nested_list | tensors in a list argument with new shapes |
| nested_dict | tensors in a dict argument with new shapes |
| dataclass_arg | a dataclass argument holding tensors, with new shapes |
| two_instances | two instances of one class (ReLU head vs Tanh head, same parameters) cached in one dir |
| param_double | parameter dtype float32 -> float64 via `.double()` |
| buffer_added | a buffer added (the forward adds every buffer) |
| buffer_renamed | a buffer renamed (the forward weighs buffers by their name) |
| method_patched | a method monkeypatched onto the class at run time in the cold process only (`PatchNet.act = patched_act`) |
| base_switched | the base class switched (`SwitchNet.__bases__` ActBaseA -> ActBaseB, each with its own `act`) |
| subclass_override | an override of `act` added in the subclass (source file edited; the base's `act` unchanged) |
| allow_in_graph_edit | the body of a `torch._dynamo.allow_in_graph` helper edited (the graph names it only) |
| custom_op_edit | the Python `CompositeImplicitAutograd` kernel of a `torch.library` op edited (the graph names the op only) |
| dataclass_default | an edited `@dataclass` field default (its `__init__` is generated code in `<string>`) |
| fx_submodule | a torch.fx GraphModule submodule re-traced from other code (`<eval_with_key>` forward) |
| env_read | an environment variable read in forward (`os.environ.get`): unset cold, set warm |
| dist_initialized | `dist.is_initialized()` in forward: cached in a plain process, served inside a (fake) process group |
| dist_rank | `dist.get_rank()` in forward: cached by rank 1, served to rank 0 from the same cache dir |
| hash_str | `hash(str)` in forward (randomized per process: never replayed, a counted fallback) |
| numpy_attr | a numpy float attribute `self.scale = 1 / np.sqrt(d)`, d 4 -> 16 (must replay) |
| numpy_arg | a numpy array argument: new values, then a new shape (must replay the cached shape) |
| default_device | `torch.set_default_device("cpu")` in the cold script only (the unchanged start must replay) |
| kv_cache_load | a self-growing cache attribute (`self.cache = torch.cat(...)` in forward), 3 decode steps per process |
| kv_cache_call | the same with `guards="call"` (every variant checked per call, none rejected at load) |

Cases marked pure guard checks (``Case.compilers``) run with the `eager` inner compiler only: the
check is the same with Inductor; the cases where the compiled artifact itself differs
(`allow_in_graph_edit`, `custom_op_edit`, `kv_cache_load`) run with both, on both routes. Warm
`torch.compile` (graph-level hits) after such edits, and two ranks sharing one cache dir, are in
tests/test_stale_round3.py.

Not covered: a parameter's device (only the CPU exists here). `cond_branches` with the `eager`
compiler is compiled even unchanged: that compiler does not cache graphs holding torch.cond
branch GraphModules (`guard_cases.Case.uncached_with`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from guard_cases import CASES, cases_for, phase_env
from subprocess_helpers import REPO

CHILD = os.path.join(REPO, "tests", "guard_child.py")
COMPILERS = ("eager", "inductor")
ROUTES = ("cache_compile", "load", "backend")
COMBOS = [(c, r) for c in COMPILERS for r in ROUTES if cases_for(r, c)]

pytestmark = pytest.mark.slow


def run_phase(phase: str, compiler: str, route: str, root: str, names: list[str], inductor_dir: str) -> dict[str, Any]:
    """Run ``names`` in fresh processes of one phase: normally one; if a process dies inside a
    case, that case is reported as a process crash and a new process runs the rest."""
    env = dict(os.environ)
    env.update(phase_env(phase))
    env.update(
        PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        PYTHONDONTWRITEBYTECODE="1",  # the edited-source case rewrites a module between processes
        TORCHINDUCTOR_CACHE_DIR=inductor_dir,
        TORCHINDUCTOR_COMPILE_THREADS="1",  # no compile-worker pool for a few tiny kernels
    )
    env.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    results: dict[str, Any] = {}
    remaining = list(names)
    for attempt in range(4):
        if not remaining:
            break
        out = os.path.join(root, f"{phase}-{attempt}.jsonl")
        config = os.path.join(root, f"{phase}-{attempt}.json")
        with open(config, "w") as f:
            json.dump({"phase": phase, "compiler": compiler, "route": route, "root": root, "cases": remaining, "out": out}, f)
        proc = subprocess.run([sys.executable, CHILD, config], env=env, capture_output=True, text=True, timeout=1500)
        started: list[str] = []
        if os.path.exists(out):
            for line in open(out):
                item = json.loads(line)
                if "start" in item:
                    started.append(item["start"])
                else:
                    results[item["case"]] = item
        unfinished = [n for n in started if n not in results]
        if unfinished:
            results[unfinished[-1]] = {
                "case": unfinished[-1],
                "process_crash": f"the {phase} process died in this case (rc={proc.returncode}):\n{proc.stderr[-3000:]}",
            }
        elif proc.returncode != 0 or not started:
            raise AssertionError(f"{phase} process failed before any case (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
        remaining = [n for n in remaining if n not in results]
    for name in remaining:
        results[name] = {"case": name, "process_crash": f"not run: the {phase} processes kept dying"}
    return results


@pytest.fixture(scope="session")
def matrix(tmp_path_factory: pytest.TempPathFactory):
    """(compiler, route) -> results of its cold, warm and unchanged processes (run once, on first use)."""
    done: dict[tuple[str, str], dict[str, Any]] = {}
    shared_inductor = str(tmp_path_factory.mktemp("guards_inductor_cold"))

    def get(compiler: str, route: str) -> dict[str, Any]:
        if (compiler, route) not in done:
            root = str(tmp_path_factory.mktemp(f"guards_{compiler}_{route}"))
            names = cases_for(route, compiler)
            # unchanged process: cases whose eager program imports Dynamo itself (torch.cond) last
            light_first = sorted(names, key=lambda n: CASES[n].eager_imports_dynamo)
            seconds, res = {}, {}
            # unchanged before changed: a changed warm start rebuilds the cache for the changed program
            for phase, order, inductor in (
                ("cold", names, shared_inductor),
                ("same", light_first, str(tmp_path_factory.mktemp("guards_inductor_same"))),
                ("warm", names, str(tmp_path_factory.mktemp("guards_inductor_warm"))),
            ):
                t0 = time.perf_counter()
                res[phase] = run_phase(phase, compiler, route, root, order, inductor)
                seconds[phase] = round(time.perf_counter() - t0, 1)
            res["order_same"] = light_first
            res["seconds"] = seconds
            with open(os.path.join(root, "results.json"), "w") as f:  # for a look after a failure
                json.dump(res, f, indent=1, default=str)
            print(f"\nguard matrix {compiler}/{route}: process seconds {seconds}")
            done[(compiler, route)] = res
        return done[(compiler, route)]

    return get


def params() -> list[Any]:
    return [pytest.param(c, r, n, id=f"{c}-{r}-{n}") for c, r in COMBOS for n in cases_for(r, c)]


def describe(step: dict[str, Any]) -> str:
    outcome = step["outcome"]
    head = f"call {step['label']!r} ({step['ctx']})"
    if outcome == "stale":
        same_as_cold = " = the cold program's eager answer on these inputs" if step["equals_cold_program"] else ""
        return (f"{head}: STALE: got {step['got']} (the cached program's answer{same_as_cold}), eager of the changed "
                f"program says {step['eager']} [{step['diff']}]")
    if outcome in ("crash", "unclear_error"):
        err = step["error"]
        why = "not an error of this package" if outcome == "crash" else "its message does not name the change"
        return f"{head}: {outcome.upper()} ({why}): {err['type']}: {err['message']}\n{err['where']}"
    if outcome == "eager_failed":
        return f"{head}: the eager reference itself failed (a broken case): {step['error']['message']}"
    return f"{head}: {outcome}"


def check_process(result: dict[str, Any]) -> None:
    assert "process_crash" not in result, result["process_crash"]
    assert "case_error" not in result, result["case_error"]


def test_matrix_is_documented_and_large_enough() -> None:
    doc = __doc__ or ""
    assert len(CASES) >= 20
    missing = [n for n in CASES if f"| {n} |" not in doc]
    assert not missing, f"cases missing from the module docstring table: {missing}"
    for compiler in COMPILERS:
        assert len(cases_for("load", compiler)) >= 8
        assert {"option_dropped", "cond_branches"} <= set(cases_for("load", compiler))


@pytest.mark.parametrize("compiler,route,name", params())
def test_change_is_never_replayed_stale(matrix, compiler: str, route: str, name: str) -> None:
    res = matrix(compiler, route)
    case = CASES[name]
    cold, warm = res["cold"][name], res["warm"][name]
    title = f"{name} ({case.changes}) [{compiler}, {route}]"
    check_process(cold)
    bad_cold = [describe(s) for s in cold["steps"] if s["outcome"] not in ("correct", "done")]
    assert not bad_cold, f"{title}: the COLD process is already wrong:\n" + "\n".join(bad_cold)
    check_process(warm)
    bad = [describe(s) for s in warm["steps"] if s["outcome"] not in ("correct", "error", "done")]
    assert not bad, f"{title}: warm process:\n" + "\n".join(bad)


@pytest.mark.parametrize("compiler,route,name", params())
def test_unchanged_is_replayed(matrix, compiler: str, route: str, name: str) -> None:
    res = matrix(compiler, route)
    same = res["same"][name]
    title = f"{name} unchanged [{compiler}, {route}]"
    check_process(same)
    bad = [describe(s) for s in same["steps"] if s["outcome"] not in ("correct", "done")]
    assert not bad, f"{title}:\n" + "\n".join(bad)
    if compiler in CASES[name].uncached_with:  # nothing was cached to replay: the output check is all there is
        return
    compiled = same["after"]["frames"] - same["before"]["frames"]
    assert compiled == 0, f"{title}: Dynamo compiled {compiled} frame(s): the unchanged program was not replayed"
    loads = same["after"]["bypass_loads"] - same["before"]["bypass_loads"]
    assert loads >= same["subjects"], f"{title}: {loads} bypass load(s) for {same['subjects']} function(s)"


LIGHT_COMBOS = [(c, r) for c, r in COMBOS if r != "backend"]  # torch.compile imports Dynamo by itself


@pytest.mark.parametrize("compiler,route", LIGHT_COMBOS, ids=[f"{c}-{r}" for c, r in LIGHT_COMBOS])
def test_unchanged_process_never_imports_dynamo(matrix, compiler: str, route: str) -> None:
    """The unchanged warm process replays every light case without importing Dynamo or Inductor,
    and writes nothing into its (empty) Inductor cache dir."""
    res = matrix(compiler, route)
    light = [n for n in res["order_same"] if not CASES[n].eager_imports_dynamo]
    for name in light:
        check_process(res["same"][name])
    first_import = {
        mod: next((n for n in light if res["same"][n]["after"][mod]), None) for mod in ("dynamo", "inductor")
    }
    assert first_import["dynamo"] is None, f"torch._dynamo was first imported by case {first_import['dynamo']}"
    assert first_import["inductor"] is None, f"torch._inductor was first imported by case {first_import['inductor']}"
    last = res["same"][light[-1]]["after"]
    assert last["inductor_files"] == 0, "the unchanged warm process wrote into its empty Inductor cache dir"
    assert last["bypass_loads"] >= len(light)
