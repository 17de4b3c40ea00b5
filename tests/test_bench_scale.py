"""benchmarks/scale.py's own logic (no child processes): the fast random init, the summary of
fresh-process rows (medians, spread, crashes) and resuming a run without redoing its rows."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import scale  # noqa: E402


def test_fast_init_gives_the_same_nondegenerate_weights_in_every_build():
    a, config = scale.build_llama("tiny", "fp32")
    b, _ = scale.build_llama("tiny", "bf16")
    assert config.num_hidden_layers == scale.SIZES["tiny"]["layers"]
    wa = dict(a.named_parameters())
    for name, p in b.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.float(), wa[name].to(torch.bfloat16).float()), name
    norm = a.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    q0, q1 = a.model.layers[0].self_attn.q_proj.weight, a.model.layers[1].self_attn.q_proj.weight
    assert not torch.equal(q0, q1)  # layers differ
    assert 0.01 < float(q0.detach().std()) < 0.03
    # the rotary buffers are computed, not left uninitialised by the skipped init
    assert torch.isfinite(a.model.rotary_emb.inv_freq).all() and a.model.rotary_emb.inv_freq.dtype == torch.float32


def _row(mode, rep, first, **kw):
    r = {"size": "tiny", "dtype": "fp32", "mode": mode, "rep": rep, "params": 10, "first_call_s": first,
         "first_decode_s": 0.1, "first_generation_s": first + 1, "ttft_from_process_start_s": first + 2,
         "prefill_ms": 5.0, "per_token_ms": 1.0, "peak_rss_mb": 100.0, "tokens": [1, 2], "loadavg": [1.0],
         "frames_first_generation": 0, "frames_steady": 0, "imported_dynamo": True}
    r.update(kw)
    return r


def test_summary_has_median_spread_crashes_and_rss_against_eager():
    rows = [_row("eager", i, t) for i, t in enumerate((1.0, 3.0, 2.0))]
    rows += [_row("bypass_eager", 0, 0.5, load_s=0.01, peak_rss_mb=110.0, replayed=True),
             _row("bypass_eager", 1, 0.7, load_s=0.03, peak_rss_mb=112.0, replayed=True, tokens=[1, 3]),
             {"size": "tiny", "dtype": "fp32", "mode": "bypass_eager", "rep": 2, "error": "Boom: x",
              "error_at": 'File "/x.py", line 1', "loadavg": [2.0]}]
    got = {s["mode"]: s for s in scale.aggregate(rows, ["tiny"], ["fp32"], list(scale.ORDER))}
    assert got["eager"]["first_call_s"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    b = got["bypass_eager"]
    assert (b["runs"], b["crashes"]) == (3, 1)
    assert b["errors"] == ['Boom: x (at File "/x.py", line 1)']
    assert b["rss_over_eager_mb"] == pytest.approx(11.0)
    assert b["tokens_equal_eager"] is False  # one process generated other tokens
    md = scale.render_markdown({"machine": {"cpu": "c", "cores": 2}, "torch": "t", "transformers": "t",
                                "created": "now", "config": {"sizes": ["tiny"], "dtypes": ["fp32"], "prompt": 8,
                                                             "steps": 2, "rounds": 1, "child_env": {}},
                                "summary": list(got.values())})
    assert "| bypass_eager | 2 | 0.6 (0.5–0.7) |" in md and "Boom: x" in md


def test_a_rerun_skips_rows_already_written(tmp_path, monkeypatch):
    args = types.SimpleNamespace(prompt=8, steps=2, rounds=1, force=False, timeout=10)
    run = scale.Run(str(tmp_path), "tiny", "fp32", args, lambda s: None)
    done = _row("eager", 0, 1.5)
    with open(run.row_path("eager", 0), "w") as f:
        json.dump(done, f)
    monkeypatch.setattr(scale, "_spawn", lambda *a, **k: pytest.fail("a finished row was run again"))
    assert run.run_row("eager", 0, "eager", None, {}, str(tmp_path / "ind")) == done
    args.force = True
    monkeypatch.setattr(scale, "_spawn", lambda *a, **k: {"error": "ran"})
    assert run.run_row("eager", 0, "eager", None, {}, str(tmp_path / "ind"))["error"] == "ran"
