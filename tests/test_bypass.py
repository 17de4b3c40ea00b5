"""The guard-bypass loader: ``torch.compile(backend="npu_cached")`` in one fresh
process, ``torchair_cached_backend.load(...)`` in another.

Hits are proven by ``torchair_cached_backend.stats()`` and by Dynamo's own frame
counters (or by ``torch._dynamo`` never being imported), never by timing.
Almost everything uses the ``eager`` inner compiler: it is the FX graph's own
Python code, so the tests are about the bypass, not about a compiler.
"""

from __future__ import annotations

import os
import textwrap

import pytest
from models import EDITABLE_SOURCE

#: shared by every child process of this file
PRELUDE = textwrap.dedent(
    """
    import dataclasses, logging, os, sys
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, same, stats, programs
    """
)


def child(code: str) -> str:
    return PRELUDE + textwrap.dedent(code)


def entries(root: str, kind: str) -> list[str]:
    d = os.path.join(root, kind)
    return sorted(k for k in os.listdir(d) if not k.startswith(".")) if os.path.isdir(d) else []


# ---------------------------------------------------------------------------
# every model kind: cold compile in one process, replay in another
# ---------------------------------------------------------------------------

#: model -> number of graphs Dynamo makes of it
MODELS = {"mlp": 1, "gpt": 1, "conv": 1, "helper": 1, "constants": 1, "dataclass": 1, "graph_break": 2}


def test_models_cold_then_warm_replay(run, cache_dir):
    cold = run(
        child(
            f"""
            from models import build
            out = {{}}
            with torch.no_grad():
                for name in {list(MODELS)!r}:
                    m, x = build(name)
                    c = torch.compile(m, backend="npu_cached",
                                      options={{"cache_dir": os.path.join({cache_dir!r}, name), "compiler": "eager"}})
                    out[name] = same(c(x), m(x))
            emit({{"same": out, "stats": stats(), "frames": frames()}})
            """
        )
    )
    assert all(cold["same"].values()), cold["same"]
    assert cold["stats"]["misses"] == sum(MODELS.values())
    assert cold["frames"] == sum(MODELS.values())  # the resume frame of graph_break counts too
    for name in MODELS:
        assert len(entries(os.path.join(cache_dir, name), "programs")) == 1, name

    warm = run(
        child(
            f"""
            from models import build
            out, dynamo_imported = {{}}, {{}}
            with torch.no_grad():
                for name in {list(MODELS)!r}:  # graph_break last: its forward itself imports torch._dynamo
                    m, x = build(name)
                    f = tcb.load(m, os.path.join({cache_dir!r}, name), compiler="eager", fallback=False)
                    got = f(x)
                    out[name] = [same(got, m(x)), type(got).__name__]
                    dynamo_imported[name] = "torch._dynamo" in sys.modules
            emit({{"same": out, "stats": stats(), "frames": frames(), "dynamo": dynamo_imported, "logs": LOGS}})
            """
        )
    )
    assert all(v[0] for v in warm["same"].values()), warm["same"]
    assert warm["same"]["dataclass"][1] == "Output"
    assert warm["same"]["constants"][1] == "tuple"
    s = warm["stats"]
    assert (s["bypass_loads"], s["hits"], s["misses"], s["uncached"]) == (len(MODELS), sum(MODELS.values()), 0, 0), s
    assert warm["frames"] == 0, "the warm process compiled a frame"
    # no model but graph_break (which calls torch._dynamo.graph_break() itself) imports Dynamo
    assert not any(v for k, v in warm["dynamo"].items() if k != "graph_break"), warm["dynamo"]
    # the resume function ran in its transformed form: its graph was loaded from the cache
    assert not any("runs eagerly" in line for line in warm["logs"]), warm["logs"]


def cache_static_mlp(run, cache_dir: str) -> None:
    """Cold process: the MLP benchmark model, one static eager graph, cached in ``cache_dir``."""
    run(
        child(
            f"""
            from models import build
            m, x = build("mlp")
            c = torch.compile(m, backend="npu_cached", dynamic=False,
                              options={{"cache_dir": {cache_dir!r}, "compiler": "eager"}})
            with torch.no_grad():
                c(x)
            emit({{}})
            """
        )
    )


# ---------------------------------------------------------------------------
# shapes, dtypes and grad mode
# ---------------------------------------------------------------------------


