"""Issue 18 (Inductor warm load): a warm ``tcb.load`` imports only the lean loader side of
the ``inductor`` inner compiler, and every kernel is dlopened from its own sealed memfd
copy of the verified bytes (each a library of its own, never a temp file).

Two small models with several C++ kernels each are compiled once in a cold process;
the warm checks run in one fresh process with an empty Inductor cache dir.
"""

from __future__ import annotations

import os
import shutil

import pytest
from subprocess_helpers import run_python

MODELS = """
import os
for k in [k for k in os.environ if k.startswith("TORCHINDUCTOR_")]:  # only the two this test sets
    if k not in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_VEC_ISA_OK"):
        del os.environ[k]
import torch

class A(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.norm, self.l2 = torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.l2(self.norm(self.l1(x)).relu()).softmax(-1) * 2

class B(torch.nn.Module):
    def forward(self, x):
        y = x.sin().cumsum(0) / x.cos().abs().sum()
        return torch.nn.functional.gelu(y).log_softmax(-1) + y.amax(0)

x = torch.arange(64.0).reshape(4, 16) / 64
"""

WARM = """
import os, sys
import torchair_cached_backend as tcb
from child_helpers import same
with torch.no_grad():
    ok = all(same(tcb.load(m, CACHE, compiler="inductor", fallback=False)(x), m(x)) for m in (A(), B()))
ours = {n: m for n, m in list(sys.modules.items()) if n.startswith("torchair_cached_backend") and m is not None}
cold_names = {"rewrite_wrapper", "compile_inference", "_compile_capturing", "parse_config_source"}
cold_side = sorted(n for n, m in ours.items() if cold_names & set(vars(m)))
maps = open("/proc/self/maps").read().splitlines()
memfd_inodes = {line.split()[4] for line in maps if "memfd:tcb_kernel" in line}
from torchair_cached_backend.compilers import inductor_runtime as rt
loaded = list(getattr(rt, "_LOADED", {}).items())  # (no such table before issue 18)
shared, refused = False, ""
if loaded:
    name, (module, blob) = loaded[0]
    digest = name[len("_tcb_kernel_"):-len(".kernel")]
    shared = rt.load_kernel(bytes(blob), digest) is module.kernel  # equal bytes: the same module
    other = next(b for _, (m, b) in loaded if b != blob)
    try:
        rt.load_kernel(other, digest)  # other bytes under that digest
    except ImportError as e:
        refused = str(e)
emit({"ok": ok, "cold_side": cold_side, "capture": [n for n in ("inductor_capture", "inductor_env_parse") if f"torchair_cached_backend.compilers.{n}" in sys.modules],
      "inductor": "torch._inductor" in sys.modules, "dynamo": "torch._dynamo" in sys.modules,
      "memfd_inodes": len(memfd_inodes), "temp_copies": sum("tcb_kernel_" in line for line in maps),
      "loaded": len(loaded), "shared": shared, "refused": refused,
      "inductor_files": [f for _, _, fs in os.walk(os.environ["TORCHINDUCTOR_CACHE_DIR"]) for f in fs]})
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("inductor_warm")
    cache = str(root / "cache")
    fill = (
        "import torchair_cached_backend as tcb\n"
        "with torch.no_grad():\n"
        "    for m in (A(), B()):\n"
        "        torch.compile(m, backend='npu_cached', options={'cache_dir': CACHE, 'compiler': 'inductor'})(x)\n"
        "emit({'misses': tcb.stats().misses})\n"
    )
    out = run_python(f"CACHE = {cache!r}\n" + MODELS + fill, env={"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor_cold")})
    assert out["misses"] == 2, out
    return cache


def _kernel_files(cache: str) -> dict[str, str]:
    graphs = os.path.join(cache, "graphs")
    return {
        name: os.path.join(graphs, key, "files", name)
        for key in os.listdir(graphs)
        if os.path.isdir(os.path.join(graphs, key, "files"))
        for name in os.listdir(os.path.join(graphs, key, "files"))
        if name.endswith(".so")
    }


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strip") is None, reason="no binutils strip")
def test_kernels_are_stored_without_debug_sections(cache: str) -> None:
    """Inductor builds with -g; the stored libraries drop the debug sections (over half of
    each .so, read, verified and copied at every warm start), and keep their symbols."""
    kernels = _kernel_files(cache)
    assert kernels
    for name, path in kernels.items():
        with open(path, "rb") as f:
            blob = f.read()
        assert blob[:4] == b"\x7fELF", name
        assert b".debug_info" not in blob and b"PyInit_kernel" in blob, name


@pytest.mark.slow
def test_warm_load_imports_only_the_loader_and_maps_each_kernel_from_its_memfd(cache: str, tmp_path) -> None:
    kernels = _kernel_files(cache)
    assert len(kernels) >= 4, kernels  # several kernels per graph: fd numbers are reused between them
    empty = tmp_path / "empty_inductor"
    empty.mkdir()
    out = run_python(f"CACHE = {cache!r}\n" + MODELS + WARM, env={"TORCHINDUCTOR_CACHE_DIR": str(empty)})
    assert out["ok"], out
    # the cold side (capture, rewrite, packaging) and the config parser are never imported by a
    # warm load (TORCHINDUCTOR_CACHE_DIR, the one variable set, is in inductor_env's tables)
    assert out["capture"] == [] and out["cold_side"] == [], out
    assert not out["inductor"] and not out["dynamo"] and out["inductor_files"] == [], out
    # every kernel its own library, from a memfd copy of its verified bytes: never a temp file,
    # and never the library an earlier kernel loaded through the same /proc/self/fd number
    assert out["memfd_inodes"] == len(kernels) and out["temp_copies"] == 0, (out, kernels)
    # a loaded module is shared only for equal bytes; other bytes under its digest are refused
    assert out["loaded"] == len(kernels) and out["shared"], out
    assert "refusing to load it" in out["refused"], out
