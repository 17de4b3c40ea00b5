"""Detect random-number ops in a Dynamo graph (``cache_compile`` refuses them,
as torchair's does: a replayed graph would not reproduce the RNG stream)."""

from __future__ import annotations

from typing import Any

_RNG_FUNCTIONS = {
    "randn", "rand", "randint", "randn_like", "rand_like", "randint_like", "randperm", "normal",
    "bernoulli", "multinomial", "poisson", "rrelu", "native_dropout",
}
_DROPOUTS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"}
_RNG_METHODS = {
    "uniform_", "normal_", "bernoulli", "bernoulli_", "exponential_", "geometric_", "log_normal_",
    "cauchy_", "random_", "multinomial",
}


def _training_flag(node: Any) -> bool:
    if "training" in node.kwargs:
        return bool(node.kwargs["training"])
    return bool(node.args[2]) if len(node.args) > 2 else True


def find_rng_ops(gm: Any) -> list[str]:
    """Names of RNG-dependent ops in ``gm`` (Dynamo or aten level)."""
    import torch

    found = []
    seeded = getattr(torch.Tag, "nondeterministic_seeded", None)
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_method" and target in _RNG_METHODS:
            found.append(f"Tensor.{target} (node {node.name!r})")
        elif node.op == "call_function":
            if isinstance(target, torch._ops.OpOverload):
                if seeded is not None and seeded in target.tags:
                    found.append(f"{target} (node {node.name!r})")
                continue
            name = getattr(target, "__name__", "")
            if name in _RNG_FUNCTIONS or (name in _DROPOUTS and _training_flag(node)):
                module = getattr(target, "__module__", None) or "torch"
                found.append(f"{module}.{name} (node {node.name!r})")
    return found


class RNGOpError(ValueError):
    """The graph depends on the random number generator."""


def reject_rng_ops(gm: Any) -> None:
    found = find_rng_ops(gm)
    if found:
        raise RNGOpError(
            "cache_compile does not support operators that depend on the random number generator (RNG): "
            + ", ".join(found)
            + ". Remove them from the cached function (e.g. generate random tensors outside it and pass them in), "
            "or use torch.compile without the cache."
        )
