"""The warm path imported in the background (issue 18): ``import torchair_cached_backend`` in a
process that imported torch imports exactly the modules a warm load needs on a daemon thread,
never Dynamo or the compile side; a fork waits for it; a failure in it is the caller's import's
to report; the modules it imports have no import cycle (two threads never wait on each other).
Once Dynamo is imported (before the package, or after it: a model's build), the same thread
imports what a warm ``torch.compile(model, backend="npu_cached")`` adds (``preload.ROUTE``)."""

from __future__ import annotations

import ast
import os
import textwrap
import threading

import pytest
from subprocess_helpers import run_python
from test_warm_path import COLD_SIDE_MODULES, NOT_ON_THE_WARM_PATH, PACKAGE_IMPORT_MODULES, WARM_PATH_MODULES

from torchair_cached_backend import preload

PACKAGE_DIR = os.path.dirname(preload.__file__)

OURS = """
import sys
def ours():
    return sorted(m for m in sys.modules if m.startswith("torchair_cached_backend"))
"""


#: what the thread imports without Dynamo: the warm path, then cache_compile's modules, then the
#: operators' first use (``op_warmup``)
PRELOADED = WARM_PATH_MODULES | set(preload.DROP_IN) | {preload.OP_WARMUP}


def test_the_background_import_is_the_warm_path_a_load_imports():
    # test_warm_path checks WARM_PATH_MODULES against what a warm load imports with the preload off
    assert set(preload.WARM_PATH) | set(PACKAGE_IMPORT_MODULES) == WARM_PATH_MODULES


def test_the_drop_in_set_is_what_a_warm_cache_compile_imports(tmp_path):
    # with the background import off: what a warm cache_compile imports of ours beyond the warm path
    # is exactly preload.DROP_IN (a stale list would preload too little or too much)
    d = str(tmp_path)
    script = OURS + TINY + textwrap.dedent(f"""
        m = Tiny().eval()
        before = set(ours())
        fn = tcb.cache_compile(m.forward, cache_dir={d!r}, compiler="eager")
        fn(torch.ones(2, 4))
        from child_helpers import frames
        emit({{"added": sorted(set(ours()) - before), "frames": frames(), "loads": tcb.stats().as_dict()["bypass_loads"]}})
        """)
    run_python(script, env={"TCB_PRELOAD": "0"})
    warm = run_python(script, env={"TCB_PRELOAD": "0"})
    assert warm["frames"] == 0 and warm["loads"] == 1, warm
    assert set(warm["added"]) - WARM_PATH_MODULES == set(preload.DROP_IN), warm["added"]


def test_after_torch_the_package_import_preloads_the_warm_path_and_the_drop_in_only():
    out = run_python(OURS + textwrap.dedent("""
        import torch
        before = set(sys.modules)
        import torchair_cached_backend as tcb
        from torchair_cached_backend import preload
        thread = preload._thread
        done = preload.wait(60)
        import threading
        emit({"started": thread is not None, "name": thread.name if thread else None, "daemon": thread.daemon,
              "listed": [t.name for t in threading.enumerate()],
              "done": done, "ours": ours(),
              "others": sorted(m for m in set(sys.modules) - before if not m.startswith("torchair_cached_backend"))})
        """))
    assert out["started"] and out["done"] and out["daemon"], out
    assert out["name"] == preload.THREAD_NAME
    # the thread is no threading.Thread: none is left listed as alive once it is done (a dummy one would be)
    assert out["listed"] == [threading.main_thread().name], out
    assert set(out["ours"]) == PRELOADED, sorted(set(out["ours"]) ^ PRELOADED)
    assert not set(NOT_ON_THE_WARM_PATH + COLD_SIDE_MODULES) & set(out["ours"])
    # nothing outside the package: no Dynamo, no Inductor (torch was imported before)
    assert not [m for m in out["others"] if m.startswith("torch")], out["others"]


@pytest.mark.parametrize("case", ["torch not imported", "TCB_PRELOAD=0"])
def test_no_background_import(case):
    env = {"TCB_PRELOAD": "0"} if case == "TCB_PRELOAD=0" else {}
    first = "import torch" if case == "TCB_PRELOAD=0" else ""
    out = run_python(OURS + textwrap.dedent(f"""
        {first}
        import threading
        import torchair_cached_backend
        from torchair_cached_backend import preload
        emit({{"thread": preload._thread is not None, "ours": ours(),
               "threads": [t.name for t in threading.enumerate()]}})
        """), env=env)
    assert not out["thread"] and preload.THREAD_NAME not in out["threads"], out
    assert out["ours"] == PACKAGE_IMPORT_MODULES, out["ours"]


