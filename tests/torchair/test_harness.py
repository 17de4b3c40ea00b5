"""Baseline: what the *real* torchair does on CPU through our harness.

Every torchair interaction runs in a fresh subprocess (``run_script``): torchair
initialises a process-wide GE session, installs signal handlers and an atexit
hook, and caches compiled code per ``__code__`` -- none of which should leak
between tests or into the pytest process.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests.torchair_harness.run import run_script

pytestmark = pytest.mark.torchair

TIMEOUT = 180  # generous: the machine is shared; a healthy snippet takes ~5-10 s

ATEN_GRAPH = """
import torch
from torch.fx.experimental.proxy_tensor import make_fx

def aten_graph():
    x, y, w = torch.randn(2, 4), torch.randn(2, 4), torch.randn(4, 4)
    # torchair needs an aten-level graph that returns a tuple
    gm = make_fx(lambda x, y, w: (torch.matmul(x + y, w).relu(),))(x, y, w)
    return gm, [x, y, w]
"""


def _last_json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON result line in stdout:\n{stdout}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def ge_probe():
    """One fresh process: import facts, get_npu_backend() and a max-autotune get_code()."""
    proc = run_script(
        ATEN_GRAPH
        + """
import functools, json, sys
import torchair
from torchair.core import _torchair

cfg = torchair.CompilerConfig()
backend = torchair.get_npu_backend(compiler_config=cfg)
facts = {
    "file": torchair.__file__,
    "native_ok": hasattr(_torchair, "InitializeGraphEngine"),
    "torch_npu_loaded": "torch_npu" in sys.modules,
    "is_partial": isinstance(backend, functools.partial),
    "func": getattr(getattr(backend, "func", None), "__name__", None),
    "keywords": sorted(getattr(backend, "keywords", {})),
    "same_config": backend.keywords.get("compiler_config") is cfg,
    "decompositions_type": type(backend.keywords.get("decompositions")).__name__,
    "default_mode": cfg.mode.value,
}
gm, inputs = aten_graph()
code = torchair.get_compiler(torchair.CompilerConfig())(gm, inputs).get_code(extend_config={})
compile(code, "<torchair-ge>", "exec")  # must be valid Python
facts["code"] = code
print(json.dumps(facts))
""",
        timeout=TIMEOUT,
    )
    return _last_json(proc.stdout)


def test_real_wheel_torchair_is_imported(ge_probe, torchair_harness):
    assert os.path.realpath(ge_probe["file"]).startswith(os.path.realpath(torchair_harness.torchair_package))
    assert ge_probe["native_ok"], "torchair.core._torchair did not load (stub preload broken?)"
    assert not ge_probe["torch_npu_loaded"]
    assert ge_probe["default_mode"] == "max-autotune"


def test_get_npu_backend_is_a_partial(ge_probe):
    assert ge_probe["is_partial"]
    assert ge_probe["func"] == "_npu_backend"
    assert ge_probe["keywords"] == ["compiler_config", "decompositions"]
    assert ge_probe["same_config"]
    assert ge_probe["decompositions_type"] == "dict"


def test_max_autotune_get_code_is_ge_python(ge_probe):
    code = ge_probe["code"]
    assert "GeGraph(serialized_model_def=" in code
    assert 'local_compile_options["mode"] = "max-autotune"' in code
    assert "def kernel(*args)" in code
    assert "assert_size_stride(args[2], (4, 4), (4, 1))" in code


def test_aclgraph_codegen_with_fake_torch_npu():
    proc = run_script(
        ATEN_GRAPH
        + """
import json, sys
import torch, torchair
assert sys.modules["torch_npu"].__tcb_fake__ and torch.npu is sys.modules["torch_npu"].npu
gm, inputs = aten_graph()
codes = {}
for mode in ("reduce-overhead", "npugraph_ex"):
    cfg = torchair.CompilerConfig()
    cfg.mode = mode
    cfg.experimental_config.pattern_fusion_pass = False  # fusion patterns need torch.ops.npu kernels
    codes[mode] = torchair.get_compiler(cfg)(gm, inputs).get_code(extend_config={})
    compile(codes[mode], "<torchair-acl>", "exec")
print(json.dumps(codes))
""",
        timeout=TIMEOUT,
        fake_torch_npu=True,
    )
    codes = _last_json(proc.stdout)
    for mode, code in codes.items():
        assert "AclGraph(fx_forward=forward" in code, mode
        assert "def kernel(" in code, mode
        assert "GeGraph(" not in code, mode


CACHE_MODEL = """
import json, os
import torch, torchair
from torchair.inference._cache_compiler import CompiledModel, ModelCacheSaver

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.cached = torchair.inference.cache_compile(self.prompt)  # dynamic=True, max-autotune

    def forward(self, x):
        return self.cached(x)

    def prompt(self, x):
        return self.linear(x) + x

model = Model()
cache_bin = CompiledModel.get_cache_bin(model.prompt)
"""


def test_cache_compile_round_trip(tmp_path):
    env = {"TORCHAIR_CACHE_HOME": str(tmp_path / "cache")}
    first = run_script(
        CACHE_MODEL
        + """
existed_before = os.path.exists(cache_bin)
out = model(torch.ones(3, 2))
created = os.path.exists(cache_bin)
model(torch.ones(4, 2))  # dynamic: a new shape must not recompile (which would delete the cache)
print(json.dumps({"cache_bin": cache_bin, "existed_before": existed_before, "created": created,
                  "kept": os.path.exists(cache_bin), "shape": list(out.shape)}))
""",
        timeout=TIMEOUT,
        shim=True,
        env=env,
    )
    res = _last_json(first.stdout)
    assert res["cache_bin"].startswith(str(tmp_path / "cache") + os.sep)
    assert not res["existed_before"]
    assert res["created"] and res["kept"]
    assert res["shape"] == [3, 2]

    readable = tmp_path / "readable.py"
    second = run_script(
        CACHE_MODEL
        + textwrap.dedent(f"""
        def must_not_compile(*args, **kwargs):
            raise AssertionError("cache miss: ModelCacheSaver was called")
        ModelCacheSaver.__call__ = must_not_compile
        out = model(torch.ones(5, 2))  # a new instance in a new process: served from the cache
        torchair.inference.readable_cache(cache_bin, print_output=False, file={str(readable)!r})
        print(json.dumps({{"cache_bin": cache_bin, "shape": list(out.shape)}}))
    """),
        timeout=TIMEOUT,
        shim=True,
        env=env,
    )
    res2 = _last_json(second.stdout)
    assert res2["cache_bin"] == res["cache_bin"]
    assert res2["shape"] == [5, 2]
    text = readable.read_text()
    assert "ModelCacheMeta(name='Model.prompt(x)'" in text
    assert "def kernel(" in text


def test_run_script_reports_failures_and_kills_hung_children():
    with pytest.raises(AssertionError, match=r"exit code 3[\s\S]*boom-on-stderr"):
        run_script("import sys; sys.stderr.write('boom-on-stderr'); sys.exit(3)", timeout=TIMEOUT)
    # SIGTERM ignored, like torchair's handlers: only SIGKILL stops it
    with pytest.raises(AssertionError, match=r"timed out after 4s and was killed"):
        run_script(
            """
            import signal, time
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            time.sleep(600)
        """,
            timeout=4,
        )
