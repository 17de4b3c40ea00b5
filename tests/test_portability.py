"""Caches hit across machines of one kind (issue 16): only what changes the generated code is keyed.

A cache is filled cold by one process; warm processes change ONE thing that does not
change the compiled code (thread count, compile workers, where the cache lives) and
must hit on both routes (``torch.compile`` with the backend, and the bypass ``load``)
with outputs equal to eager. The thread count left the key, so an artifact built for
2 threads runs under 8 and vice versa: a loaded graph is pinned to its build count.
A variable that changes codegen still misses.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from subprocess_helpers import run_python

from torchair_cached_backend.compilers import inductor_env

pytestmark = pytest.mark.slow

_CHILD = r"""
import os, sys, torch
import torchair_cached_backend as tcb
from child_helpers import same, stats, frames
from fleet_models import build_reducer

if os.environ.get("THREADS"):  # OMP_NUM_THREADS above the core count is capped by torch
    torch.set_num_threads(int(os.environ["THREADS"]))
model, x = build_reducer()
cache = os.environ["CACHE"]
opts = {"cache_dir": cache, "compiler": "inductor"}
with torch.no_grad():
    ref = model(x)
    out = {"threads": torch.get_num_threads()}
    if os.environ["PHASE"] == "cold":
        compiled = torch.compile(model, backend="npu_cached", options=opts)
        out["ok"] = all(same(compiled(x), ref) for _ in range(3))
    else:
        fast = tcb.load(model, cache, compiler="inductor")
        out["bypass_ok"] = all(same(fast(x), ref) for _ in range(10))
        out["bypass"] = stats()
        out["bypass_frames"] = frames()
        tcb.reset_stats()
        compiled = torch.compile(model, backend="npu_cached", options=opts)
        out["backend_ok"] = all(same(compiled(x), ref) for _ in range(10))
        out["threads_after"] = torch.get_num_threads()
    out["stats"] = stats()
emit(out)
"""


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Two cold caches: built with 2 threads (= the CPU count here: a plain ``omp parallel``,
    the team as large as the running process's thread count) and with 8 threads."""
    root = tmp_path_factory.mktemp("portability")
    built = {}
    for threads in ("2", "8"):
        cache = str(root / f"cache{threads}")
        rep = run_python(_CHILD, env={"CACHE": cache, "PHASE": "cold", "THREADS": threads,
                                      "TORCHINDUCTOR_CACHE_DIR": str(root / f"ind{threads}")})
        assert rep["ok"] and rep["stats"]["misses"] >= 1 and rep["threads"] == int(threads), rep
        built[threads] = cache
    built["root"] = str(root)
    return built


def _warm(cache: str, root: str, tag: str, **env: str) -> dict:
    # an empty Inductor dir: nothing can come from Inductor's own caches
    ind = os.path.join(root, f"ind-warm-{tag}")
    return run_python(_CHILD, env={"CACHE": cache, "PHASE": "warm", "TORCHINDUCTOR_CACHE_DIR": ind, **env})


def _hits_both_routes(rep: dict) -> None:
    assert rep["bypass_ok"] and rep["backend_ok"], rep
    assert rep["bypass"]["bypass_loads"] == 1 and rep["bypass"]["misses"] == 0 and rep["bypass_frames"] == 0, rep
    assert rep["bypass"]["fallbacks"] == 0, rep
    assert rep["stats"]["hits"] >= 1 and rep["stats"]["misses"] == 0, rep


@pytest.mark.parametrize(
    ("built", "env"),
    [
        ("2", {"THREADS": "8"}),   # a 2-thread artifact under 8 threads
        ("8", {"THREADS": "2"}),   # and an 8-thread one under 2
        ("2", {"OMP_NUM_THREADS": "1"}),
        ("2", {"OMP_NUM_THREADS": "2", "TORCHINDUCTOR_COMPILE_THREADS": "1"}),
    ],
    ids=["2-under-8", "8-under-2", "2-under-1", "compile-threads-1"],
)
def test_one_non_codegen_change_hits_on_both_routes(caches, built, env):
    rep = _warm(caches[built], caches["root"], "-".join(f"{k}{v}" for k, v in env.items()), **env)
    _hits_both_routes(rep)
    wanted = int(env.get("THREADS") or env["OMP_NUM_THREADS"])
    assert rep["threads"] == wanted == rep["threads_after"]  # the pin is undone after each call


def test_a_moved_cache_dir_hits_on_both_routes(caches, tmp_path):
    moved = str(tmp_path / "elsewhere" / "cache")
    shutil.copytree(caches["2"], moved, symlinks=True)
    os.chmod(os.path.dirname(moved), 0o700)
    rep = _warm(moved, caches["root"], "moved", OMP_NUM_THREADS="2")
    _hits_both_routes(rep)


_FACTORS = r"""
import json, os
from torchair_cached_backend.key import context_factors
from torchair_cached_backend.compilers import get_compiler
from torchair_cached_backend.options import parse_options
from torchair_cached_backend.store import Store
store = Store(os.environ["CACHE"], "graphs")
stored = [store.read_manifest(k)["factors"] for k in store.keys()]
here = context_factors(get_compiler("inductor"), parse_options({"compiler": "inductor"}))
emit({"same": [all(f.get(k) == v for k, v in here.items()) for f in stored]})
"""


