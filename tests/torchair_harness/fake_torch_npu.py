"""A minimal fake ``torch_npu`` package, enough for torchair's aclgraph codegen.

torchair's ``reduce-overhead`` / ``npugraph_ex`` modes refuse to build an
``AclGraph`` unless ``import torch_npu`` succeeds, and they read a few
attributes from ``torch_npu.npu`` / ``torch.npu`` (current device, hf32 flags,
deterministic level, graph memory pool).  :func:`install` puts this fake in
``sys.modules`` (``torch_npu`` and ``torch_npu.npu``) and points ``torch.npu``
at it; :func:`uninstall` restores whatever was there before.

It is a *codegen* fake: nothing here can capture or replay a graph.  Note that
having any ``torch_npu`` in ``sys.modules`` switches torchair to its
"with torch_npu" branches (e.g. ``_get_global_op_compile_config`` then reads
``torch_npu.npu.matmul.allow_hf32`` and ``_get_deterministic_level()``).

Knobs (module attributes of the installed fake ``torch_npu.npu``):
``deterministic_level`` (int, default 0), ``matmul.allow_hf32`` /
``conv.allow_hf32`` (bool), ``cann_version_gte`` (bool returned by
``torch_npu.npu.utils._is_gte_cann_version``, default False).
Tensors get ``is_npu`` (always False), which GE code generated with torch_npu
reads, so such code runs over the executor shim.
"""

from __future__ import annotations

import sys
import types
from typing import Any

_MISSING = object()
_saved: dict[str, Any] | None = None


class _FakeNPUGraph:
    """Placeholder so attribute lookups succeed; capturing is not supported."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("fake torch_npu: NPUGraph capture is not available on CPU")


class _FakeEvent:
    """Placeholder for ``torch.npu.Event``: referenced, never usable."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("fake torch_npu: NPU events are not available on CPU")


class _FakeStream:
    """``torch.npu.Stream()``: constructible (generated aclgraph code makes one), nothing more."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def _build() -> types.ModuleType:
    pkg = types.ModuleType("torch_npu")
    pkg.__path__ = []  # behave like a package so "import torch_npu.npu" works
    pkg.__version__ = "0.0.0+tcb.fake"
    pkg.__tcb_fake__ = True

    npu = types.ModuleType("torch_npu.npu")
    npu.__path__ = []
    npu.deterministic_level = 0
    npu.cann_version_gte = False
    npu.current_device = lambda: 0
    npu.device_count = lambda: 1
    npu.is_available = lambda: False
    npu._get_deterministic_level = lambda: npu.deterministic_level
    npu.matmul = types.SimpleNamespace(allow_hf32=False)
    npu.conv = types.SimpleNamespace(allow_hf32=False)
    npu.graph_pool_handle = lambda: (1, 0)
    npu.NPUGraph = _FakeNPUGraph
    npu.Event = _FakeEvent  # named in annotations of torchair's aclgraph modules
    npu.Stream = _FakeStream  # aclgraph code makes one at import; capturing on it fails later
    npu.current_stream = lambda *args, **kwargs: _FakeStream()
    npu.synchronize = lambda *a, **k: None

    utils = types.ModuleType("torch_npu.npu.utils")
    utils._is_gte_cann_version = lambda version, module="CANN": bool(npu.cann_version_gte)
    utils.get_cann_version = lambda module="CANN": ""
    npu.utils = utils

    pkg.npu = npu
    return pkg


def install() -> types.ModuleType:
    """Install the fake (idempotent) and return the fake ``torch_npu`` module."""
    global _saved
    import torch

    current = sys.modules.get("torch_npu")
    if _saved is not None and current is not None and getattr(current, "__tcb_fake__", False):
        return current
    if current is not None and not getattr(current, "__tcb_fake__", False):
        raise RuntimeError(f"a real torch_npu is already imported ({current!r}); refusing to shadow it")
    fake = _build()
    names = ("torch_npu", "torch_npu.npu", "torch_npu.npu.utils")
    _saved = {name: sys.modules.get(name, _MISSING) for name in names}
    _saved["torch.npu"] = getattr(torch, "npu", _MISSING)
    sys.modules["torch_npu"] = fake
    sys.modules["torch_npu.npu"] = fake.npu
    sys.modules["torch_npu.npu.utils"] = fake.npu.utils
    torch.npu = fake.npu
    _saved["Tensor.is_npu"] = torch.Tensor.__dict__.get("is_npu", _MISSING)
    torch.Tensor.is_npu = property(lambda self: False)  # GE code with torch_npu asks each input
    return fake


def uninstall() -> None:
    """Undo :func:`install`."""
    global _saved
    if _saved is None:
        return
    import torch

    for name, old in _saved.items():
        if name == "Tensor.is_npu":
            if old is _MISSING:
                del torch.Tensor.is_npu
            else:
                torch.Tensor.is_npu = old
        elif name == "torch.npu":
            if old is _MISSING:
                if hasattr(torch, "npu"):
                    delattr(torch, "npu")
            else:
                torch.npu = old
        elif old is _MISSING:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = old
    _saved = None


def installed() -> bool:
    return _saved is not None