#: (what runs before the fork, the module the child imports): the warm path's batch, started by the
#: package's import; the route's, started by Dynamo's import after the first batch is done
FORKS = {
    "warm path": ("", "loader"),
    "route": ("preload.wait(60)\nimport torch._dynamo", "frame_install"),
}


@pytest.mark.parametrize("batch", sorted(FORKS))
def test_a_fork_right_after_the_import_waits_for_the_thread(batch):
    # without the fork hook the thread is still importing when os.fork() runs: an import lock it
    # holds would stay held in the child, which then hangs on its first import of that module
    before, module = FORKS[batch]
    out = run_python(OURS + textwrap.dedent("""
        import os, signal, torch
        import torchair_cached_backend as tcb
        from torchair_cached_backend import preload
        {before}
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)
            from torchair_cached_backend.bypass import {module}  # noqa: F401
            os._exit(0 if "torchair_cached_backend.bypass.{module}" in sys.modules else 3)
        alive_at_fork = preload._thread.is_alive()
        _, status = os.waitpid(pid, 0)
        emit({{"alive_at_fork": alive_at_fork, "child": os.waitstatus_to_exitcode(status)}})
        """).format(before=before, module=module), timeout=120)
    assert out == {"alive_at_fork": False, "child": 0, **{k: v for k, v in out.items() if k.startswith("_")}}, out


def test_a_failing_preload_is_silent_and_the_load_still_works(tmp_path):
    # a module that cannot be imported in the background stops the thread quietly: the caller's own
    # import of it raises where the caller sees it, and the rest imports on use
    out = run_python(OURS + textwrap.dedent("""
        import torch
        import torchair_cached_backend as tcb
        from torchair_cached_backend import preload
        preload.WARM_PATH = ("torchair_cached_backend.no_such_module",) + preload.WARM_PATH
        import os
        os.environ["TCB_PRELOAD"] = "1"
        preload._thread = None
        preload._started = False
        started = preload.start()
        preload.wait(60)
        try:
            import torchair_cached_backend.no_such_module  # noqa: F401
            raised = None
        except ImportError as exc:
            raised = type(exc).__name__
        from torchair_cached_backend.bypass import loader  # noqa: F401
        emit({"started": started, "raised": raised, "loader": "torchair_cached_backend.bypass.loader" in ours()})
        """), env={"TCB_PRELOAD": "0"})
    assert out["started"] and out["raised"] == "ModuleNotFoundError" and out["loader"], out
    assert "Exception in thread" not in out["_stderr"], out["_stderr"]


