"""Torch's own first use of the operators transformer graphs call, done by ``preload``'s thread.

The first call of an operator in a process costs far more than later ones (0.01-2 ms each on
CPU: the binding's argument parser, the dispatcher's tables, the kernel's code paged in and
its symbols bound). A replayed graph is Python calling operators, so on a small model those
first uses are a large part of its first call (tiny Llama: ~0.8 ms of ~3.5 ms). Eager pays
them in its first call too; a warm start need not, since the thread is idle while the caller
builds its model.

Why it is safe: every call below makes new, tiny float32 CPU tensors (no random numbers, no
global state read or written; ``no_grad`` on this thread only); tensors this small never
enter a parallel region (no thread pool is started: tested); a call that fails on some
build is skipped. Off with ``TCB_PRELOAD=0``, as all of the preload.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

#: how many of :func:`calls` ran (tests read it)
warmed = 0


def calls() -> list[Callable[[], Any]]:
    """The operators of the transformer families we test (attention, norms, activations,
    rotary embeddings, masks, dtype casts, sampling), on tiny inputs."""
    f32, cpu = torch.float32, "cpu"
    x = torch.ones(2, 4, 8, dtype=f32, device=cpu)
    w = torch.ones(8, 8, dtype=f32, device=cpu)
    b = torch.ones(8, dtype=f32, device=cpu)
    r = x[:1, :1]  # one row: row-wise kernels (norms, softmax) loop on this thread
    q = x[:1].view(1, 1, 4, 8)  # one (batch, head, query block): attention's loop stays on this thread
    ids = torch.zeros(2, 4, dtype=torch.long, device=cpu)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool, device=cpu)
    return [
        lambda: F.linear(x, w), lambda: F.linear(x, w, b), lambda: torch.matmul(x, w),
        lambda: torch.bmm(x, x.transpose(1, 2)), lambda: torch.baddbmm(b[:4].view(1, 4, 1), x[:, :, :4], x[:, :4]),
        lambda: F.scaled_dot_product_attention(q, q, q), lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask),
        lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), lambda: F.embedding(ids, w),
        lambda: F.layer_norm(r, (8,), b, b), lambda: torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6) * r,
        lambda: F.softmax(r, -1), lambda: F.silu(r), lambda: F.gelu(r[..., :1]), lambda: F.gelu(r[..., :1], approximate="tanh"),
        lambda: F.relu(r), lambda: torch.tanh(r), lambda: torch.sigmoid(r), lambda: torch.cat([x, -x], -1),
        lambda: torch.stack([x, x]), lambda: x.transpose(1, 2).contiguous().reshape(-1),
        lambda: x[:1].expand(2, 4, 8) - x, lambda: x.unsqueeze(0)[..., :2] / 2,
        lambda: torch.where(x > 0, x, x - 1), lambda: x[:1].masked_fill(mask[0, :, :, :1], 0.0),
        lambda: torch.arange(8, device=cpu).float()[None, :] * b[:, None], lambda: x.cos() + x.sin(),
        lambda: x.to(torch.bfloat16).to(f32), lambda: x.to(torch.float16), lambda: torch.triu(w[:1], 1),
        lambda: torch.full((4,), 1.0, device=cpu), lambda: x.new_ones(3), lambda: torch.tensor([1, 2], device=cpu),
        lambda: r.max(-1), lambda: r.argmax(-1), lambda: torch.topk(r, 2),
    ]


def warm(stop: threading.Event) -> None:
    """Run :func:`calls` once (in ``preload``'s thread) until ``stop`` is set (the caller began a
    load: it then runs without this thread in its way); a failing call is skipped. Not in a
    process that imported torch_npu: its graphs run on the NPU, and these are CPU kernels."""
    global warmed
    if "torch_npu" in sys.modules:
        return
    with torch.no_grad():
        try:
            todo = calls()
        except Exception:  # noqa: BLE001  (a torch without one of these: nothing warmed)
            return
        for call in todo:
            if stop.is_set():
                return
            try:
                call()
            except Exception:  # noqa: BLE001
                continue
            warmed += 1