def test_dynamic_entry_serves_many_shapes(run, cache_dir):
    cold = run(
        child(
            f"""
            from models import build
            m, _ = build("gpt")
            c = torch.compile(m, backend="npu_cached", dynamic=True,
                              options={{"cache_dir": {cache_dir!r}, "compiler": "eager"}})
            with torch.no_grad():
                ok = [same(c(i), m(i)) for i in (torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (3, 9)))]
            emit({{"ok": ok, "frames": frames()}})
            """
        )
    )
    assert cold["ok"] == [True, True]
    assert cold["frames"] == 1  # one dynamic graph, no recompile
    assert len(entries(cache_dir, "graphs")) == 1 and len(entries(cache_dir, "programs")) == 1

    warm = run(
        child(
            f"""
            from models import build
            m, _ = build("gpt")
            f = tcb.load(m, {cache_dir!r}, compiler="eager", fallback=False)
            shapes = [(2, 16), (3, 9), (4, 30)]
            with torch.no_grad():
                ok = {{str(s): same(f(i), m(i)) for s in shapes for i in [torch.randint(0, 100, s)]}}
                replayed = frames() == 0 and "torch._dynamo" not in sys.modules
                ok.update({{str(s): same(f(i), m(i)) for s in [(1, 5), (5, 1)] for i in [torch.randint(0, 100, s)]}})
            emit({{"ok": ok, "stats": stats(), "frames": frames(), "replayed": replayed}})
            """
        )
    )
    assert all(warm["ok"].values()), warm["ok"]
    # sizes >= 2 replay the one dynamic graph; a size-1 dim is specialized by Dynamo (0/1 specialization),
    # so those calls compile a variant of their own instead of replaying a graph that assumed >= 2
    assert (warm["stats"]["bypass_loads"], warm["stats"]["hits"]) == (1, 1)
    assert warm["replayed"] and warm["stats"]["fallbacks"] == 1 and warm["frames"] >= 1


def test_static_entry_other_inputs_and_grad_mode_compile_never_stale(run, cache_dir):
    """A static entry called with another shape, dtype or grad mode is served by a
    fresh compile (and the program gains that variant); a call the function cannot
    take raises the function's own TypeError. Before guards, these raised
    InputSignatureError / GradModeError from a warm start."""
    cache_static_mlp(run, cache_dir)
    code = child(
        f"""
        from models import build
        m, x = build("mlp")
        f = tcb.load(m, {cache_dir!r}, compiler="eager", fallback=False)
        with torch.no_grad():
            ok = {{"same": same(f(x), m(x))}}
            replayed = frames() == 0
            y = torch.randn(7, 16)
            ok["shape"] = same(f(y), m(y))
            if os.environ.get("PHASE") == "first":
                m.double()  # parameters and input change dtype together
                ok["dtype"] = same(f(x.double()), m(x.double()))
                m.float()
        if os.environ.get("PHASE") == "first":
            ok["grad"] = same(f(x), m(x))  # captured under no_grad, called with grad enabled
        try:
            f(x, x)
            nargs = None
        except TypeError as e:
            nargs = [type(e).__name__, str(e)]
        emit({{"ok": ok, "replayed": replayed, "nargs": nargs, "stats": stats(), "logs": LOGS}})
        """
    )
    warm = run(code, env={"PHASE": "first"})
    assert all(warm["ok"].values()), warm["ok"]
    assert warm["replayed"] and warm["stats"]["bypass_loads"] == 1
    assert warm["stats"]["fallbacks"] == 1, warm["stats"]  # one lazily compiled fallback serves the rest
    assert any("no cached variant fits" in line and "[4, 16]" in line and "[7, 16]" in line for line in warm["logs"]), [
        line for line in warm["logs"] if "variant" in line]
    assert warm["nargs"][0] == "InputSignatureError" and "positional argument" in warm["nargs"][1], warm["nargs"]
    # the next warm start replays the new shape too: the first one merged its variant into the program
    again = run(code, env={"PHASE": "again"})
    assert all(again["ok"].values()), again["ok"]
    assert again["stats"]["fallbacks"] == 0 and again["stats"]["misses"] == 0 and again["stats"]["hits"] >= 2, again["stats"]


# ---------------------------------------------------------------------------
# staleness: edited source, changed parameters, corrupted blobs
# ---------------------------------------------------------------------------



