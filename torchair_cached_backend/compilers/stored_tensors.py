"""Stored tensors (graph constants, frozen parameters) saved and loaded as real tensors.

Dynamo calls a backend with its FakeTensorMode active, and the backend may load a
cached graph right there (a hit, or an entry another process finished while this
one waited on the lock): ``torch.load`` under that mode builds fake tensors with no
data, and a kernel reading them crashes. Loading goes through :func:`load_tensors`.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """No fake / proxy / functional dispatch mode and no tracing context inside (both
    restored afterwards): ``torch.load`` makes meta storages whenever either says
    "fake", and factories dispatch to the fake mode."""
    unset = torch._C._unset_dispatch_mode
    saved = [m for m in (unset(k) for k in _INFRA_MODE_KEYS) if m is not None]
    try:
        with torch._guards.tracing(None):
            yield
    finally:
        for mode in reversed(saved):
            torch._C._set_dispatch_mode(mode)


_INFRA_MODE_KEYS = tuple(
    getattr(torch._C._TorchDispatchModeKey, k) for k in ("FAKE", "PROXY", "FUNCTIONAL")
    if hasattr(torch._C._TorchDispatchModeKey, k)
)


def load_tensors(path_or_bytes: Any) -> dict[str, torch.Tensor]:
    """``torch.load`` (weights only) of stored constants, always as real tensors."""
    src = io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, (bytes, bytearray)) else path_or_bytes
    with real_tensors():
        loaded = torch.load(src, weights_only=True, map_location=None)
    for name, t in loaded.items():
        if isinstance(t, torch.Tensor) and (t.is_meta or type(t) not in (torch.Tensor, torch.nn.Parameter)):
            raise ValueError(f"stored constant {name!r} did not load as a real tensor ({type(t).__name__}, {t.device})")
    return loaded


def save_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """``torch.save`` of real tensors, as :func:`load_tensors` reads them."""
    buf = io.BytesIO()
    with real_tensors():
        torch.save(dict(tensors), buf)
    return buf.getvalue()
