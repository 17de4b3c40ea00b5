"""Tiny models for the fleet tests (portability, remote tier), importable by child processes."""

from __future__ import annotations

import torch
import torch.nn as nn


class Reducer(nn.Module):
    """Parallel reductions: Inductor's C++ kernels size per-thread buffers by the thread count."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(33, 33)

    def forward(self, x):
        h = self.lin(x)
        return h.sum(), (h * x).amax(), x.var(), h.softmax(0).sum(1)


def build_reducer() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Reducer().eval(), torch.randn(4096, 33)