def test_edited_helper_rebuilds(run, cache_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "editable_bp.py").write_text(EDITABLE_SOURCE)
    code = child(
        f"""
        sys.path.insert(0, {str(src)!r})
        import editable_bp
        from torchair_cached_backend.bypass.loader import CacheMiss
        m, x = editable_bp.Edited().eval(), torch.ones(2, 4)
        miss = None
        if os.environ.get("PHASE") == "warm":
            try:
                tcb.load(m, {cache_dir!r}, compiler="eager", fallback=False)
            except CacheMiss as e:
                miss = str(e)
        f = tcb.load(m, {cache_dir!r}, compiler="eager")  # falls back to torch.compile on a miss
        with torch.no_grad():
            y = f(x)
            ok = same(y, m(x))
        emit({{"ok": ok, "y": y.tolist(), "miss": miss, "stats": stats(), "frames": frames(), "logs": LOGS}})
        """
    )
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    cold = run(code, env=dict(env, PHASE="cold"))
    assert cold["ok"] and cold["stats"]["misses"] == 1 and cold["frames"] == 1

    (src / "editable_bp.py").write_text(EDITABLE_SOURCE.replace("x * 2.0", "x * 3.0 + 1.0"))
    warm = run(code, env=dict(env, PHASE="warm"))
    assert warm["miss"] and "helper" in warm["miss"] and "edited" in warm["miss"], warm["miss"]
    assert warm["ok"], "the warm process must run the edited helper"
    assert warm["y"] != cold["y"]
    assert warm["stats"]["bypass_loads"] == 0 and warm["stats"]["misses"] == 1 and warm["frames"] == 1
    assert any("edited" in line for line in warm["logs"]), warm["logs"]


def test_changed_parameter_shape_rebuilds(run, cache_dir):
    code = child(
        f"""
        from torchair_cached_backend.bypass.loader import CacheMiss

        class Proj(torch.nn.Module):
            def __init__(self, n):
                super().__init__()
                self.w = torch.nn.Parameter(torch.randn(n, 4))

            def forward(self, x):
                return x @ self.w.t()

        torch.manual_seed(0)
        m, x = Proj(int(os.environ["N"])), torch.ones(2, 4)
        try:
            tcb.load(m, {cache_dir!r}, compiler="eager", fallback=False)
            miss = None
        except CacheMiss as e:
            miss = str(e)
        f = tcb.load(m, {cache_dir!r}, compiler="eager")
        with torch.no_grad():
            y = f(x)
            ok = same(y, m(x))
        emit({{"ok": ok, "shape": list(y.shape), "miss": miss, "stats": stats(), "frames": frames()}})
        """
    )
    cold = run(code, env={"N": "4"})
    assert cold["ok"] and cold["shape"] == [2, 4] and cold["frames"] == 1
    warm = run(code, env={"N": "6"})
    assert warm["miss"] and "param:w" in warm["miss"] and "[4, 4]" in warm["miss"] and "[6, 4]" in warm["miss"]
    assert warm["ok"] and warm["shape"] == [2, 6]
    assert warm["stats"]["bypass_loads"] == 0 and warm["frames"] == 1


STATE_CHANGES_CHILD = """
from torchair_cached_backend.bypass.loader import CacheMiss
WARM = os.environ["PHASE"] == "warm"


class HalfProj(torch.nn.Module):  # parameter dtype: .half() before the warm start
    def __init__(self):
        super().__init__()
        self.weight_q = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x.to(self.weight_q.dtype) @ self.weight_q.t()


class RenamedBuffer(torch.nn.Module):  # a buffer renamed; the forward weighs buffers by their name
    def __init__(self, name):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer(name, torch.full((4,), 0.5))

    def forward(self, x):
        h = self.lin(x)
        for name, b in self.named_buffers():
            h = h + b * len(name)
        return h


class AddedBuffer(torch.nn.Module):  # a buffer added; the forward adds every buffer
    def __init__(self, extra):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("offset", torch.full((4,), 0.5))
        if extra:
            self.register_buffer("extra_bias", torch.full((4,), 2.0))

    def forward(self, x):
        h = self.lin(x)
        for b in self.buffers():
            h = h + b
        return h


class OnMeta(torch.nn.Module):  # device: only the CPU exists here, so the warm copy moves to "meta"
    def __init__(self):
        super().__init__()
        self.proj_m = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj_m(x).relu()


def build(name):
    torch.manual_seed(0)
    if name == "half":
        m = HalfProj()
        return m.half() if WARM else m
    if name == "renamed":
        return RenamedBuffer("offset_new" if WARM else "offset_old")
    if name == "added":
        return AddedBuffer(extra=WARM)
    m = OnMeta()
    return m.to("meta") if WARM else m


x = torch.randn(2, 4)
res = {}
for name in ("half", "renamed", "added", "meta"):
    m, d = build(name), os.path.join(ROOT, name)
    before = frames()
    miss = None
    if WARM:
        try:
            tcb.load(m, d, compiler="eager", fallback=False)
        except CacheMiss as e:
            miss = str(e)
        if name == "meta":  # a meta module computes no values: the load-time check is the point
            res[name] = {"miss": miss}
            continue
        f = tcb.load(m, d, compiler="eager")  # on a miss: compiles (and rebuilds the cache)
    else:
        f = torch.compile(m, backend="npu_cached", options={"cache_dir": d, "compiler": "eager"})
    with torch.no_grad():
        y = f(x)
        res[name] = {"miss": miss, "ok": same(y, m(x)), "dtype": str(y.dtype), "compiled": frames() - before}
emit({"res": res, "stats": stats()})
"""


