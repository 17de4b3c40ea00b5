"""torch.compile(mode="reduce-overhead") (transformers' CompileConfig default) maps to
torchair's aclgraph in ``npu_cached``; a given config wins (real torchair on CPU)."""

from __future__ import annotations

import json

import pytest

from tests.torchair_harness.run import run_script

pytestmark = pytest.mark.torchair

CODE = """
import json, torchair
from torchair_cached_backend.backend import apply_mode
from torchair_cached_backend.options import parse_options
from torchair_cached_backend.torchair_config import config_mode
base = parse_options({"compiler": "torchair", "cache_dir": %r})
mapped = apply_mode(base, "reduce-overhead")
given = torchair.CompilerConfig()
given.mode = "max-autotune"
kept = apply_mode(parse_options({"compiler": "torchair", "cache_dir": %r, "config": given}), "reduce-overhead")
default = apply_mode(base, "max-autotune")
print("RESULT " + json.dumps({"mapped": config_mode(mapped.config), "base": base.config is None,
                              "kept": config_mode(kept.config), "default": default.config is None}))
"""


def test_reduce_overhead_maps_to_aclgraph(tmp_path):
    proc = run_script(CODE % (str(tmp_path), str(tmp_path)), timeout=300, fake_torch_npu=True)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert out == {"mapped": "reduce-overhead", "base": True, "kept": "max-autotune", "default": True}, out
