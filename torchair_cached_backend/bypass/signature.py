"""The per-call input check that stands in for Dynamo's guards on a warm start.

It checks only what is cheap and what a replayed graph silently depends on:
argument count, and for each tensor its dtype, device, rank and static dims,
plus grad mode. A violation names the argument, what was expected and what came.
"""

from __future__ import annotations

from typing import Any


class InputSignatureError(TypeError):
    """A call does not match the inputs the cached graph was compiled for."""


class GradModeError(RuntimeError):
    """The cached graph was captured without autograd but is called with grad enabled."""


def describe_args(arg_names: list[str], args: tuple[Any, ...], static_dims: dict[str, list[Any]]) -> list[Any]:
    """The JSON signature of one call: per positional argument, a tensor spec or a type name."""
    import torch

    spec: list[Any] = []
    for i, value in enumerate(args):
        name = arg_names[i] if i < len(arg_names) else f"arg{i}"
        if isinstance(value, torch.Tensor):
            dims = static_dims.get(name)
            if dims is None or len(dims) != value.dim():
                dims = list(value.shape)
            spec.append({"name": name, "dtype": str(value.dtype), "device": str(value.device), "dims": dims})
        else:
            spec.append({"name": name, "type": type(value).__name__})
    return spec


class SignatureCheck:
    """Compiled form of a stored signature: a flat list, checked in a tight loop."""

    __slots__ = ("nargs", "tensors", "others", "grad_enabled")

    def __init__(self, spec: list[Any], grad_enabled: bool) -> None:
        import torch

        self.nargs = len(spec)
        self.tensors = []
        self.others = []
        for i, item in enumerate(spec):
            if "dtype" in item:
                dtype = getattr(torch, item["dtype"].replace("torch.", ""))
                dims = tuple((j, d) for j, d in enumerate(item["dims"]) if isinstance(d, int))
                self.tensors.append((i, item["name"], dtype, torch.device(item["device"]), len(item["dims"]), dims))
            else:
                self.others.append((i, item["name"], item["type"]))
        self.grad_enabled = grad_enabled

    def mismatch(self, args: tuple[Any, ...]) -> str | None:
        """None when ``args`` fit, else a message naming the first mismatch."""
        if len(args) != self.nargs:
            return f"expected {self.nargs} positional arguments, got {len(args)}"
        for i, name, dtype, device, ndim, dims in self.tensors:
            t = args[i]
            if getattr(t, "dtype", None) is not dtype:
                got = getattr(t, "dtype", type(t).__name__)
                return f"argument {name!r}: expected dtype {dtype}, got {got}"
            if t.device != device:
                return f"argument {name!r}: expected device {device}, got {t.device}"
            if t.dim() != ndim:
                return f"argument {name!r}: expected a {ndim}-d tensor, got {t.dim()}-d with shape {tuple(t.shape)}"
            shape = t.shape
            for j, d in dims:
                if shape[j] != d:
                    return (
                        f"argument {name!r}: expected size {d} at dim {j} (the cached graph is static in this dim), "
                        f"got shape {tuple(shape)}"
                    )
        for i, name, type_name in self.others:
            if type(args[i]).__name__ != type_name:
                return f"argument {name!r}: expected {type_name}, got {type(args[i]).__name__}"
        return None

    def check_grad(self) -> None:
        import torch

        if torch.is_grad_enabled() and not self.grad_enabled:
            raise GradModeError(
                "the cached graph was captured with grad disabled (an inference graph) but is now called with "
                "grad enabled; call it under torch.no_grad()/torch.inference_mode(), or clear the cache to "
                "capture it in grad mode"
            )