def test_changed_parameter_dtype_device_and_buffers_rebuild(run, tmp_path):
    """Staleness of the module's tensors beyond shapes: a parameter's dtype (``.half()``), its
    device (``meta``: the only other device here), a renamed and an added buffer. Each is a
    load-time miss naming the tensor, then a compile whose output is the changed module's."""
    code = child(f"ROOT = {str(tmp_path / 'cache')!r}\n" + STATE_CHANGES_CHILD)
    cold = run(code, env={"PHASE": "cold"})
    for name in ("half", "renamed", "added", "meta"):
        assert cold["res"][name]["ok"] and cold["res"][name]["compiled"] == 1, (name, cold["res"][name])
    warm = run(code, env={"PHASE": "warm"})
    r = warm["res"]
    # what each miss must name: every group, by one of its words
    for name, groups in {
        "half": [("weight_q",), ("float16",)],
        "renamed": [("offset_new", "offset_old")],
        "added": [("extra_bias",)],
        "meta": [("proj_m",), ("meta",)],
    }.items():
        miss = r[name]["miss"]
        assert miss is not None, f"{name}: the changed module was replayed from the cache"
        assert all(any(w in miss for w in g) for g in groups), f"{name}: the miss must name {groups}: {miss}"
    for name in ("half", "renamed", "added"):
        assert r[name]["ok"] and r[name]["compiled"] == 1, (name, r[name])
    assert r["half"]["dtype"] == "torch.float16"
    assert warm["stats"]["bypass_loads"] == 0, warm["stats"]


