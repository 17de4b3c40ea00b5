"""The key of a training graph: what changes AOTAutograd's joint graph or its partition
changes the key (docs/training-key.md has the audit against AOTAutograd's own key)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import torchair_cached_backend.key as keys
from torchair_cached_backend.compilers import get_compiler
from torchair_cached_backend.options import parse_options


def _capture(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return graphs[0]


def _key(gm, inputs, training=True, compiler="eager"):
    options = parse_options({"compiler": compiler})
    return keys.compute_key(gm, inputs, get_compiler(compiler), options, True, training=training)


def f(x, w):
    return (x @ w).relu().sum()


@pytest.fixture
def base():
    gm, inputs = _capture(f, torch.ones(4, 3), torch.ones(3, 2, requires_grad=True))
    return gm, inputs, _key(gm, inputs)


def test_training_and_inference_keys_differ(base):
    gm, inputs, (key, factors) = base
    assert _key(gm, inputs, training=False)[0] != key
    assert factors["training"]["partitioner"] == "min_cut_rematerialization"
    # torchair's npu_backend partitions with default_partition: another partition, another key factor
    torchair_factors = keys.training_factors(gm, get_compiler("torchair"))
    assert torchair_factors["partitioner"].startswith("default_partition")


def test_functorch_config_override_changes_the_training_key(base):
    gm, inputs, (key, _) = base
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=0.5):
        changed = _key(gm, inputs)[0]
        inference = _key(gm, inputs, training=False)[0]
    assert changed != key
    assert inference == _key(gm, inputs, training=False)[0]  # the eager inference key does not read it
    assert _key(gm, inputs)[0] == key  # back to the defaults


def test_requires_grad_and_parameter_inputs_change_the_key(base):
    gm, inputs, (key, _) = base
    x, w = inputs
    assert _key(gm, [x, w.detach().requires_grad_(False)])[0] != key
    assert _key(gm, [x, torch.nn.Parameter(w.detach().clone())])[0] != key


def test_node_annotations_change_the_key(base):
    gm, inputs, (key, _) = base
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta["custom"] = {"region_activation_memory_budget": 0.3}
    try:
        assert _key(gm, inputs)[0] != key
    finally:
        del node.meta["custom"]


def _policy(keep, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


def _sac(keep):
    return functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, keep))


def _checkpointed(context_fn):
    def fn(x, w):
        return checkpoint(lambda a: (a @ w).relu().sin(), x, use_reentrant=False, context_fn=context_fn).sum()

    return fn


def test_selective_checkpoint_policy_changes_the_key():
    x, w = torch.ones(4, 3), torch.ones(3, 2, requires_grad=True)
    keys_seen = []
    for keep in ([torch.ops.aten.mm.default], [torch.ops.aten.sin.default]):
        gm, inputs = _capture(_checkpointed(_sac(keep)), x, w)
        keys_seen.append(_key(gm, inputs)[1].get("training", {}).get("checkpoint_context_fns"))
    assert keys_seen[0] and keys_seen[1] and keys_seen[0] != keys_seen[1]
