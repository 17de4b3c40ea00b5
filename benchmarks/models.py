"""Benchmark models: a feed-forward MLP and a small GPT, plain torch, seeded init.

Kept free of package imports so a child process times only torch and the mode
under test. Children import this file as the top-level module ``models`` (the
cache keys a program by module + qualname, so every child must import it the
same way).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

MODELS = ("mlp", "gpt", "gpt16", "pointwise")


class MLP(nn.Module):
    """Matmul-bound, one graph, few ops: warm start is dominated by fixed costs."""

    def __init__(self, d_in: int = 512, d_h: int = 1024, d_out: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_h)
        self.fc2 = nn.Linear(d_h, d_h)
        self.fc3 = nn.Linear(d_h, d_in)
        self.fc4 = nn.Linear(d_in, d_out)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.gelu(self.fc2(x))
        x = F.relu(self.fc3(x))
        return self.fc4(x)


class Pointwise(nn.Module):
    """A chain of elementwise ops: eager runs one kernel per op, Inductor fuses them into one."""

    def forward(self, x):
        y = torch.sigmoid(x) * torch.tanh(x * 0.5 + 1.0)
        return torch.relu(y - x.sin() * 0.1) + x.cos() * 0.05


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP block."""

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
        hd = C // self.n_head
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, hd).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer; ``n_layer`` scales graph size (gpt vs gpt16)."""

    def __init__(self, vocab: int = 1000, d: int = 256, n_head: int = 4, n_layer: int = 4, max_t: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_t, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def build(name: str, size: str = "bench") -> tuple[nn.Module, torch.Tensor]:
    """(model in eval mode, example input); same weights in every process.

    ``size``: ``bench`` is the warm-start configuration; ``small`` keeps the
    weights but shrinks the input (MLP batch 1, GPT batch 1 x seq 8); ``tiny``
    also shrinks the widths, so per-call overhead is not drowned by compute.
    """
    if size not in ("bench", "small", "tiny"):
        raise ValueError(f"unknown size {size!r}")
    torch.manual_seed(0)
    tiny = size == "tiny"
    if name == "mlp":
        model = MLP(64, 64, 8) if tiny else MLP()
        return model.eval(), torch.randn(32 if size == "bench" else 1, model.fc1.in_features)
    if name in ("gpt", "gpt16"):
        layers = 4 if name == "gpt" else 16
        model = GPT(vocab=100, d=32, n_head=2, n_layer=layers, max_t=8) if tiny else GPT(n_layer=layers)
        shape = (2, 64) if size == "bench" else (1, 8)
        return model.eval(), torch.randint(0, model.tok.num_embeddings, shape)
    if name == "pointwise":
        return Pointwise().eval(), torch.randn((64, 256) if tiny else (256, 1024))
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