@pytest.mark.parametrize("env", [{"TORCHINDUCTOR_CPP_MIN_CHUNK_SIZE": "64"}, {"TORCHINDUCTOR_VEC_ISA_OK": "0"}],
                         ids=["cpp-chunk", "vec-isa-off"])
def test_a_codegen_variable_still_misses(caches, env):
    """The stored graphs' context factors no longer match this process: the backend and the
    bypass loader (which re-checks each graph's context factors) compile instead."""
    same = run_python(_FACTORS, env={"CACHE": caches["2"], "OMP_NUM_THREADS": "2"})["same"]
    assert same and all(same)  # control: the unchanged process matches
    changed = run_python(_FACTORS, env={"CACHE": caches["2"], "OMP_NUM_THREADS": "2", **env})["same"]
    assert changed and not any(changed)


def test_the_variables_every_warm_start_sets_are_classified_without_parsing(monkeypatch):
    """TORCHINDUCTOR_VEC_ISA_OK (set by benchmarks, launch scripts and every test child) and
    the cache dir are decided by table, as the parse of Inductor's config decides them: a warm
    start with only those set never pays for the parse (~0.1 s)."""
    parsed = {name: inductor_env.affects_codegen(name) for name in inductor_env.CODEGEN_ALWAYS}
    feeds, prefixes, ignored = inductor_env._classification()
    for name in inductor_env.CODEGEN_ALWAYS:  # the table agrees with what the config modules say
        assert parsed[name] and feeds.get(name), name
        assert not all(inductor_env._entry_ignored(e, prefixes, ignored) for e in feeds[name]), name
    monkeypatch.setattr(inductor_env, "_classification", lambda: pytest.fail("parsed Inductor's config"))
    env = {"TORCHINDUCTOR_VEC_ISA_OK": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}
    assert inductor_env.codegen_env(env) == {"TORCHINDUCTOR_VEC_ISA_OK": "1"}


def test_split_is_read_from_inductor_config():
    """Derived from Inductor's config module: compile workers, cache toggles and worker start
    leave the key; codegen options, the ISA probe shortcut and unknown variables stay."""
    for name in ("TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE",
                 "TORCHINDUCTOR_WORKER_START", "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE"):
        assert not inductor_env.affects_codegen(name), name
    for name in ("TORCHINDUCTOR_FREEZING", "TORCHINDUCTOR_CPP_MIN_CHUNK_SIZE", "TORCHINDUCTOR_VEC_ISA_OK",
                 "TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_CPP_MARCH", "TORCHINDUCTOR_NOT_A_REAL_ONE"):
        assert inductor_env.affects_codegen(name), name
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_FREEZING": "1", "OMP_NUM_THREADS": "3"}
    assert inductor_env.codegen_env(env) == {"TORCHINDUCTOR_FREEZING": "1"}
    assert json.dumps(inductor_env.ignored_env(env)) == '{"TORCHINDUCTOR_COMPILE_THREADS": "1"}'


def test_helper_functions_and_classes_map_to_entries():
    src = (
        "import os\n"
        "def pick():\n    return os.environ.get('TORCHINDUCTOR_A')\n"
        "a = pick()\n"
        "class cpp:\n    b = os.environ.get('TORCHINDUCTOR_B')\n"
        "_cache_config_ignore_prefix = ['cpp.b']\n"
    )
    feeds, prefixes, _ = inductor_env.parse_config_source(src)
    assert feeds == {"TORCHINDUCTOR_A": {"a"}, "TORCHINDUCTOR_B": {"cpp.b"}} and prefixes == ["cpp.b"]


def _explain(source: str, **env: str) -> str:
    import subprocess
    import sys

    from subprocess_helpers import REPO

    full = dict(os.environ, PYTHONPATH=REPO, TORCHINDUCTOR_VEC_ISA_OK="1", **env)  # as run_python's children
    out = subprocess.run([sys.executable, "-m", "torchair_cached_backend", "explain", "--here", source],
                         env=full, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_explain_here_names_what_this_machine_differs_in(caches, tmp_path):
    """`torchair-cache explain --here` against a cache dir and a bundle of it: a non-codegen change
    matches, a codegen variable and another version are named."""
    from torchair_cached_backend.bundle import pack

    same = _explain(caches["2"], OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    assert "matches this process" in same and "misses here" not in same, same
    bundle = str(tmp_path / "c.tar.gz")
    pack(caches["2"], bundle)
    differs = _explain(bundle, TORCHINDUCTOR_CPP_MIN_CHUNK_SIZE="64", TCB_CANN_VERSION="8.0.RC1")
    assert "compiler_factors.inductor_env.TORCHINDUCTOR_CPP_MIN_CHUNK_SIZE: None -> '64'" in differs, differs
    assert "environment.cann: None -> '8.0.RC1'" in differs, differs
