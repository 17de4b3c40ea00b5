"""Rank directories exactly as torchair's own ``cache_compile`` lays them out (real
torchair on CPU): without an initialized process group ``global_rank`` adds no
directory and ``tp_rank``/``pp_rank`` stand alone."""

from __future__ import annotations

import json

import pytest

from tests.torchair_harness.run import run_script

pytestmark = pytest.mark.torchair

RANKS = [(None, None, None), (3, None, None), (3, 1, 2), (None, 1, None), (None, None, 2), (0, 0, 0)]

SCRIPT = """
import json, os
import torch, torchair
from torchair.inference._cache_compiler import CompiledModel
import torchair_cached_backend as tcb

class Model(torch.nn.Module):
    def forward(self, x):
        return x + 1
    def prompt(self, x):
        return x + 1

model, root = Model(), {root!r}
out = []
for g, t, p in {ranks!r}:
    theirs = CompiledModel.get_cache_bin(model.prompt, config=None, dynamic=True, cache_dir=root, global_rank=g,
                                         tp_rank=t, pp_rank=p)
    ours = tcb.cache_compile(model.prompt, cache_dir=root, compiler="eager", global_rank=g, tp_rank=t, pp_rank=p)
    out.append([os.path.relpath(theirs, root).split(os.sep)[1:-1], os.path.relpath(ours.cache_path, root).split(os.sep)[1:]])
print(json.dumps(out))
"""


def test_rank_dirs_match_torchair_without_a_process_group(tmp_path):
    proc = run_script(SCRIPT.format(root=str(tmp_path), ranks=RANKS), timeout=300)
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("[")][-1])
    for (g, t, p), (theirs, ours) in zip(RANKS, out, strict=True):
        assert ours == theirs, f"global_rank={g} tp_rank={t} pp_rank={p}: torchair {theirs}, ours {ours}"
    assert out[2][0] == ["tp_rank1_pp_rank2", "prompt"] and out[1][0] == ["prompt"]
