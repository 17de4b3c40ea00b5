"""The warm path stays lean (issue 18): importing the package in a process that already
imported Dynamo (every transformers process) registers ``npu_cached`` without importing
the capture machinery, which waits for the backend to be used; ``TCB_PROFILE=1`` prints
where a warm start spent its time."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest
from subprocess_helpers import run_python

MODEL = """
import sys
import torch._dynamo                      # as transformers does, before our package
import torchair_cached_backend as tcb
import torch, torch.nn as nn

class PrintsFirst(nn.Module):  # the root frame has no graph before its graph break
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        print("forward called")
        return self.lin(x).relu()

def ours():
    return sorted(m for m in sys.modules if m.startswith("torchair_cached_backend"))
"""

#: the modules a process imports are what its calls imported, not the background import's (``preload``)
NO_PRELOAD = {"TCB_PRELOAD": "0"}

CAPTURE_MODULES = ("torchair_cached_backend.bypass.capture", "torchair_cached_backend.bypass.guard_capture",
                   "torchair_cached_backend.backend")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("warm_path"))
    cold = run_python(
        MODEL + textwrap.dedent(f"""
        after_import = ours()
        m, x = PrintsFirst().eval(), torch.randn(2, 4)
        f = torch.compile(m, backend="npu_cached", options={{"cache_dir": {d!r}, "compiler": "eager"}})
        after_compile = ours()
        with torch.no_grad():
            ok = bool(torch.allclose(f(x), m.lin(x).relu()))
        emit({{"after_import": after_import, "after_compile": after_compile, "ok": ok}})
        """),
        env=NO_PRELOAD,
    )
    warm = run_python(
        MODEL + textwrap.dedent(f"""
        from child_helpers import frames
        m, x = PrintsFirst().eval(), torch.randn(2, 4)
        with torch.no_grad():
            f = tcb.load(m, {d!r}, compiler="eager", fallback=False)
            ok = bool(torch.allclose(f(x), m.lin(x).relu()))
        checks = f._variants[0].checks
        emit({{"ok": ok, "frames": frames(), "loaded": ours(), "stats": tcb.stats().as_dict(),
               "full_loaded": checks._full is not None, "meta_parsed": checks._meta is not None}})
        """),
        env={"TCB_PROFILE": "1", **NO_PRELOAD},
    )
    return cold, warm


#: all that ``import torchair_cached_backend`` imports of ours on the caller's thread: registration, the
#: counters, and the background import of the warm path (off in these tests, which see what a load imports)
PACKAGE_IMPORT_MODULES = ["torchair_cached_backend", "torchair_cached_backend.preload",
                          "torchair_cached_backend.registry", "torchair_cached_backend.stats"]


def test_import_with_dynamo_loaded_does_not_import_capture(runs):
    cold, _ = runs
    assert "torchair_cached_backend.registry" in cold["after_import"]
    assert not set(CAPTURE_MODULES) & set(cold["after_import"]), cold["after_import"]


def test_package_import_is_registration_and_stats(runs):
    # options, the loader and everything else come with their first use
    cold, _ = runs
    assert cold["after_import"] == PACKAGE_IMPORT_MODULES, cold["after_import"]


def test_capture_installed_when_the_backend_is_used(runs):
    # torch.compile(backend="npu_cached") resolves the name: the capture's hook listens before
    # the first frame (capture itself is imported when Dynamo transforms one), so a root frame
    # with no graph of its own (the print) is recorded too and replays warm
    cold, warm = runs
    assert "torchair_cached_backend.bypass.capture_hook" in cold["after_compile"]
    assert "torchair_cached_backend.bypass.capture" not in cold["after_compile"]
    assert cold["ok"]
    assert warm["ok"] and warm["frames"] == 0 and warm["stats"]["bypass_loads"] >= 1, warm


def test_warm_load_does_not_import_capture(runs):
    _, warm = runs
    assert not {"torchair_cached_backend.bypass.capture", "torchair_cached_backend.bypass.guard_capture"} & set(
        warm["loaded"]
    ), warm["loaded"]


def test_full_check_and_explanations_not_loaded_on_the_warm_path(runs):
    # guards="call"'s full check and the guards' explanations are read only when used
    _, warm = runs
    assert warm["full_loaded"] is False and warm["meta_parsed"] is False, warm


def test_profile_prints_the_breakdown(runs):
    _, warm = runs
    lines = [ln for ln in warm["_stderr"].splitlines() if ln.startswith("tcb profile:")]
    assert len(lines) == 1, warm["_stderr"][-3000:]
    line = lines[0]
    assert "PrintsFirst.forward" in line
    for phase in ("imports", "read", "verify", "decode", "checks", "guards", "graphs", "first call"):
        assert f"{phase} " in line, line
    assert "imported before the load: " in line, line  # tcb.load's own imports (the loader)


def test_profile_breaks_down_a_backend_route_warm_start(tmp_path):
    # the README's first line: a warm torch.compile(backend="npu_cached") prints one line for the
    # program its frame callback built, with the check that installed it; it still replays right
    d = str(tmp_path)
    script = MODEL + textwrap.dedent(f"""
        from child_helpers import frames
        m, x = PrintsFirst().eval(), torch.randn(2, 4)
        f = torch.compile(m, backend="npu_cached", options={{"cache_dir": {d!r}, "compiler": "eager"}})
        with torch.no_grad():
            ok = all(bool(torch.allclose(f(x), m.lin(x).relu())) for _ in range(3))
        emit({{"ok": ok, "frames": frames()}})
        """)
    cold = run_python(script, env={"TCB_PROFILE": "1"})
    warm = run_python(script, env={"TCB_PROFILE": "1"})
    assert cold["ok"] and cold["frames"] >= 1 and warm["ok"] and warm["frames"] == 0, (cold, warm)
    lines = [ln for ln in warm["_stderr"].splitlines() if ln.startswith("tcb profile:")]
    assert len(lines) == 1, warm["_stderr"][-3000:]
    line = lines[0]
    assert line.startswith("tcb profile: backend route load PrintsFirst.forward: "), line
    for phase in ("imports", "read", "verify", "decode", "checks", "graphs", "other"):
        assert f"{phase} " in line, line
    assert re.search(r"install check \d+\.\d+ ms", line), line
    # a cold start has nothing to replay: its line says why
    cold_lines = [ln for ln in cold["_stderr"].splitlines() if ln.startswith("tcb profile: backend route")]
    assert cold_lines and all("not replayed: CacheMiss" in ln for ln in cold_lines), cold["_stderr"][-3000:]


@pytest.mark.parametrize("case", ["guards none", "checks fail"])
def test_profile_line_of_a_backend_route_load_comes_with_its_own_call(tmp_path, case):
    # the line is printed when the frame callback returns, for that frame: with guards="none" no check
    # runs (it waited until exit), and a variant whose checks fail is not called installed
    d = str(tmp_path)
    extra = ', "guards": "none"' if case == "guards none" else ""
    script = MODEL + textwrap.dedent(f"""
        import os, sys
        from child_helpers import frames

        class Scaled(nn.Module):  # the root frame's checks hold self.k
            def __init__(self, k):
                super().__init__()
                torch.manual_seed(0)
                self.lin, self.k = nn.Linear(4, 4), k

            def forward(self, x):
                return self.lin(x) * self.k

        m, x = Scaled(float(os.environ["K"])).eval(), torch.randn(2, 4)
        f = torch.compile(m, backend="npu_cached", options={{"cache_dir": {d!r}, "compiler": "eager"{extra}}})
        with torch.no_grad():
            ok = bool(torch.allclose(f(x), m.lin(x) * m.k))
        print("after the first call", file=sys.stderr, flush=True)
        emit({{"ok": ok, "frames": frames()}})
        """)
    cold = run_python(script, env={"TCB_PROFILE": "1", "K": "2"})
    warm = run_python(script, env={"TCB_PROFILE": "1", "K": "3" if case == "checks fail" else "2"})
    assert cold["ok"] and warm["ok"], (cold, warm)
    err = warm["_stderr"]
    lines = [ln for ln in err.splitlines() if ln.startswith("tcb profile: backend route load Scaled.forward")]
    assert len(lines) == 1, err[-3000:]
    assert err.index(lines[0]) < err.index("after the first call"), err[-3000:]
    if case == "guards none":
        assert warm["frames"] == 0 and re.search(r"install check \d+\.\d+ ms", lines[0]), (warm, lines)
    else:
        assert warm["frames"] == 1, warm
        assert "install check" not in lines[0] and "not installed: no variant's checks hold" in lines[0], lines


def test_no_profile_line_without_the_variable(run, tmp_path):
    out = run(
        f"""
        import sys, torch
        import torchair_cached_backend as tcb
        f = tcb.load(lambda x: x + 1, {str(tmp_path)!r}, compiler="eager")
        emit({{"profiling": "torchair_cached_backend.profiling" in sys.modules}})
        """
    )
    assert not out["profiling"]
    assert "tcb profile:" not in out["_stderr"]


# ---- checks per distinct layer shape, not per layer; nothing needless imported; old formats rebuilt ----

STACK = """
import sys
import torch, torch.nn as nn

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.scale

