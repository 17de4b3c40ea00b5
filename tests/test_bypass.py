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
            shapes = [(2, 16), (3, 9), (1, 5), (4, 30), (5, 1)]
            with torch.no_grad():
                ok = {{str(s): same(f(i), m(i)) for s in shapes for i in [torch.randint(0, 100, s)]}}
            emit({{"ok": ok, "stats": stats(), "frames": frames(), "dynamo": "torch._dynamo" in sys.modules}})
            """
        )
    )
    assert all(warm["ok"].values()), warm["ok"]
    assert (warm["stats"]["bypass_loads"], warm["stats"]["hits"], warm["stats"]["misses"]) == (1, 1, 0)
    assert warm["frames"] == 0 and warm["dynamo"] is False


def test_static_entry_input_check_and_grad_mode(run, cache_dir):
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
    warm = run(
        child(
            f"""
            from models import build
            from torchair_cached_backend.bypass.signature import GradModeError, InputSignatureError
            m, x = build("mlp")
            f = tcb.load(m, {cache_dir!r}, compiler="eager", fallback=False)
            errors = {{}}
            def attempt(name, fn):
                try:
                    fn()
                    errors[name] = None
                except Exception as e:
                    errors[name] = [type(e).__name__, str(e), isinstance(e, (InputSignatureError, GradModeError))]
            with torch.no_grad():
                ok = same(f(x), m(x))
                attempt("shape", lambda: f(torch.randn(7, 16)))
                attempt("dtype", lambda: f(x.double()))
                attempt("nargs", lambda: f(x, x))
            attempt("grad", lambda: f(x))  # captured under no_grad, called with grad enabled
            emit({{"ok": ok, "errors": errors, "frames": frames()}})
            """
        )
    )
    assert warm["ok"]
    e = warm["errors"]
    assert e["shape"][0] == "InputSignatureError" and e["shape"][2], e["shape"]
    assert "'x'" in e["shape"][1] and "expected size 4 at dim 0" in e["shape"][1] and "(7, 16)" in e["shape"][1]
    assert e["dtype"][0] == "InputSignatureError" and "torch.float32" in e["dtype"][1] and "torch.float64" in e["dtype"][1]
    assert e["nargs"][0] == "InputSignatureError" and "takes 1 positional arguments but 2" in e["nargs"][1]
    assert e["grad"][0] == "GradModeError", e["grad"]
    assert "grad enabled" in e["grad"][1] and "torch.no_grad()" in e["grad"][1]
    assert warm["frames"] == 0


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
    blob = os.path.join(cache_dir, "programs", key, "files", "f0.code")
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


def test_inductor_cold_then_warm(run, cache_dir, inductor_dir):
    env = {"TORCHINDUCTOR_CACHE_DIR": inductor_dir}
    code = child(
        f"""
        from models import build
        m, x = build("mlp")
        try:
            from torchair_cached_backend.compilers.inductor import InductorCompiler
        except (ImportError, NotImplementedError) as e:
            emit({{"skip": f"{{type(e).__name__}}: {{e}}"}}); sys.exit(0)
        try:
            if os.environ["PHASE"] == "cold":
                f = torch.compile(m, backend="npu_cached", options={{"cache_dir": {cache_dir!r}, "compiler": "inductor"}})
            else:
                f = tcb.load(m, {cache_dir!r}, compiler="inductor", fallback=False)
            with torch.no_grad():
                ok = same(f(x), m(x))
        except NotImplementedError as e:
            emit({{"skip": f"NotImplementedError: {{e}}"}}); sys.exit(0)
        emit({{"ok": ok, "stats": stats(), "frames": frames()}})
        """
    )
    cold = run(code, env=dict(env, PHASE="cold"))
    if "skip" in cold:
        pytest.skip(f"the inductor inner compiler is not ready: {cold['skip']}")
    assert cold["ok"] and cold["stats"]["misses"] == 1
    warm = run(code, env=dict(env, PHASE="warm"))
    if "skip" in warm:
        pytest.skip(f"the inductor inner compiler is not ready: {warm['skip']}")
    assert warm["ok"]
    assert (warm["stats"]["bypass_loads"], warm["stats"]["hits"], warm["stats"]["misses"]) == (1, 1, 0)
    assert warm["frames"] == 0
