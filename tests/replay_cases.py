"""Code the replay must serve, imported by the children of tests/test_replay_reach.py.

Each class or function is one defect of issue 9's review (cold in one fresh
process, warm in another). The eager inner compiler keeps it fast.
"""

from __future__ import annotations

import torch
import torch.nn as nn

# -- two classes of one module, each with a graph break at the same offset --------------


class Encoder(nn.Module):
    def forward(self, x):
        y = x * 2.0
        torch._dynamo.graph_break()
        return y + 1.0


class Decoder(nn.Module):
    def forward(self, x):
        y = x * 3.0
        torch._dynamo.graph_break()
        return y - 1.0


def other_function(x):
    """Compiled by plain torch.compile in the same module after a replay."""
    return x.sin() + 1.0


# -- receivers: classmethods, a receiver not called self -----------------------------------


class Scaler:
    factor = 3.0

    @classmethod
    def apply(cls, x):
        return x * cls.factor + 1.0


class This(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 2.0), requires_grad=False)

    def forward(this, x):  # noqa: N805 - the point of the case
        return x * this.w


# -- judged stale forever before: a property, a module-level lambda, a buffer counter -------

double = lambda t: t * 2.0  # noqa: E731 - the point of the case


class WithProperty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = 1.5

    @property
    def scale(self):
        return self.k * 2.0

    def forward(self, x):
        return double(x) * self.scale


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.n += 1
        return x + 1.0


# -- several instances of one class in one cache dir -------------------------------------


class Proj(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(n)
        self.lin = nn.Linear(4, n)

    def forward(self, x):
        return self.lin(x).relu()


# -- a graph break inside a closure --------------------------------------------------------


def make_closure(k: float):
    bias = torch.full((4,), k)

    def fn(x):
        y = x * k + bias
        torch._dynamo.graph_break()
        return (y * k).sin()

    return fn


# -- grad mode variants: no parameter, no input requiring grad -----------------------------


def no_params(x):
    return (x * 2.0).cos()
