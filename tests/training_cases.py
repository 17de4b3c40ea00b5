"""Training patterns trained a few SGD steps through the cache, side by side with eager.

Each case is a module-level model class (the bypass finds replayed code by name) and a
step function: ``step(fn, model, batch)`` runs one optimizer step's forward(s) and
backward(s) through ``fn`` (the compiled / replayed model, or the model itself for the
eager reference). :func:`run_cases` trains a case through one route and its eager twin
from the same weights and seeds, and reports losses, gradients and parameters.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

STEPS = 3


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class Adapter(nn.Module):
    """A frozen backbone with a trainable adapter (fine-tuning style)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16))
        self.backbone.requires_grad_(False)
        self.adapter = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(x)
        return self.head(h + self.adapter(h))


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(checkpoint(self.block, x, use_reentrant=False) + x)


class GraphBreak(nn.Module):
    """Data-dependent control flow: Dynamo splits the forward into two graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if h.sum() > -1e9:  # always true, but only known at run time
            h = h * 2.0
        return self.b(h)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class BatchNormed(nn.Module):
    """Running statistics are buffers the training graph mutates in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


class DDPNet(nn.Module):
    """Over 2 MB of parameters: Dynamo's DDP optimizer splits it at 1 MB bucket boundaries."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 1024), nn.ReLU(),
                                    nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class AutocastMLP(Plain):
    pass


class GradInput(Plain):
    """Inputs that require grad (not only parameters)."""


class AutogradGrad(Plain):
    pass


def _mse(out: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), batch["y"])


def step_plain(fn: Callable[..., Any], model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    loss = _mse(fn(batch["x"]), batch)
    loss.backward()
    return loss


def step_retain(fn: Callable[..., Any], model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Two backwards over one graph (``retain_graph=True`` first)."""
    loss = _mse(fn(batch["x"]), batch)
    loss.backward(retain_graph=True)
    (loss * 0.5).backward()
    return loss


def step_accumulate(fn: Callable[..., Any], model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Gradient accumulation: two forwards then one backward, then a third micro-batch."""
    x = batch["x"]
    loss = _mse(fn(x[:2]), {"y": batch["y"][:2]}) + _mse(fn(x[2:4]), {"y": batch["y"][2:4]})
    loss.backward()
    extra = _mse(fn(x[4:]), {"y": batch["y"][4:]})
    extra.backward()
    return loss + extra


def step_autocast(fn: Callable[..., Any], model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(batch["x"])
    loss = _mse(out, batch)
    loss.backward()
    return loss


def step_grad_input(fn: Callable[..., Any], model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    x = batch["x"].clone().requires_grad_(True)
    loss = _mse(fn(x), batch)
    loss.backward()
    model.input_grad = x.grad.detach().clone()  # type: ignore[assignment]
    return loss


def step_autograd_grad(fn: Callable[..., Any], model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    loss = _mse(fn(batch["x"]), batch)
    params = [p for p in model.parameters() if p.requires_grad]
    for p, g in zip(params, torch.autograd.grad(loss, params), strict=True):
        p.grad = g
    return loss


def step_llama(fn: Callable[..., Any], model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    loss = fn(input_ids=batch["ids"], labels=batch["ids"]).loss
    loss.backward()
    return loss


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


#: name -> (model factory, step, check eval/no-grad variant afterwards, tolerance)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], bool, float]] = {
    "dropout": (DropoutMLP, step_plain, True, 1e-5),
    "accumulate": (Plain, step_accumulate, False, 1e-5),
    "batchnorm": (BatchNormed, step_retain, True, 1e-5),  # + backward twice, retain_graph=True
    "frozen": (Adapter, step_plain, False, 1e-5),
    "checkpoint": (Checkpointed, step_plain, False, 1e-5),
    "autocast": (AutocastMLP, step_autocast, False, 2e-2),
    "grad_input": (GradInput, step_grad_input, False, 1e-5),
    "autograd_grad": (AutogradGrad, step_autograd_grad, False, 1e-5),
    "graph_break": (GraphBreak, step_plain, False, 1e-5),
    "llama": (tiny_llama, step_llama, False, 1e-4),
}


def _batch(name: str, i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    if name == "llama":
        return {"ids": torch.randint(0, 64, (2, 8), generator=g)}
    return {"x": torch.randn(6, 8, generator=g), "y": torch.randn(6, 4, generator=g)}


def _diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None):
            return float("inf")
        if x is not None and y is not None:
            worst = max(worst, float((x.float() - y.float()).abs().max()))
    return worst


def train(name: str, fn_of: Callable[[nn.Module], Callable[..., Any]], steps: int = STEPS) -> dict[str, Any]:
    """Train case ``name`` ``steps`` SGD steps through ``fn_of(model)`` and in eager from the
    same weights and seeds; report the worst loss / grad / param differences."""
    factory, step, check_eval, tol = CASES[name]
    torch.manual_seed(0)
    model = factory()
    model.train()
    ref = copy.deepcopy(model)
    fn = fn_of(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.05)
    report: dict[str, Any] = {"loss": 0.0, "grad": 0.0, "param": 0.0, "losses": [], "tol": tol}
    for i in range(steps):
        batch = _batch(name, i)
        torch.manual_seed(10 + i)
        loss = step(fn, model, batch)
        torch.manual_seed(10 + i)
        ref_loss = step(ref, ref, batch)
        grads = [p.grad for p in model.parameters()]
        ref_grads = [p.grad for p in ref.parameters()]
        report["losses"].append(float(loss.detach()))
        report["loss"] = max(report["loss"], abs(float(loss) - float(ref_loss)))
        report["grad"] = max(report["grad"], _diff(grads, ref_grads))
        if name == "grad_input":
            report["grad"] = max(report["grad"], _diff([model.input_grad], [ref.input_grad]))
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    report["param"] = _diff(list(model.parameters()) + list(model.buffers()), list(ref.parameters()) + list(ref.buffers()))
    report["frozen_untouched"] = all(p.grad is None for p in model.parameters() if not p.requires_grad)
    if check_eval:  # train/eval and grad/no-grad variants of one program
        model.eval()
        ref.eval()
        batch = _batch(name, 99)
        with torch.no_grad():
            report["eval"] = _diff([fn(batch["x"])], [ref(batch["x"])])
        report["eval_grad"] = _diff([fn(batch["x"])], [ref(batch["x"])])
    return report


def run_cases(names: list[str], route: str, cache_dir: str, compiler: str) -> dict[str, Any]:
    """Every case through ``route`` (``compile``: torch.compile(backend="npu_cached");
    ``load``: tcb.load), plus the stats and what the process imported/compiled."""
    import torchair_cached_backend as tcb

    def fn_of(model: nn.Module) -> Callable[..., Any]:
        if route == "load":
            return tcb.load(model, cache_dir, compiler=compiler)
        return torch.compile(model, backend="npu_cached", options={"cache_dir": cache_dir, "compiler": compiler})

    out: dict[str, Any] = {"cases": {}}
    for name in names:
        out["cases"][name] = train(name, fn_of)
    out["stats"] = tcb.stats().as_dict()
    dynamo = sys.modules.get("torch._dynamo")
    out["dynamo_frames"] = int(dynamo.utils.counters["frames"]["total"]) if dynamo is not None else 0
    return out
