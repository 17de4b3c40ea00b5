"""The DDP optimizer's split-graph description: only its own shapes are described, and a
broken stored description is refused (never run)."""

from __future__ import annotations

import pytest
import torch

from torchair_cached_backend.bypass.split_graph import SplitGraph, describe


def test_split_graph_runs_steps_and_unwraps_singleton_tuples() -> None:
    steps = [["input", "x"], ["call", "a", "part_0", [{"node": "x"}, 2]], ["call", "b", "part_1", [{"node": "a"}]],
             ["item", "c", "b", 1], ["output", {"tuple": [{"node": "c"}, {"node": "a"}]}]]
    parts = {"part_0": (lambda x, k: (x * k,), True), "part_1": (lambda a: (a, a + 1), False)}
    out = SplitGraph(steps, parts)(torch.ones(2))
    assert torch.equal(out[0], torch.full((2,), 3.0)) and torch.equal(out[1], torch.full((2,), 2.0))
    with pytest.raises(TypeError, match="takes 1 inputs"):
        SplitGraph(steps, parts)()


def test_split_graph_refuses_a_description_naming_a_missing_piece() -> None:
    with pytest.raises(ValueError, match="does not hold"):
        SplitGraph([["input", "x"], ["call", "a", "gone", [{"node": "x"}]], ["output", {"node": "a"}]], {})


def test_only_ddp_optimizer_splits_are_described() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))  # a call_module of no DDP wrapper
    assert describe(gm, lambda v: None) is None
    assert describe(object(), lambda v: None) is None
