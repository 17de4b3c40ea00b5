"""Helpers imported by the child processes of the bypass / cache_compile tests."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import torch

import torchair_cached_backend as tcb

#: every message the package logged in this process
LOGS: list[str] = []


class _Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        LOGS.append(record.getMessage())


logging.getLogger("torchair_cached_backend").addHandler(_Collect())
logging.getLogger("torchair_cached_backend").setLevel(logging.INFO)


def frames() -> int:
    """Dynamo's own count of frames it compiled in this process (0 if never imported)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return counters["frames"].get("total", 0)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-5))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def stats() -> dict:
    return tcb.stats().as_dict()


def programs(path: str) -> list[str]:
    d = os.path.join(path, "programs")
    return sorted(k for k in os.listdir(d) if not k.startswith(".")) if os.path.isdir(d) else []