def test_corrupted_program_blob_is_quarantined_and_rebuilt(run, cache_dir):
    code = child(
        f"""
        from models import build
        from torchair_cached_backend.bypass.loader import CacheMiss
        m, x = build("mlp")
        miss = None
        if os.environ.get("PHASE") == "warm":
            try:
                tcb.load(m, {cache_dir!r}, compiler="eager", fallback=False)
            except CacheMiss as e:
                miss = str(e)
        f = tcb.load(m, {cache_dir!r}, compiler="eager")
        with torch.no_grad():
            ok = same(f(x), m(x))
        emit({{"ok": ok, "miss": miss, "stats": stats(), "frames": frames(), "logs": LOGS}})
        """
    )
    cold = run(code, env={"PHASE": "cold"})
    assert cold["ok"]
    (key,) = entries(cache_dir, "programs")
    files_dir = os.path.join(cache_dir, "programs", key, "files")
    (name,) = [n for n in os.listdir(files_dir) if n.endswith(".code") and not n.startswith("resume-")]
    blob = os.path.join(files_dir, name)
    data = bytearray(open(blob, "rb").read())
    data[len(data) // 2] ^= 0xFF
    os.chmod(blob, 0o600)
    open(blob, "wb").write(bytes(data))

    warm = run(code, env={"PHASE": "warm"})
    assert warm["miss"] is not None
    assert warm["stats"]["quarantined"] == 1 and warm["stats"]["bypass_loads"] == 0
    assert any("sha256" in line for line in warm["logs"]), warm["logs"]
    assert warm["ok"] and warm["frames"] == 1  # rebuilt by compiling
    quarantined = os.listdir(os.path.join(cache_dir, "quarantine"))
    assert any(q.startswith("programs-") for q in quarantined), quarantined
    # the rebuilt program is a fresh, intact entry under the same key
    assert entries(cache_dir, "programs") == [key]
    assert open(blob, "rb").read() != bytes(data)

    again = run(code, env={"PHASE": "warm"})
    assert again["miss"] is None and again["stats"]["bypass_loads"] == 2 and again["frames"] == 0


# ---------------------------------------------------------------------------
# one real compiler
# ---------------------------------------------------------------------------


def test_inductor_cold_then_warm(run, cache_dir, tmp_path):
    """The end-to-end bypass with Inductor kernels, strict: the warm process gets an EMPTY
    Inductor cache dir (never the cold run's), must not import torch._dynamo or
    torch._inductor, compiles nothing and writes nothing there. No skip: the Inductor inner
    compiler is part of the product."""
    cold_dir, warm_dir = tmp_path / "inductor_cold", tmp_path / "inductor_warm"
    cold_dir.mkdir()
    warm_dir.mkdir()
    code = child(
        f"""
        from models import build
        m, x = build("mlp")
        if os.environ["PHASE"] == "cold":
            f = torch.compile(m, backend="npu_cached", options={{"cache_dir": {cache_dir!r}, "compiler": "inductor"}})
        else:
            f = tcb.load(m, {cache_dir!r}, compiler="inductor", fallback=False)
        with torch.no_grad():
            y = f(x)
            imported = {{"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules}}
            ok = same(y, m(x))
        emit({{"ok": ok, "stats": stats(), "frames": frames(), "imported": imported, "logs": LOGS}})
        """
    )
    cold = run(code, env={"TORCHINDUCTOR_CACHE_DIR": str(cold_dir), "PHASE": "cold"})
    assert cold["ok"] and cold["stats"]["misses"] == 1 and cold["frames"] == 1
    assert cold["stats"]["uncached"] == 0, "the Inductor graph must be cached, not compiled uncached"
    warm = run(code, env={"TORCHINDUCTOR_CACHE_DIR": str(warm_dir), "PHASE": "warm"})
    assert warm["ok"]
    assert (warm["stats"]["bypass_loads"], warm["stats"]["hits"], warm["stats"]["misses"]) == (1, 1, 0), warm["stats"]
    assert warm["frames"] == 0
    assert warm["imported"] == {"dynamo": False, "inductor": False}, warm["imported"]
    written = [os.path.join(r, f) for r, _, fs in os.walk(warm_dir) for f in fs]
    assert written == [], f"the warm process wrote into its empty Inductor cache dir: {written[:5]}"


# ---------------------------------------------------------------------------
# per-call check of a dynamic entry, compiler="auto", check_inputs=False
# ---------------------------------------------------------------------------


def test_dynamic_entry_per_call_selects_variant_or_compiles(run, cache_dir):
    """A dynamic entry (two variants: float32 and float64) called warm: inputs of the cached
    variants are served by them without Dynamo; a dtype, a rank or a non-tensor argument type
    no variant was made for is compiled - never a crash, never another variant's answer."""
    code = child(
        f"""
        def scaled_sum(x, k):
            return (x * 2.0).sum(-1) + k

        def call(f, x, k):
            try:
                y = f(x, k)
            except Exception as e:
                return f"{{type(e).__name__}}: {{e}}"
            want = scaled_sum(x, k)
            return same(y, want) and y.dtype == want.dtype or f"got {{y.dtype}} {{tuple(y.shape)}}, want {{want.dtype}} {{tuple(want.shape)}}"

        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            if os.environ["PHASE"] == "cold":
                f = torch.compile(scaled_sum, backend="npu_cached", dynamic=True,
                                  options={{"cache_dir": {cache_dir!r}, "compiler": "eager"}})
                ok = {{"float32": call(f, torch.randn(4, 8, generator=g), 1),
                       "float64": call(f, torch.randn(3, 8, generator=g, dtype=torch.float64), 2)}}
                emit({{"ok": ok, "frames": frames(), "programs": programs({cache_dir!r})}})
            else:
                f = tcb.load(scaled_sum, {cache_dir!r}, compiler="eager", fallback=False)
                ok = {{"float32": call(f, torch.randn(6, 5, generator=g), 3),
                       "float64": call(f, torch.randn(2, 7, generator=g, dtype=torch.float64), 4)}}
                served = {{"frames": frames(), "dynamo": "torch._dynamo" in sys.modules}}
                ok["bfloat16"] = call(f, torch.randn(5, 8, generator=g).bfloat16(), 1)
                ok["rank3"] = call(f, torch.randn(2, 3, 8, generator=g), 1)
                ok["float k"] = call(f, torch.randn(4, 8, generator=g), 1.5)
                ok["float32 again"] = call(f, torch.randn(9, 3, generator=g), 5)
                emit({{"ok": ok, "served": served, "stats": stats()}})
        """
    )
    cold = run(code, env={"PHASE": "cold"})
    assert cold["ok"] == {"float32": True, "float64": True}, cold["ok"]
    assert cold["frames"] == 2 and len(cold["programs"]) == 1  # one program, two variants
    warm = run(code, env={"PHASE": "warm"})
    bad = {k: v for k, v in warm["ok"].items() if v is not True}
    assert not bad, f"calls not served correctly: {bad}"
    assert warm["served"] == {"frames": 0, "dynamo": False}, "the cached variants must serve their inputs"
    assert warm["stats"]["bypass_loads"] == 1


def test_compiler_auto_is_inductor_here(run, tmp_path):
    """``compiler="auto"`` (cache_compile's default) resolves to Inductor on a machine without an
    NPU: the entry it writes is the Inductor one (an explicit ``compiler="inductor"`` load replays
    it, ``"eager"`` does not), and its warm start imports neither Dynamo nor Inductor."""
    from torchair_cached_backend.environment import npu_available

    if npu_available():  # there, "auto" means torchair
        pytest.skip("an NPU is present: compiler='auto' resolves to torchair")
    empty = tmp_path / "inductor_warm"
    empty.mkdir()
    code = child(
        f"""
        from models import build
        from torchair_cached_backend.bypass.loader import CacheMiss
        m, x = build("mlp")
        c = tcb.cache_compile(m.forward, cache_dir={str(tmp_path / "cache")!r})  # compiler="auto"
        with torch.no_grad():
            ok = same(c(x), m(x))
            res = {{"ok": ok, "stats": stats(), "frames": frames(), "logs": list(LOGS),
                    "imported": ["torch._dynamo" in sys.modules, "torch._inductor" in sys.modules]}}
            if os.environ["PHASE"] == "warm":
                f = tcb.load(m, c.cache_path, compiler="inductor", fallback=False)
                res["inductor_load"] = same(f(x), m(x))
                try:
                    tcb.load(m, c.cache_path, compiler="eager", fallback=False)
                    res["eager_load"] = None
                except CacheMiss as e:
                    res["eager_load"] = str(e)
                res["after"] = stats()
        emit(res)
        """
    )
    cold = run(code, env={"PHASE": "cold"})
    assert cold["ok"] and cold["stats"]["misses"] == 1 and cold["frames"] == 1
    assert any("(inductor)" in line and "miss" in line for line in cold["logs"]), cold["logs"]
    warm = run(code, env={"PHASE": "warm", "TORCHINDUCTOR_CACHE_DIR": str(empty)})
    assert warm["ok"] and warm["frames"] == 0
    assert warm["stats"]["bypass_loads"] == 1 and warm["imported"] == [False, False], (warm["stats"], warm["imported"])
    assert any("bypass load" in line and "inductor" in line for line in warm["logs"]), warm["logs"]
    assert warm["inductor_load"] is True and warm["after"]["bypass_loads"] == 2
    assert warm["eager_load"] is not None, "an eager load must not replay the Inductor entry"


def test_check_inputs_false_skips_the_per_call_check(run, cache_dir):
    """``check_inputs=False``: the replay takes calls the per-call check would send elsewhere
    (another batch size on a static entry) straight to the cached graph - no check, no
    compile, no Dynamo (the eager graph of an MLP serves any batch size). A non-bool value
    is an OptionError naming the option."""
    import torchair_cached_backend as tcb

    with pytest.raises(tcb.OptionError, match="check_inputs"):
        tcb.load(lambda x: x, cache_dir, check_inputs="no")
    cache_static_mlp(run, cache_dir)
    warm = run(
        child(
            f"""
            from models import build
            m, x = build("mlp")
            f = tcb.load(m, {cache_dir!r}, compiler="eager", check_inputs=False, fallback=False)
            y7 = torch.randn(7, 16)
            with torch.no_grad():
                ok = [same(f(x), m(x)), same(f(y7), m(y7))]
            emit({{"ok": ok, "stats": stats(), "frames": frames(), "dynamo": "torch._dynamo" in sys.modules}})
            """
        )
    )
    assert warm["ok"] == [True, True]
    assert warm["frames"] == 0 and warm["dynamo"] is False
    assert warm["stats"]["bypass_loads"] == 1 and warm["stats"].get("fallbacks", 0) == 0, warm["stats"]
