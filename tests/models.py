"""Small deterministic models shared by tests, examples-style (importable by child processes)."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_h: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_h)
        self.fc2 = nn.Linear(d_h, d_out)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        return self.head(h.mean(dim=(2, 3)))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 100, d: int = 32, n_head: int = 2, n_layer: int = 2, max_t: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_t, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


def helper_scale(x):
    return x * 2.0


class WithHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return helper_scale(self.lin(x))


class GraphBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(h) + 1


class Constants(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y, y.dtype, y.shape, y.device


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return Output(logits=h.softmax(-1), hidden=h)


#: a module the staleness tests write to disk, then edit
EDITABLE_SOURCE = '''
import torch

def helper(x):
    return x * 2.0

class Edited(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.cached = None

    def forward(self, x):
        return helper(self.lin(x))
'''


def build(name: str):
    """(model, example input) with fixed seeds."""
    torch.manual_seed(0)
    if name == "mlp":
        return MLP().eval(), torch.randn(4, 16)
    if name == "conv":
        return ConvNet().eval(), torch.randn(2, 3, 8, 8)
    if name == "gpt":
        return GPT().eval(), torch.randint(0, 100, (2, 16))
    if name == "helper":
        return WithHelper().eval(), torch.randn(4, 8)
    if name == "graph_break":
        return GraphBreak().eval(), torch.randn(4, 8)
    if name == "constants":
        return Constants().eval(), torch.randn(4, 8)
    if name == "dataclass":
        return DataclassOut().eval(), torch.randn(4, 8)
    raise ValueError(name)