class Stack(nn.Module):
    def __init__(self, n):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Layer() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

def expected(m, x):
    with torch.no_grad():
        for layer in m.layers:
            x = torch.relu(layer.lin(x)) * layer.scale
    return x
"""

#: never imported by a warm load + first call with the eager inner compiler
NOT_ON_THE_WARM_PATH = ("torch._dynamo", "torch._inductor", "torchair_cached_backend.bypass.capture",
                        "torchair_cached_backend.bypass.guard_capture", "torchair_cached_backend.bypass.guard_codegen",
                        "torchair_cached_backend.bypass.split_graph", "torchair_cached_backend.bypass.trace_mutations",
                        # the write side of the store and the encode side of the codec
                        "torchair_cached_backend.store_locks", "torchair_cached_backend.store_ledger",
                        "torchair_cached_backend.code_encode")


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    root = tmp_path_factory.mktemp("stacks")
    dirs = {n: str(root / f"l{n}") for n in (4, 8)}
    run_python(STACK + textwrap.dedent(f"""
        import torchair_cached_backend as tcb
        x = torch.randn(2, 8)
        for n, d in {dirs!r}.items():
            m = Stack(n).eval()
            f = torch.compile(m, backend="npu_cached", options={{"cache_dir": d, "compiler": "eager"}})
            with torch.no_grad():
                assert torch.allclose(f(x), expected(m, x))
        emit({{}})
        """))
    warm = run_python(STACK + textwrap.dedent(f"""
        import torchair_cached_backend as tcb
        from child_helpers import frames
        x = torch.randn(2, 8)
        out = {{}}
        for n, d in {dirs!r}.items():
            m = Stack(n).eval()
            before = set(sys.modules)
            with torch.no_grad():
                f = tcb.load(m, d, compiler="eager", fallback=False)
                ok = bool(torch.allclose(f(x), expected(m, x)))
            checks = f._variants[0].checks
            out[n] = {{"ok": ok, "imported": sorted(set(sys.modules) - before),
                       "checks": checks.namespace["___load_checks"],
                       "guards": sum(1 for g in checks.meta if g["scope"] == "load")}}
        hooked = Stack(8).eval()
        hooked.layers[5].register_forward_hook(lambda mod, args, result: result + 1)  # inside the loop: checked
        try:
            tcb.load(hooked, {dirs[8]!r}, compiler="eager", fallback=False)
            out["hooked"] = "replayed"
        except tcb.CacheMiss as miss:
            out["hooked"] = str(miss)
        scaled = Stack(8).eval()
        scaled.layers[5].scale = 3.0  # a float Dynamo may pass as an input: a miss or a right answer
        try:
            with torch.no_grad():
                out["scaled_ok"] = bool(torch.allclose(tcb.load(scaled, {dirs[8]!r}, compiler="eager",
                                                                fallback=False)(x), expected(scaled, x)))
        except tcb.CacheMiss as miss:
            out["scaled_ok"] = "specialized on changed" in str(miss)
        out["frames"] = frames()
        emit(out)
        """), env={"TCB_PROFILE": "1"})
    return dirs, warm


def test_load_checks_grow_with_distinct_layer_shapes_not_layers(stacks):
    # the same check on layers[i] for every i is one check in a loop over the layers
    _, warm = stacks
    four, eight = warm["4"], warm["8"]
    assert four["ok"] and eight["ok"] and warm["frames"] == 0, warm
    assert eight["guards"] > 1.5 * four["guards"], (four, eight)  # every guard is still recorded
    assert eight["checks"] < 1.2 * four["checks"], (four, eight)
    assert four["checks"] < four["guards"], four


def test_profile_counts_the_checks(stacks):
    _, warm = stacks
    lines = [ln for ln in warm["_stderr"].splitlines() if ln.startswith("tcb profile: load Stack.forward")]
    assert len(lines) >= 2, warm["_stderr"][-3000:]
    for line, n in zip(lines, ("4", "8"), strict=False):
        assert f"({warm[n]['checks']} checks)" in line, (line, warm[n])


def test_a_change_in_one_layer_is_still_detected(stacks):
    _, warm = stacks
    assert "specialized on changed" in warm["hooked"], warm["hooked"]
    assert "layers" in warm["hooked"] and "5" in warm["hooked"] and "hooks" in warm["hooked"], warm["hooked"]
    assert warm["scaled_ok"] is True, warm


def test_nothing_needless_imported_by_a_warm_start(stacks):
    _, warm = stacks
    for n in ("4", "8"):
        assert not set(NOT_ON_THE_WARM_PATH) & set(warm[n]["imported"]), warm[n]["imported"]


def test_a_warm_load_imports_only_the_read_side(stacks):
    # a fresh process without TCB_PROFILE, as a user starts: what
    # the package's import plus one load and call bring in, against what only a compile needs
    dirs, _ = stacks
    out = run_python(STACK + textwrap.dedent(f"""
        before = set(sys.modules)
        import torchair_cached_backend as tcb
        m = Stack(4).eval()
        x = torch.randn(2, 8)
        with torch.no_grad():
            ok = bool(torch.allclose(tcb.load(m, {dirs[4]!r}, compiler="eager", fallback=False)(x), expected(m, x)))
        emit({{"ok": ok, "imported": sorted(set(sys.modules) - before)}})
        """))
    assert out["ok"], out
    assert "torchair_cached_backend.bypass.loader" in out["imported"], out  # the load did happen here
    assert not set(NOT_ON_THE_WARM_PATH) & set(out["imported"]), out["imported"]
    assert not set(COLD_SIDE_MODULES) & set(out["imported"]), out["imported"]


def test_older_program_format_is_rebuilt_never_read(stacks):
    # an entry written by an older version (program format) is a miss that recompiles and
    # replaces it; the next process replays the rebuilt program
    import glob
    import json

    from torchair_cached_backend.bypass.program import PROGRAM_FORMAT

    dirs, _ = stacks
    (path,) = glob.glob(f"{dirs[4]}/programs/*/manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["program"]["format"] = PROGRAM_FORMAT - 1
    with open(path, "w") as f:
        json.dump(manifest, f)
    code = STACK + textwrap.dedent(f"""
        import torchair_cached_backend as tcb
        from child_helpers import frames
        m, x = Stack(4).eval(), torch.randn(2, 8)
        with torch.no_grad():
            f = tcb.load(m, {dirs[4]!r}, compiler="eager")
            ok = bool(torch.allclose(f(x), expected(m, x)))
        emit({{"ok": ok, "frames": frames(), "stats": tcb.stats().as_dict()}})
        """)
    rebuilt = run_python(code)
    assert rebuilt["ok"] and rebuilt["frames"] >= 1, rebuilt
    assert rebuilt["stats"]["fallback_reasons"] == {"older cache format": 1}, rebuilt["stats"]
    with open(path) as f:
        assert json.load(f)["program"]["format"] == PROGRAM_FORMAT
    again = run_python(code)
    assert again["ok"] and again["frames"] == 0 and again["stats"]["bypass_loads"] >= 1, again


def test_older_guards_blob_is_refused():
    from torchair_cached_backend import code_codec
    from torchair_cached_backend.bypass import guard_runtime

    blob = guard_runtime.pack_checks(b"checks", b"full", [])
    assert guard_runtime.unpack_checks(blob)[0] == b"checks"
    older = blob.replace(b"npu_cached guards 4\0", b"npu_cached guards 3\0", 1)
    with pytest.raises(code_codec.CodecError, match="not in this version's format"):
        guard_runtime.unpack_checks(older)


def test_looped_load_checks_evaluate_every_guard():
    # each guard of a per-layer template still decides: changing any one layer's value fails
    # the generated check (a compound guard keeps its parentheses inside the loop)
    import types

    from torchair_cached_backend.bypass.guard_codegen import load_check_body

    def layer(scale):
        return types.SimpleNamespace(scale=scale, _modules={})

    def scope(scales):
        return {"self": types.SimpleNamespace(_modules={"layers": types.SimpleNamespace(
            _modules={str(i): layer(s) for i, s in enumerate(scales)})})}

    guards = []
    for i in range(4):
        item = f"L['self']._modules['layers']._modules['{i}']"
        guards.append(f"(type({item}.scale) is float and {item}.scale == 2.0)")
        guards.append(f"({item}._modules == {{}})")
    guards.append("(len(L['self']._modules['layers']._modules) == 4)")
    body, count = load_check_body(list(enumerate(guards)))
    assert count == 3 and any("for " in line for line in body), body
    namespace: dict = {}
    exec("def check(L):\n" + "\n".join(body + ["    return -1"]), namespace)  # noqa: S102 - generated above
    full_body, _ = load_check_body(list(enumerate(guards)), fail="False")  # the per-call full check's form
    exec("def full(L):\n" + "\n".join(full_body + ["    return True"]), namespace)  # noqa: S102 - generated above
    check, full = namespace["check"], namespace["full"]
    assert check(scope([2.0] * 4)) == -1 and full(scope([2.0] * 4)) is True
    for i in range(4):
        changed = [2.0] * 4
        changed[i] = 3.0
        assert check(scope(changed)) != -1 and full(scope(changed)) is False, i
        changed[i] = 2  # an int: the type half of the guard
        assert check(scope(changed)) != -1 and full(scope(changed)) is False, i


# ---- the import diet: a warm load imports the read side of our package, nothing a compile needs ----

#: every module of ours a warm ``tcb.load`` + first call with the eager inner compiler may import (in a
#: process that imported transformers, hence Dynamo): what only a compile, a miss, a write, a merge, a
#: graph break, a rare codec kind or the CLI needs lives in modules outside this list
WARM_PATH_MODULES = frozenset("torchair_cached_backend" + m for m in (
    "", ".preload", ".options", ".registry", ".stats", ".logs", ".environment", ".fingerprint", ".key", ".code_codec",
    ".fs_security", ".store_layout", ".store_backend", ".store", ".graph_load",
    ".compilers", ".compilers.eager",
    ".bypass", ".bypass.loader", ".bypass.program", ".bypass.replay", ".bypass.sources",
    ".bypass.dynamo_stub", ".bypass.guard_runtime", ".bypass.world_state", ".bypass.shared_load",
))
#: cold-side modules every warm load used to import (each split off a module a warm load still needs, or
#: left holding only the compile side: CachedGraph, Artifact and load_code moved to modules a load imports);
#: ``torchair_config`` is not among them: a load does not import it, ``cache_compile`` does (``preload.DROP_IN``)
COLD_SIDE_MODULES = tuple("torchair_cached_backend." + m for m in (
    "backend", "key_graph", "store_write", "store_backend_write", "store_faults", "fs_write",
    "code_decode_rare", "compilers.eager_compile", "bypass.loader_miss", "bypass.loader_resume",
    "bypass.loader_callees", "bypass.replay_resume", "bypass.program_merge", "bypass.sources_capture",
    "compilers.base", "compilers.pycode", "bypass.replay_fallback",
))

LLAMA = """
import sys
import torch, transformers                # transformers imports Dynamo, before our package
import hf_tiny
"""


@pytest.fixture(scope="module")
def llama_warm(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama_diet"))
    run_python(LLAMA + textwrap.dedent(f"""
        import torchair_cached_backend as tcb
        model, inputs = hf_tiny.build("llama")
        f = torch.compile(model, backend="npu_cached", options={{"cache_dir": {d!r}, "compiler": "eager"}})
        with torch.no_grad():
            f(**inputs)
        emit({{}})
        """))
    warm = {}
    for route, make in (("load", f"tcb.load(model, {d!r}, compiler='eager', fallback=False)"),
                        ("backend", f"torch.compile(model, backend='npu_cached', "
                                    f"options={{'cache_dir': {d!r}, 'compiler': 'eager'}})")):
        warm[route] = run_python(LLAMA + textwrap.dedent(f"""
            model, inputs = hf_tiny.build("llama")
            with torch.no_grad():
                expected = model(**inputs).logits
                before = set(sys.modules)
                import torchair_cached_backend as tcb
                f = {make}
                got = f(**inputs).logits
            imported = sorted(m for m in set(sys.modules) - before if m.startswith("torchair_cached_backend"))
            from child_helpers import frames
            emit({{"ok": bool(torch.allclose(got, expected, atol=1e-5)), "imported": imported, "frames": frames(),
                   "stats": tcb.stats().as_dict()}})
            """), env=NO_PRELOAD)
    return warm


def test_warm_load_imports_only_the_warm_path_modules(llama_warm):
    # exactly the list: a module that comes back fails, and so does one the list keeps after it left
    out = llama_warm["load"]
    assert out["ok"] and out["frames"] == 0 and out["stats"]["bypass_loads"] >= 1, out
    assert "torchair_cached_backend.bypass.loader" in out["imported"], out  # the load happened in this process
    assert set(out["imported"]) <= WARM_PATH_MODULES, sorted(set(out["imported"]) - WARM_PATH_MODULES)
    assert set(out["imported"]) == WARM_PATH_MODULES, sorted(WARM_PATH_MODULES - set(out["imported"]))
    assert not set(COLD_SIDE_MODULES) & set(out["imported"]), out["imported"]


@pytest.mark.parametrize("family", ["bert", "mixtral"])
def test_a_warm_load_of_these_families_imports_only_the_warm_path(tmp_path, family):
    # BERT's forward traces `inspect`: its version (the interpreter's) was looked up through the capture
    # side (sources_capture); MoE routing (Mixtral, Qwen3-MoE, DeepSeek-V3) holds torch.ops.aten constants,
    # whose decoders sat in code_decode_rare: each a module imported inside every such warm load
    d = str(tmp_path)
    output = "last_hidden_state" if family == "bert" else "logits"
    run_python(LLAMA + textwrap.dedent(f"""
        model, inputs = hf_tiny.build({family!r})
        with torch.no_grad():
            torch.compile(model, backend="npu_cached", options={{"cache_dir": {d!r}, "compiler": "eager"}})(**inputs)
        emit({{}})
        """))
    out = run_python(LLAMA + textwrap.dedent(f"""
        model, inputs = hf_tiny.build({family!r})
        with torch.no_grad():
            before = set(sys.modules)
            import torchair_cached_backend as tcb
            f = tcb.load(model, {d!r}, compiler="eager", fallback=False)
            ok = bool(torch.allclose(f(**inputs).{output}, model(**inputs).{output}, atol=1e-5))
        imported = sorted(m for m in set(sys.modules) - before if m.startswith("torchair_cached_backend"))
        import json, glob
        traced = [t for m in glob.glob({d!r} + "/programs/*/manifest.json")
                  for f in json.load(open(m))["program"]["frames"].values() for t in f["traced"]]
        emit({{"ok": ok, "imported": imported, "traced": traced}})
        """), env=NO_PRELOAD)
    assert out["ok"], out
    if family == "bert":  # the case holds here
        python = f"python {sys.version_info[0]}.{sys.version_info[1]}"
        assert {"library": "inspect", "version": python} in out["traced"], out["traced"]
    assert set(out["imported"]) == WARM_PATH_MODULES, sorted(set(out["imported"]) ^ WARM_PATH_MODULES)


#: what the backend route adds to a load's modules: the hook, the frame-cache install and its argument
#: binding, mode mapping, the trace-time id() rule its callbacks enter
ROUTE_MODULES = frozenset("torchair_cached_backend.bypass." + m for m in ("capture_hook", "frame_install",
                                                                          "debug_wrapper", "signature", "code_names", "trace_ids")) | {
    "torchair_cached_backend.compile_mode"}
#: the C++ guard tree for guards="call", with TCB_GUARD_TREE=1 only
GUARD_TREE = "torchair_cached_backend.bypass.guard_tree"


def test_warm_backend_route_imports_no_cold_side(llama_warm):
    # torch.compile(model, backend="npu_cached") on a warm cache replays from Dynamo's frame cache:
    # the backend itself (compile side) is never imported, nor a write, a miss or a merge
    out = llama_warm["backend"]
    assert out["ok"] and out["frames"] == 0, out
    assert "torchair_cached_backend.bypass.frame_install" in out["imported"], out
    allowed = WARM_PATH_MODULES | ROUTE_MODULES
    imported = set(out["imported"]) - {GUARD_TREE}
    assert imported <= allowed, sorted(imported - allowed)
    assert imported == allowed, sorted(allowed - imported)
    assert not set(COLD_SIDE_MODULES) & set(out["imported"]), out["imported"]


def test_split_off_names_stay_importable_where_they_were():
    # the cold side moved to modules of its own; each name is still served by its old module (lazily)
    import importlib

    moved = {
        "key": ("key_graph", ("compute_key", "graph_factors", "runtime_state_factors", "training_factors")),
        "store": ("store_write", ("default_lock_timeout",)),
        "fs_security": ("fs_write", ("write_at", "ensure_dir", "read_private")),
        "backend": ("graph_load", ("load_graph", "graph_store")),
        "bypass.loader": ("bypass.loader_miss", ("_why_missing", "_compiling_stand_in")),
        "bypass.replay": ("bypass.replay_resume", ("ResumeDispatch", "ResumeFactory", "ResumeRouter")),
        "bypass.program": ("bypass.program_merge", ("merge_programs",)),
        "bypass.sources": ("bypass.sources_capture", ("describe_traced", "is_library_file")),
        # the other way round: the warm side moved to a module a warm load imports anyway
        "compilers.base": ("compilers", ("Artifact",)),
        "compilers.pycode": ("compilers", ("load_code", "SUFFIX")),
    }
    for old, (new, names) in moved.items():
        before = importlib.import_module(f"torchair_cached_backend.{old}")
        after = importlib.import_module(f"torchair_cached_backend.{new}")
        for name in names:
            assert getattr(before, name) is getattr(after, name), (old, new, name)
    from torchair_cached_backend import code_codec
    from torchair_cached_backend.code_decode_rare import RARE_DECODERS
    from torchair_cached_backend.store import _UNWRITABLE, report, write_blocker  # noqa: F401

    assert code_codec.decode_value({"kind": "range", "start": 1, "stop": 7, "step": 2}) == range(1, 7, 2)
    assert not set(RARE_DECODERS) & set(code_codec._DECODERS)
    with pytest.raises(code_codec.CodecError, match="unknown descriptor kind"):
        code_codec.decode_value({"kind": "no-such-kind"})