def _module_imports(name: str) -> set[str]:
    """Our modules ``name`` imports when its body runs (top-level statements, ``try``/``if`` blocks
    included, ``if TYPE_CHECKING`` not). A parent package is no edge: importing a submodule
    needs its parent in ``sys.modules``, not its import lock."""
    rel = name.split(".")[1:]
    path = os.path.join(PACKAGE_DIR, *rel)
    is_pkg = os.path.isdir(path)
    path = os.path.join(path, "__init__.py") if is_pkg else path + ".py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("torchair_cached_backend"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                if not module.startswith("torchair_cached_backend"):
                    continue
                found.add(module)
                for alias in node.names:  # ``from . import x``: x may be a module
                    sub = f"{module}.{alias.name}"
                    if os.path.exists(os.path.join(PACKAGE_DIR, *sub.split(".")[1:]) + ".py"):
                        found.add(sub)
            elif isinstance(node, (ast.If, ast.Try)):
                walk(node.body)
                walk(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    walk(handler.body)
                walk(getattr(node, "finalbody", []))

    walk(ast.parse(open(path).read()).body)
    found.discard(name)
    return found


#: imported by the package under TCB_PROFILE=1 only
PROFILING = "torchair_cached_backend.profiling"


def test_the_warm_path_imports_stay_inside_it_without_cycles():
    # two threads importing these modules can only wait on each other's import locks through a cycle
    nodes = PRELOADED | set(preload.ROUTE) | set(preload.ROUTE_MISS) | {PROFILING}
    graph = {name: _module_imports(name) for name in nodes}
    for name, deps in graph.items():
        assert deps <= nodes, (name, sorted(deps - nodes))
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        assert state.get(name) != 1, f"import cycle: {' -> '.join(path + [name])}"
        state[name] = 1
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        state[name] = 2

    for name in sorted(graph):
        visit(name, [])


def test_the_cycle_finder_finds_a_cycle(monkeypatch):
    # the check above can fail: a planted edge back to the package is a cycle
    real = _module_imports
    monkeypatch.setitem(globals(), "_module_imports",
                        lambda n: real(n) | ({"torchair_cached_backend.bypass.loader"} if n == "torchair_cached_backend.store" else set()))
    with pytest.raises(AssertionError, match="import cycle"):
        test_the_warm_path_imports_stay_inside_it_without_cycles()


TINY = """
import torch, torch.nn as nn
import torchair_cached_backend as tcb

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu() * 2
"""


def _cold_tiny(tmp_path) -> str:
    """A cache dir holding Tiny's program (a cold process of its own)."""
    d = str(tmp_path)
    run_python(TINY + textwrap.dedent(f"""
        m = Tiny().eval()
        with torch.no_grad():
            torch.compile(m, backend="npu_cached", options={{"cache_dir": {d!r}, "compiler": "eager"}})(torch.ones(2, 4))
        emit({{}})
        """))
    return d


def test_a_load_racing_the_background_import_replays_right(tmp_path):
    # tcb.load right after the import, while the thread is importing the same modules: importlib's
    # module locks serialize the two, and the load replays (fresh processes, the cache cold in another)
    d = _cold_tiny(tmp_path)
    for _ in range(3):
        out = run_python(TINY + textwrap.dedent(f"""
            from torchair_cached_backend import preload
            racing = preload._thread is not None and preload._thread.is_alive()
            m, x = Tiny().eval(), torch.randn(2, 4)  # the shape compiled cold (no variant added)
            with torch.no_grad():
                ok = bool(torch.equal(tcb.load(m, {d!r}, compiler="eager", fallback=False)(x), m.lin(x).relu() * 2))
            from child_helpers import frames
            emit({{"ok": ok, "racing": racing, "frames": frames(), "loads": tcb.stats().as_dict()["bypass_loads"]}})
            """))
        assert out["ok"] and out["frames"] == 0 and out["loads"] >= 1, out


def test_a_load_right_after_waiting_for_the_thread_runs_with_no_other_import_beside_it(tmp_path):
    # tcb.load right after the import waits for the thread's warm path; the thread then went straight
    # on to cache_compile's modules, which it imported beside the load (it took the interpreter at
    # every file the load read: a tiny Llama's load 6 -> 14 ms, and the wake came late). The thread
    # now pauses until the load begins, which drops what it never waits for
    d = _cold_tiny(tmp_path)
    for _ in range(2):
        out = run_python(OURS + WHO + TINY + textwrap.dedent(f"""
            from torchair_cached_backend import preload
            racing = preload._thread is not None and preload._thread.is_alive() and "{preload.WARM_PATH[-1]}" not in sys.modules
            load = tcb.load  # waits for the thread's warm path
            m, x = Tiny().eval(), torch.ones(2, 4)
            with torch.no_grad():
                ok = bool(torch.equal(load(m, {d!r}, compiler="eager", fallback=False)(x), m.lin(x).relu() * 2))
            preload.wait(10)
            emit({{"ok": ok, "racing": racing, "ours": ours(), "loads": tcb.stats().as_dict()["bypass_loads"]}})
            """))
        assert out["racing"] and out["ok"] and out["loads"] == 1, out
        assert not set(preload.DROP_IN) & set(out["ours"]), out["ours"]


#: records which thread imported each of our modules (a meta-path finder that finds nothing)
WHO = """
import sys, threading
who = {}
class _Who:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchair_cached_backend") and name not in who:
            who[name] = threading.get_ident()
        return None
sys.meta_path.insert(0, _Who())
"""


@pytest.mark.parametrize("dynamo", ["before the package", "after the package"])
def test_with_dynamo_the_thread_imports_the_backend_route_too(dynamo):
    # before: the package's import queues the route behind the warm path; after (a transformers
    # model's build imports Dynamo): Dynamo's registry import queues it, and the thread waits for
    # Dynamo's import to finish. Either way the thread, not the caller, imports the route's modules
    first, later = ("import torch._dynamo", "") if dynamo == "before the package" else ("", "import torch._dynamo")
    out = run_python(OURS + WHO + textwrap.dedent(f"""
        import torch
        {first}
        before = set(sys.modules)
        import torchair_cached_backend as tcb
        from torchair_cached_backend import preload
        {later}
        done = preload.wait(60)
        emit({{"done": done, "ours": ours(), "who": who, "thread_ident": preload._thread.ident,
               "others": sorted(m for m in set(sys.modules) - before if not m.startswith("torchair_cached_backend"))}})
        """))
    assert out["done"], out
    want = PRELOADED | set(preload.ROUTE) | set(preload.ROUTE_MISS)
    assert set(out["ours"]) == want, sorted(set(out["ours"]) ^ want)
    assert {out["who"][m] for m in (*preload.ROUTE, *preload.ROUTE_MISS)} == {out["thread_ident"]}, out["who"]
    assert not {"torchair_cached_backend.bypass.capture", "torchair_cached_backend.backend"} & set(out["ours"])
    if dynamo == "before the package":  # of torch's, only what torch.compile() itself imports on first use
        assert [m for m in out["others"] if m.startswith("torch")] == [preload.BISECTOR], out["others"]


def test_without_dynamo_or_with_preload_off_the_route_is_not_imported():
    out = run_python(OURS + textwrap.dedent("""
        import torch
        import torchair_cached_backend as tcb
        from torchair_cached_backend import preload
        preload.wait(60)
        without = ours()
        emit({"without": without})
        """))
    assert not set(preload.ROUTE + preload.ROUTE_MISS) & set(out["without"]), out
    off = run_python(OURS + textwrap.dedent("""
        import torch, threading
        import torchair_cached_backend as tcb
        import torch._dynamo
        from torchair_cached_backend import preload
        emit({"ours": ours(), "threads": [t.name for t in threading.enumerate()]})
        """), env={"TCB_PRELOAD": "0"})
    assert not set(preload.ROUTE) & set(off["ours"]) and preload.THREAD_NAME not in off["threads"], off


def test_the_route_set_is_what_a_warm_backend_route_imports(tmp_path):
    # with the background import off: what a warm torch.compile(backend="npu_cached") imports of ours
    # beyond the warm path is exactly preload.ROUTE (a stale list would preload too little or too much)
    d = str(tmp_path)
    script = OURS + TINY + textwrap.dedent(f"""
        import torch._dynamo
        m = Tiny().eval()
        before = set(ours())
        with torch.no_grad():
            torch.compile(m, backend="npu_cached", options={{"cache_dir": {d!r}, "compiler": "eager"}})(torch.ones(2, 4))
        from child_helpers import frames
        emit({{"added": sorted(set(ours()) - before), "frames": frames()}})
        """)
    run_python(script, env={"TCB_PRELOAD": "0"})
    warm = run_python(script, env={"TCB_PRELOAD": "0"})
    assert warm["frames"] == 0, warm
    assert set(warm["added"]) - WARM_PATH_MODULES == set(preload.ROUTE), warm["added"]


def test_the_route_miss_set_is_what_a_nested_frame_without_a_program_adds(tmp_path):
    # BERT's replayed forward calls transformers' config __getattribute__, a frame Dynamo compiled
    # nothing in: the route looks for its program, misses, and runs it as Python. What that adds
    # (with the background import off) is exactly preload.ROUTE_MISS, which the thread imports
    d = str(tmp_path)
    script = OURS + textwrap.dedent(f"""
        import torch, transformers
        import torchair_cached_backend as tcb
        import hf_tiny
        from child_helpers import frames
        model, inputs = hf_tiny.build("bert", size="tiny")
        before = set(ours())
        with torch.no_grad():
            torch.compile(model, backend="npu_cached", options={{"cache_dir": {d!r}, "compiler": "eager"}})(**inputs)
        added = sorted(set(ours()) - before)
        from torchair_cached_backend.bypass import frame_install
        emit({{"added": added, "frames": frames(), "counts": frame_install.counts}})
        """)
    run_python(script, env={"TCB_PRELOAD": "0"})
    warm = run_python(script, env={"TCB_PRELOAD": "0"})
    assert warm["frames"] == 0 and warm["counts"]["installed"] >= 1 and warm["counts"]["fallbacks"] == 0, warm
    assert set(warm["added"]) - WARM_PATH_MODULES == set(preload.ROUTE) | set(preload.ROUTE_MISS), warm["added"]


#: the trace rules' memos, as ``functools.cache`` reports them
MEMOS = """
def memos():
    from torch._dynamo import trace_rules
    return {n: getattr(trace_rules, n).cache_info().currsize for n in preload.TRACE_RULE_MEMOS}
"""


@pytest.mark.parametrize("preloading", ["on", "TCB_PRELOAD=0"])
def test_with_dynamo_the_thread_does_torch_compiles_first_use(preloading):
    # torch.compile()'s own first use in a process (the bisector's import, Dynamo's skip and inline file
    # sets: ~3.5 ms of a warm backend route) is done by the thread, so the call then imports nothing
    out = run_python(OURS + textwrap.dedent("""
        import torch, torch._dynamo
        import torchair_cached_backend as tcb
        from torchair_cached_backend import preload
        preload.wait(60)
        """) + MEMOS + textwrap.dedent("""
        filled, bisector = memos(), preload.BISECTOR in sys.modules
        before = set(sys.modules)
        torch.compile(torch.nn.Linear(2, 2), backend="npu_cached")
        emit({"filled": filled, "bisector": bisector, "imported": sorted(set(sys.modules) - before)})
        """), env={"TCB_PRELOAD": "0"} if preloading != "on" else {})
    if preloading == "on":
        assert out["bisector"] and set(out["filled"].values()) == {1}, out
        assert not [m for m in out["imported"] if m.startswith("torch")], out["imported"]
    else:  # the call pays it itself
        assert not out["bisector"] and set(out["filled"].values()) == {0}, out
        assert preload.BISECTOR in out["imported"], out["imported"]


@pytest.mark.parametrize("preloading", ["on", "TCB_PRELOAD=0"])
def test_the_thread_reads_the_versions_every_key_holds(preloading):
    # torch_npu / torchair / CANN versions (path-finder lookups, ~0.25 ms of a warm load) are read by
    # the thread after the warm path's imports; with the preload off the first key pays them
    out = run_python(textwrap.dedent("""
        import torch
        import torchair_cached_backend as tcb
        from torchair_cached_backend import preload
        preload.wait(60)
        from torchair_cached_backend import environment
        memos = (environment.torch_npu_version, environment.torchair_version, environment.cann_version)
        emit({"filled": [m.cache_info().currsize for m in memos]})
        """), env={"TCB_PRELOAD": "0"} if preloading != "on" else {})
    assert out["filled"] == ([1, 1, 1] if preloading == "on" else [0, 0, 0]), out


def test_a_version_lookup_that_fails_in_the_thread_is_left_to_the_caller():
    # a failing lookup neither stops the thread's queue (cache_compile's modules still import) nor
    # leaves a memo: the caller's own first use raises it, where it is seen
    out = run_python(textwrap.dedent("""
        import os, sys, torch
        from torchair_cached_backend import preload, environment  # TCB_PRELOAD=0: no thread yet
        def boom():
            raise RuntimeError("no metadata")
        environment.cann_version = boom
        os.environ["TCB_PRELOAD"] = "1"
        preload._thread, preload._started = None, False
        preload.start()
        preload.wait(60)
        try:
            environment.environment_factors()
            raised = None
        except RuntimeError as exc:
            raised = str(exc)
        emit({"raised": raised, "drop_in": all(m in sys.modules for m in preload.DROP_IN)})
        """), env={"TCB_PRELOAD": "0"})
    assert out == {"raised": "no metadata", "drop_in": True, **{k: v for k, v in out.items() if k.startswith("_")}}, out


def test_a_bisect_variable_set_after_the_preload_is_warned_about():
    # the bisector reads TORCH_BISECT_* once, at its import (the thread's): one set later is named
    out = run_python(textwrap.dedent("""
        import os, warnings
        import torch, torch._dynamo
        import torchair_cached_backend as tcb
        from torchair_cached_backend import preload
        preload.wait(60)
        os.environ["TORCH_BISECT_BACKEND"] = "eager"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.compile(torch.nn.Linear(2, 2), backend="npu_cached")
            torch.compile(torch.nn.Linear(2, 2), backend="npu_cached")  # once per process
        emit({"warned": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]})
        """))
    assert len(out["warned"]) == 1 and "TORCH_BISECT_BACKEND" in out["warned"][0], out
    assert "TCB_PRELOAD=0" in out["warned"][0]
    # set before the process starts (as torch's bisector sets it for the processes it runs): honoured, no warning
    before = run_python(textwrap.dedent("""
        import warnings
        import torch, torch._dynamo
        import torchair_cached_backend as tcb
        from torchair_cached_backend import preload
        preload.wait(60)
        from torch._inductor.compiler_bisector import CompilerBisector
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.compile(torch.nn.Linear(2, 2), backend="npu_cached")
        emit({"backend": CompilerBisector.get_backend(),
              "warned": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]})
        """), env={"TORCH_BISECT_BACKEND": "eager"})
    assert before["backend"] == "eager" and before["warned"] == [], before


def test_a_trace_rule_list_edited_while_its_memo_fills_leaves_no_stale_memo(monkeypatch):
    # DDP's python reducer adds a module to LEGACY_MOD_INLINELIST, then clears the memo: an edit that
    # lands while the thread computes the memo must not leave the older set cached
    import functools
    import sys
    import types

    rules = types.ModuleType("fake_trace_rules")
    rules.MOD_SKIPLIST, rules.MOD_INLINELIST, rules.LEGACY_MOD_INLINELIST = {"a"}, {"b"}, {"c"}

    def memo(source: str, edit: bool) -> object:
        @functools.cache
        def compute() -> frozenset:
            value = frozenset(getattr(rules, source))
            if edit:  # the caller's thread edits the list meanwhile (and clears the memo before we store)
                getattr(rules, source).add("torch.nn.parallel.distributed")
            return value
        return compute

    rules.get_mod_skiplist = memo("MOD_SKIPLIST", False)
    rules.get_mod_inlinelist = memo("MOD_INLINELIST", False)
    rules.get_legacy_mod_inlinelist = memo("LEGACY_MOD_INLINELIST", True)
    rules.get_tensor_method = functools.cache(lambda: frozenset({"add"}))
    monkeypatch.setitem(sys.modules, preload.TRACE_RULES, rules)
    preload._fill_trace_rule_memos()
    assert rules.get_legacy_mod_inlinelist.cache_info().currsize == 0  # cleared: the next call sees the edit
    assert rules.get_legacy_mod_inlinelist() >= {"c", "torch.nn.parallel.distributed"}
    assert rules.get_mod_skiplist.cache_info().currsize == 1 and rules.get_tensor_method.cache_info().currsize == 1


@pytest.mark.parametrize("preloading", ["on", "TCB_PRELOAD=0"])
def test_the_thread_does_torchs_first_use_of_the_common_operators_and_changes_no_state(preloading):
    # op_warmup: every listed operator runs once on the thread (a torch where one fails would show
    # here), and the caller's process state is what it was: RNG, default dtype, grad mode,
    # determinism, thread count of torch's pool, and no OS thread left behind (no pool started)
    out = run_python(textwrap.dedent("""
        import os, sys, time, torch
        def state():
            return {"rng": torch.get_rng_state().tolist()[:64], "dtype": str(torch.get_default_dtype()),
                    "grad": torch.is_grad_enabled(), "det": torch.are_deterministic_algorithms_enabled(),
                    "threads": torch.get_num_threads()}
        tasks = lambda: len(os.listdir("/proc/self/task"))
        before, os_threads = state(), tasks()
        import torchair_cached_backend as tcb
        from torchair_cached_backend import preload
        done = preload.wait(60)
        for _ in range(100):  # the thread signals it is done just before it exits
            if tasks() == os_threads:
                break
            time.sleep(0.01)
        op_warmup = sys.modules.get(preload.OP_WARMUP)
        emit({"done": done, "same": state() == before, "os_threads": [os_threads, tasks()],
              "warmed": op_warmup.warmed if op_warmup else None,
              "listed": len(op_warmup.calls()) if op_warmup else None})
        """), env={"TCB_PRELOAD": "0"} if preloading != "on" else {})
    assert out["done"] and out["same"], out
    assert out["os_threads"][0] == out["os_threads"][1], out
    if preloading == "on":
        assert out["warmed"] == out["listed"] and out["listed"] >= 30, out
    else:
        assert out["warmed"] is None, out


def test_a_load_stops_the_operators_first_use(tmp_path):
    # a load that begins (a hit or, here, a miss) stops the thread's optional work: a load right
    # after the import must not wait for the thread to hand back the interpreter
    out = run_python(TINY + textwrap.dedent(f"""
        import threading
        from torchair_cached_backend import op_warmup, preload
        op_warmup.warm(threading.Event())
        alone = op_warmup.warmed
        try:
            tcb.load(Tiny().eval(), {str(tmp_path)!r}, compiler="eager", fallback=False)
        except tcb.CacheMiss:
            pass
        op_warmup.warmed = 0
        op_warmup.warm(preload._optional_stop)
        emit({{"alone": alone, "listed": len(op_warmup.calls()), "after_a_load": op_warmup.warmed}})
        """), env={"TCB_PRELOAD": "0"})
    assert out["alone"] == out["listed"] and out["after_a_load"] == 0, out


@pytest.mark.parametrize("route", ["load", "backend route"])
def test_a_load_drops_the_queued_work_it_never_waits_for(route):
    # the thread importing the route's modules and torch.compile()'s first use beside a load took the
    # interpreter from it at every file it read (up to a 5 ms switch interval each): a tiny Llama's warm
    # load() 9 -> 15-27 ms, its first call 6 -> 11 ms. A load that begins keeps only the warm path (and,
    # where the route's frame callback is loaded, the route's miss path) queued
    extra = "import torchair_cached_backend.bypass.frame_install" if route == "backend route" else ""
    out = run_python(textwrap.dedent(f"""
        import torch, torch._dynamo
        import torchair_cached_backend as tcb
        from torchair_cached_backend import preload
        {extra}
        queued = list(preload.WARM_PATH) + [preload.VERSIONS] + list(preload.DROP_IN) + [
            preload.DYNAMO, *preload.ROUTE, *preload.TORCH_FIRST_USE, *preload.ROUTE_MISS, preload.OPS]
        preload._queue[:] = queued  # the thread is off here: the queue as a fresh start with Dynamo fills it
        preload.caller_loading()
        emit({{"left": list(preload._queue)}})
        """), env={"TCB_PRELOAD": "0"})
    want = [*preload.WARM_PATH, preload.VERSIONS] + (list(preload.ROUTE_MISS) if route == "backend route" else [])
    assert out["left"] == want, out


#: a caller's first use right after the package's import -> what the thread imports for it meanwhile
FIRST_USES = {
    "tcb.load": ("import torchair_cached_backend as tcb\ntcb.load", preload.LOAD_NEEDS),
    "from-import of load": ("from torchair_cached_backend import load", preload.LOAD_NEEDS),
    "tcb.cache_compile": ("import torchair_cached_backend as tcb\ntcb.cache_compile", preload.DROP_IN_NEEDS),
    "backend route": ("import torch._dynamo\nimport torchair_cached_backend as tcb\n"
                      "from torch._dynamo.backends.registry import lookup_backend\nlookup_backend('npu_cached')",
                      preload.ROUTE_NEEDS),
}


@pytest.mark.parametrize("use", sorted(FIRST_USES))
def test_a_first_use_right_after_the_import_waits_for_the_thread_instead_of_racing_it(use):
    # a model built before the package's import, then loaded: the caller imported the warm path beside
    # the thread, and two threads importing one list convoy on the interpreter (each file read hands it
    # over; taking it back waits up to a switch interval). The caller now waits while the thread imports
    code, needs = FIRST_USES[use]
    out = run_python(OURS + WHO + "import torch\n" + code + textwrap.dedent("""
        from torchair_cached_backend import preload
        main = threading.get_ident()
        emit({"by_caller": sorted(m for m, t in who.items() if t == main), "ours": ours()})
        """))
    modules = {m for m in needs if m.startswith("torchair_cached_backend")} - set(PACKAGE_IMPORT_MODULES)
    assert modules <= set(out["ours"]), sorted(modules - set(out["ours"]))
    assert not modules & set(out["by_caller"]), sorted(modules & set(out["by_caller"]))


def test_a_caller_waits_for_the_thread_a_bounded_time(tmp_path):
    # a thread stuck in an import never holds up the caller's start for longer than NEED_WAIT_S
    (tmp_path / "stuck_probe.py").write_text("import time\ntime.sleep(60)\n")
    out = run_python(textwrap.dedent(f"""
        import os, sys, time, torch
        sys.path.insert(0, {str(tmp_path)!r})
        import torchair_cached_backend as tcb
        from torchair_cached_backend import preload
        preload.wait(60)
        preload.NEED_WAIT_S = 0.5
        preload._submit(["stuck_probe"])
        while "stuck_probe" not in sys.modules:
            time.sleep(0.01)
        t0 = time.monotonic()
        preload.caller_needs(frozenset({{"stuck_probe"}}))
        waited = time.monotonic() - t0
        alive = preload._thread.is_alive()
        emit({{"waited": waited, "alive": alive}})
        sys.stdout.flush()
        os._exit(0)
        """), timeout=120)
    assert out["alive"] and 0.4 <= out["waited"] < 30, out


def test_a_caller_inside_an_import_never_waits(tmp_path, monkeypatch):
    # the thread may need a module lock an importing caller holds: there the caller never waits.
    # A plain from-import runs importlib's frames too, but holds no lock: there it waits
    (tmp_path / "probe_pkg.py").write_text(
        "def __getattr__(name):\n    from torchair_cached_backend import preload\n    return preload._inside_import()\n")
    (tmp_path / "probe_importing.py").write_text("from probe_pkg import inside\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("probe_pkg", "probe_importing"):
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    import probe_importing
    from probe_pkg import inside

    assert inside is False
    assert probe_importing.inside is True
    assert preload._inside_import() is False


def test_the_operators_first_use_starts_no_thread_pool():
    # tensors this small never enter a parallel region: no OpenMP team is started for the thread
    # (its workers would spin on the caller's cores). Each call runs on a thread of its own (a team
    # belongs to the thread that starts it), and the OS threads are counted while it is alive
    out = run_python(textwrap.dedent("""
        import os, threading, time, torch
        from torchair_cached_backend import op_warmup
        tasks = lambda: len(os.listdir("/proc/self/task"))
        parallel = []
        for index, call in enumerate(op_warmup.calls()):
            def run():
                before = tasks()
                with torch.no_grad():
                    call()
                if tasks() > before:
                    parallel.append(index)
            worker = threading.Thread(target=run)
            worker.start()
            worker.join()
            time.sleep(0.02)  # the team of an earlier call, if any, is gone before the next count
        emit({"parallel": parallel, "torch_threads": torch.get_num_threads()})
        """), env={"TCB_PRELOAD": "0", "OMP_NUM_THREADS": "4"})
    assert out["torch_threads"] > 1, out  # else no call could start a team, and the test proves nothing
    assert out["parallel"] == [], out


def test_an_exit_while_the_thread_runs_an_operator_does_not_abort():
    # a short script (a CLI, a test's helper process) can end while the thread is still calling
    # operators; torch's C++ state torn down under a running operator aborts the process
    # ("terminate called without an active exception"): the exit waits for the operator in flight
    import subprocess
    import sys

    script = textwrap.dedent("""
        import os, time, torch
        from torchair_cached_backend import op_warmup, preload
        many = [lambda: torch.ones(64, 64) @ torch.ones(64, 64)] * 20000  # a warm-up that outlives the script
        op_warmup.calls = lambda: many
        os.environ["TCB_PRELOAD"] = "1"
        preload._thread, preload._started = None, False
        preload.start()
        while op_warmup.warmed < 100:
            time.sleep(0.001)
        print("exiting with", op_warmup.warmed, flush=True)
        """)
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TCB_PRELOAD": "0", "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, (proc.returncode, proc.stderr[-2000:])
        assert "exiting with" in proc.stdout


def test_no_operator_warm_up_where_torch_npu_is_imported(monkeypatch):
    # an NPU process runs its graphs on the NPU: CPU kernels warmed there would be work for nothing
    import sys
    import threading
    import types

    from torchair_cached_backend import op_warmup

    monkeypatch.setattr(op_warmup, "warmed", 0)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    op_warmup.warm(threading.Event())
    assert op_warmup.warmed == 0
    monkeypatch.delitem(sys.modules, "torch_npu")
    op_warmup.warm(threading.Event())
    assert op_warmup.warmed == len(op_warmup.calls())
