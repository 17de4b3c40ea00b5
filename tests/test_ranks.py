"""Ranks share compiles: ``torchrun --nproc-per-node 4`` (gloo on CPU) over one cache root.

Each distinct graph is compiled once across all ranks (the others wait on its
lock and load it), programs stay in torchair's per-rank layout, and on the next
start every rank replays without compiling.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from subprocess_helpers import REPO

RANKS = 4

SCRIPT = """
import json, logging, os, sys, time
import torch
import torch.distributed as dist
import torchair_cached_backend as tcb
from torchair_cached_backend.compilers import get_compiler
from child_helpers import frames, same

root, out_dir, slow = sys.argv[1], sys.argv[2], float(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
WAITED = []
class _Waits(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("npu_cached: waited"):
            WAITED.append(record.getMessage())
log = logging.getLogger("torchair_cached_backend")
log.addHandler(_Waits())
log.setLevel(logging.INFO)
if slow:  # a compile long enough that the other ranks are surely waiting for it
    eager = get_compiler("eager")
    real_compile = eager.compile
    def slow_compile(*args, **kwargs):
        time.sleep(slow)
        return real_compile(*args, **kwargs)
    eager.compile = slow_compile

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
    def prefill(self, x):
        return torch.relu(self.lin(x)) + 1
    def decode(self, x):
        return torch.tanh(self.lin(x)) * 2

m = Model().eval()
x = torch.randn(2, 8)
prefill = tcb.cache_compile(m.prefill, cache_dir=root, compiler="eager")
decode = tcb.cache_compile(m.decode, cache_dir=root, compiler="eager")
dist.barrier()  # every rank reaches its first compile together
with torch.no_grad():
    ok = [same(prefill(x), m.prefill(x)), same(decode(x), m.decode(x))]
s = tcb.stats()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"ok": ok, "hits": s.hits, "misses": s.misses, "bypass_loads": s.bypass_loads, "frames": frames(),
               "compile_seconds": s.compile_seconds, "waited": WAITED, "paths": [prefill.cache_path, decode.cache_path]}, f)
dist.barrier()
dist.destroy_process_group()
"""


def torchrun(tmp_path, root: str, name: str, slow: float) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    script = tmp_path / "ranks_child.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
         str(script), root, str(out), str(slow)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


def test_ranks_compile_each_graph_once_then_all_replay(tmp_path):
    root = str(tmp_path / "cache")
    cold = torchrun(tmp_path, root, "cold", slow=2.0)
    assert all(all(r["ok"]) for r in cold), cold
    assert sum(r["misses"] for r in cold) == 2, cold  # two distinct graphs (prefill, decode), once each
    assert sum(r["hits"] for r in cold) == 2 * (RANKS - 1), cold  # the other ranks loaded them
    assert any(r["waited"] for r in cold), "no rank waited for another's compile"
    # layout: torchair's per-rank dirs for programs, one shared graph store per model
    (info,) = os.listdir(root)
    for rank, r in enumerate(cold):
        for path, func in zip(r["paths"], ("prefill", "decode"), strict=True):
            assert os.path.relpath(path, root).split(os.sep) == [info, f"world{RANKS}global_rank{rank}", func]
            assert len(os.listdir(os.path.join(path, "programs"))) == 1 and not os.path.exists(os.path.join(path, "graphs"))
    assert len(os.listdir(os.path.join(root, info, "graphs"))) == 2
    assert not glob.glob(os.path.join(root, info, "world*", "*", "graphs"))

    warm = torchrun(tmp_path, root, "warm", slow=0.0)
    assert all(all(r["ok"]) for r in warm), warm
    for r in warm:
        assert (r["bypass_loads"], r["misses"], r["frames"]) == (2, 0, 0), r
