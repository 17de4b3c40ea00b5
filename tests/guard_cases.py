"""The cases of the invalidation matrix (tests/test_guards_matrix.py), one change each.

A case builds its subjects (modules or functions; each case has its own classes, so no two
cases share a program) in one of three phases:

* ``cold``: the program as it is cached;
* ``warm``: the same program with ONE change (an attribute, a global, a hook, the inputs...);
* ``same``: the cold program again, unchanged (a warm start must replay it).

``cold_steps`` are the calls made at capture (and again, unchanged, in the ``same`` phase);
``warm_steps`` are the calls (and in-process mutations) made by the changed warm process.
Everything a step feeds in is built from fixed seeds, so every process builds the same inputs.
Process-level changes (environment variables read at import, an edited source file) are
applied by the runner: see ``phase_env`` and :class:`DefaultArg`.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import guard_flags
import torch
import torch.nn as nn
import torch.nn.functional as F

ROUTES = ("cache_compile", "load", "backend")

#: module-level value of THIS module, set from the environment at import (cold 1.0, warm 4.0)
SAME_SCALE = float(os.environ.get("GUARD_MATRIX_SCALE", "1.0"))


def phase_env(phase: str) -> dict[str, str]:
    """Environment of a phase's process: what the globals read at import become (and
    ``GUARD_MATRIX_FORWARD_ENV``, read in a forward: unset cold, set warm)."""
    changed = phase == "warm"
    env = {"GUARD_MATRIX_FLAG": "1" if changed else "0", "GUARD_MATRIX_SCALE": "4.0" if changed else "1.0"}
    if changed:
        env["GUARD_MATRIX_FORWARD_ENV"] = "1"
    return env


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def positive(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) + 0.1


@dataclasses.dataclass
class Call:
    """Call subject ``subject`` with ``make()`` -> (args, kwargs) under context ``ctx``."""

    label: str
    make: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]
    subject: str = "main"
    ctx: str = "no_grad"  # no_grad | grad | autocast | float64


@dataclasses.dataclass
class Do:
    """Mutate the live subjects between two calls of one process."""

    label: str
    fn: Callable[[dict[str, Any]], Any]


def x48(seed: int = 0) -> Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]:
    return lambda: ((randn(4, 8, seed=seed),), {})


class Case:
    name = ""
    changes = ""
    dynamic = False
    routes: tuple[str, ...] = ROUTES
    #: an error raised by the package is accepted only when its message names one of these
    error_words: tuple[str, ...] = ()
    #: the eager program itself imports torch._dynamo (torch.cond does)
    eager_imports_dynamo = False
    #: inner compiler -> why it never caches this program's graphs (so even unchanged it is compiled)
    uncached_with: dict[str, str] = {}
    #: the inner compilers the case runs with (a pure guard case needs one: the check is the same)
    compilers: tuple[str, ...] = ("eager", "inductor")

    def build(self, phase: str, workdir: str) -> dict[str, Any]:
        raise NotImplementedError

    def cold_steps(self) -> list[Any]:
        return [Call("x", x48())]

    def warm_steps(self) -> list[Any]:
        return [Call("x", x48(1))]

    def options(self, phase: str) -> dict[str, Any]:
        """npu_cached options of the phase (cache_compile kwargs / torch.compile options / load kwargs)."""
        return {}

    def reference(self, eager: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], phase: str,
                  compiler: str) -> Any:
        """What a fresh compile of the phase's program returns: its eager output."""
        return eager(*args, **kwargs)


def seeded(cls: type[nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    return cls(*args, **kwargs).eval()


# ---------------------------------------------------------------------------
# attributes of every Python type read in forward
# ---------------------------------------------------------------------------


class FloatAttrModel(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = scale

    def inner(self, x):
        return self.lin(x) * self.scale

    forward = inner


class AttrFloat(Case):
    name, changes = "attr_float", "float attribute `self.scale` 2.0 -> 3.0"
    error_words = ("scale",)

    def build(self, phase, workdir):
        return {"main": seeded(FloatAttrModel, 3.0 if phase == "warm" else 2.0)}


class IntAttrModel(nn.Module):
    def __init__(self, reps: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.reps = reps

    def inner(self, x):
        return torch.cat([self.lin(x)] * self.reps, dim=-1)

    forward = inner


class AttrInt(Case):
    name, changes = "attr_int", "int attribute `self.reps` 2 -> 3 (the output width)"
    error_words = ("reps",)

    def build(self, phase, workdir):
        return {"main": seeded(IntAttrModel, 3 if phase == "warm" else 2)}


class BoolAttrModel(nn.Module):
    def __init__(self, residual: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.residual = residual

    def inner(self, x):
        h = self.lin(x)
        return h + x if self.residual else h

    forward = inner


class AttrBool(Case):
    name, changes = "attr_bool", "bool attribute `self.residual` True -> False"
    error_words = ("residual",)

    def build(self, phase, workdir):
        return {"main": seeded(BoolAttrModel, phase != "warm")}


class StrAttrModel(nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = act

    def inner(self, x):
        h = self.lin(x)
        if self.act == "relu":
            return torch.relu(h)
        return torch.sigmoid(h)

    forward = inner


class AttrStr(Case):
    name, changes = "attr_str", "str attribute choosing a branch `self.act` 'relu' -> 'sigmoid'"
    error_words = ("act",)

    def build(self, phase, workdir):
        return {"main": seeded(StrAttrModel, "sigmoid" if phase == "warm" else "relu")}


class NoneAttrModel(nn.Module):
    def __init__(self, offset: float | None) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.offset = offset

    def inner(self, x):
        h = self.lin(x)
        if self.offset is not None:
            h = h + self.offset
        return h

    forward = inner


class AttrNone(Case):
    name, changes = "attr_none", "optional attribute `self.offset` None -> 0.5"
    error_words = ("offset",)

    def build(self, phase, workdir):
        return {"main": seeded(NoneAttrModel, 0.5 if phase == "warm" else None)}


class TupleAttrModel(nn.Module):
    def __init__(self, coefs: tuple[float, float]) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.coefs = coefs

    def inner(self, x):
        return self.lin(x) * self.coefs[0] + self.coefs[1]

    forward = inner


class AttrTuple(Case):
    name, changes = "attr_tuple", "tuple attribute `self.coefs` (2.0, 1.0) -> (3.0, -1.0)"
    error_words = ("coefs",)

    def build(self, phase, workdir):
        return {"main": seeded(TupleAttrModel, (3.0, -1.0) if phase == "warm" else (2.0, 1.0))}


class Mode(enum.Enum):
    SIN = "sin"
    COS = "cos"


class EnumAttrModel(nn.Module):
    def __init__(self, mode: Mode) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.mode = mode

    def inner(self, x):
        h = self.lin(x)
        return torch.sin(h) if self.mode is Mode.SIN else torch.cos(h)

    forward = inner


class AttrEnum(Case):
    name, changes = "attr_enum", "enum attribute `self.mode` Mode.SIN -> Mode.COS"
    error_words = ("mode",)

    def build(self, phase, workdir):
        return {"main": seeded(EnumAttrModel, Mode.COS if phase == "warm" else Mode.SIN)}


# ---------------------------------------------------------------------------
# nested submodules, config objects
# ---------------------------------------------------------------------------


class KSub(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.norm = nn.LayerNorm(8)

    def forward(self, h):
        return self.norm(h)


class SubAttrModel(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.sub = KSub(k)

    def inner(self, x):
        return self.sub(self.lin(x)) * self.sub.k

    forward = inner


class SubAttr(Case):
    name, changes = "sub_attr", "attribute of a submodule `self.sub.k` 2 -> 5"
    error_words = ("sub", ".k")

    def build(self, phase, workdir):
        return {"main": seeded(SubAttrModel, 5 if phase == "warm" else 2)}


class BlockConfig:
    """A plain config object held by the module."""

    def __init__(self, use_bias: bool, mult: float) -> None:
        self.use_bias = use_bias
        self.mult = mult


class CfgModel(nn.Module):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.cfg = cfg

    def inner(self, x):
        h = self.lin(x)
        if self.cfg.use_bias:
            h = h + 1.0
        return h * self.cfg.mult

    forward = inner


class CfgAttr(Case):
    name, changes = "cfg_attr", "field of a config object `self.cfg.use_bias` True -> False"
    error_words = ("use_bias", "cfg")

    def build(self, phase, workdir):
        return {"main": seeded(CfgModel, BlockConfig(use_bias=phase != "warm", mult=1.5))}


class HFConfigModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        h = self.lin(x)
        if self.config.hidden_act == "silu":
            return F.silu(h)
        return F.gelu(h)

    forward = inner


class HFConfig(Case):
    name, changes = "hf_config", "field of a transformers `PretrainedConfig` `config.hidden_act` 'silu' -> 'gelu'"
    error_words = ("hidden_act", "config")

    def build(self, phase, workdir):
        from transformers import PretrainedConfig

        return {"main": seeded(HFConfigModel, PretrainedConfig(hidden_act="gelu" if phase == "warm" else "silu"))}


# ---------------------------------------------------------------------------
# globals of this module and of another one, closure cells
# ---------------------------------------------------------------------------


class SameGlobalModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        return self.lin(x) * SAME_SCALE

    forward = inner


class GlobalSame(Case):
    name, changes = "global_same", "global of the forward's own module `SAME_SCALE` (from $GUARD_MATRIX_SCALE) 1.0 -> 4.0"
    error_words = ("SAME_SCALE",)

    def build(self, phase, workdir):
        return {"main": seeded(SameGlobalModel)}


class OtherGlobalModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        h = self.lin(x)
        if guard_flags.USE_FAST_PATH:
            return h * 0.5
        return torch.tanh(h)

    forward = inner


class GlobalOther(Case):
    name, changes = "global_other", "global of another module `guard_flags.USE_FAST_PATH` (from $GUARD_MATRIX_FLAG) False -> True"
    error_words = ("USE_FAST_PATH", "guard_flags")

    def build(self, phase, workdir):
        return {"main": seeded(OtherGlobalModel)}


def make_scaler(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def scale(t):
        return t * factor

    return scale


SCALER = make_scaler(2.0)


class ClosureModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        return SCALER(self.lin(x))

    forward = inner


class ClosureCell(Case):
    name, changes = "closure_cell", "closure cell of a helper the forward calls (`make_scaler(2.0)` -> `make_scaler(3.0)`)"
    error_words = ("SCALER", "closure", "factor")

    def build(self, phase, workdir):
        global SCALER
        SCALER = make_scaler(3.0 if phase == "warm" else 2.0)
        return {"main": seeded(ClosureModel)}


# ---------------------------------------------------------------------------
# training mode, grad mode, autocast, default dtype
# ---------------------------------------------------------------------------


class TrainBeforeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        h = self.lin(x)
        if self.training:
            h = h * 0.5 + 1.0
        return h

    forward = inner


class TrainBefore(Case):
    name, changes = "train_before", "`model.train()` before the warm start (`if self.training:` in forward)"
    error_words = ("training",)

    def build(self, phase, workdir):
        m = seeded(TrainBeforeModel)
        return {"main": m.train() if phase == "warm" else m}


class TrainAfterModel(TrainBeforeModel):
    def inner(self, x):
        h = self.lin(x)
        if self.training:
            h = h * 0.25 - 1.0
        return h

    forward = inner


class TrainAfter(Case):
    name, changes = "train_after", "`model.train()` after the warm start served its first call (same process)"
    error_words = ("training",)

    def build(self, phase, workdir):
        return {"main": seeded(TrainAfterModel)}

    def warm_steps(self):
        return [Call("eval", x48(1)), Do("train()", lambda s: s["main"].train()), Call("train", x48(2))]


class GradModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        return torch.relu(self.lin(x))

    forward = inner


class GradMode(Case):
    name, changes = "grad_mode", "a call with grad enabled after a no_grad warm call (inputs not requiring grad)"
    error_words = ("grad",)

    def build(self, phase, workdir):
        return {"main": seeded(GradModel)}

    def warm_steps(self):
        return [Call("no_grad", x48(1)), Call("grad", x48(2), ctx="grad")]


class AutocastModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        return self.lin(x) + 1.0

    forward = inner


class Autocast(Case):
    name, changes = "autocast", 'warm call under `torch.autocast("cpu", dtype=torch.bfloat16)`, captured without'
    error_words = ("autocast",)

    def build(self, phase, workdir):
        return {"main": seeded(AutocastModel)}

    def warm_steps(self):
        return [Call("autocast", x48(1), ctx="autocast")]


class DefaultDtypeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        return self.lin(x) + torch.ones(8)

    forward = inner


class DefaultDtype(Case):
    name, changes = "default_dtype", "`torch.set_default_dtype(torch.float64)` around the warm call (forward calls torch.ones)"
    error_words = ("default dtype", "default_dtype", "float64")

    def build(self, phase, workdir):
        return {"main": seeded(DefaultDtypeModel)}

    def warm_steps(self):
        return [Call("float64", x48(1), ctx="float64")]


# ---------------------------------------------------------------------------
# container length, dict keys
# ---------------------------------------------------------------------------


class Scale(nn.Module):
    """Parameter-free layer: a longer list changes no parameter name or shape."""

    def __init__(self, s: float) -> None:
        super().__init__()
        self.s = s

    def forward(self, h):
        return torch.tanh(h) * self.s


class StackModel(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.layers = nn.ModuleList([Scale(1.5) for _ in range(n)])

    def inner(self, x):
        h = self.lin(x)
        for layer in self.layers:
            h = layer(h)
        return h

    forward = inner


class ModuleListLen(Case):
    name, changes = "modulelist_len", "`nn.ModuleList` of 2 -> 3 parameter-free layers (same parameters)"
    error_words = ("layers", "len")

    def build(self, phase, workdir):
        return {"main": seeded(StackModel, 3 if phase == "warm" else 2)}


class HeadsModel(nn.Module):
    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.heads = nn.ModuleDict({n: Scale(1.0) for n in names})

    def inner(self, x):
        h = self.lin(x)
        for name, head in self.heads.items():
            h = head(h) + len(name)
        return h

    forward = inner


class ModuleDictKeys(Case):
    name, changes = "moduledict_keys", "`nn.ModuleDict` keys ['a', 'bb'] -> ['a', 'cccc'] (same parameters)"
    error_words = ("heads", "keys")

    def build(self, phase, workdir):
        return {"main": seeded(HeadsModel, ["a", "cccc"] if phase == "warm" else ["a", "bb"])}


# ---------------------------------------------------------------------------
# non-tensor arguments
# ---------------------------------------------------------------------------


class AlphaModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x, alpha=1.0):
        return self.lin(x) * alpha

    forward = inner


def alpha_call(alpha: float, seed: int) -> Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]:
    return lambda: ((randn(4, 8, seed=seed),), {"alpha": alpha})


class KwargAlpha(Case):
    name, changes = "kwarg_alpha", "non-tensor argument `fn(x, alpha=3.0)` after caching `alpha=1.0`"
    error_words = ("alpha",)

    def build(self, phase, workdir):
        return {"main": seeded(AlphaModel)}

    def cold_steps(self):
        return [Call("alpha=1.0", alpha_call(1.0, 0))]

    def warm_steps(self):
        return [Call("alpha=3.0", alpha_call(3.0, 1))]


class AlphaSecondModel(AlphaModel):
    def inner(self, x, alpha=1.0):
        return self.lin(x) * alpha + 1.0

    forward = inner


class KwargAlphaSecond(KwargAlpha):
    name, changes = "kwarg_alpha_second", "`alpha=3.0` as the second call of a warm process that served `alpha=1.0` first"

    def build(self, phase, workdir):
        return {"main": seeded(AlphaSecondModel)}

    def warm_steps(self):
        return [Call("alpha=1.0", alpha_call(1.0, 1)), Call("alpha=3.0", alpha_call(3.0, 2))]


class UseCacheModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x, use_cache=True):
        h = self.lin(x)
        if use_cache:
            return h, h.sum(-1)
        return h, None

    forward = inner


class UseCache(Case):
    name, changes = "use_cache", "`use_cache=True` cached, `use_cache=False` warm"
    error_words = ("use_cache",)

    def build(self, phase, workdir):
        return {"main": seeded(UseCacheModel)}

    def cold_steps(self):
        return [Call("use_cache=True", lambda: ((randn(4, 8),), {"use_cache": True}))]

    def warm_steps(self):
        return [Call("use_cache=False", lambda: ((randn(4, 8, seed=1),), {"use_cache": False}))]


class AttentionsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.output_attentions = False  # the config default, as in transformers

    def inner(self, x, output_attentions=None):
        output_attentions = output_attentions if output_attentions is not None else self.output_attentions
        h = self.lin(x)
        if output_attentions:
            return h, h.softmax(-1)
        return h, None

    forward = inner


class OutputAttentionsNone(Case):
    name, changes = "output_attentions_none", "`output_attentions=True` cached, `output_attentions=None` warm (default False)"
    error_words = ("output_attentions",)

    def build(self, phase, workdir):
        return {"main": seeded(AttentionsModel)}

    def cold_steps(self):
        return [Call("output_attentions=True", lambda: ((randn(4, 8),), {"output_attentions": True}))]

    def warm_steps(self):
        return [Call("output_attentions=None", lambda: ((randn(4, 8, seed=1),), {"output_attentions": None}))]


# ---------------------------------------------------------------------------
# forward hooks
# ---------------------------------------------------------------------------


def add_one_hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    return output + 1.0


class HookedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = nn.Linear(8, 8)

    def inner(self, x):
        return torch.relu(self.sub(x)) * 2.0

    forward = inner


class HookBefore(Case):
    name, changes = "hook_before", "forward hook on a submodule registered before the warm start"
    error_words = ("hook",)

    def build(self, phase, workdir):
        m = seeded(HookedModel)
        if phase == "warm":
            m.sub.register_forward_hook(add_one_hook)
        return {"main": m}


class HookedAfterModel(HookedModel):
    def inner(self, x):
        return torch.relu(self.sub(x)) * 3.0

    forward = inner


class HookAfter(Case):
    name, changes = "hook_after", (
        "forward hook on a submodule registered after the first warm call (same process; `guards=\"call\"`: "
        "with the default `\"load\"`, hooks are checked when the warm start loads, not per call)"
    )
    error_words = ("hook",)

    def options(self, phase):
        return {"guards": "call"}

    def build(self, phase, workdir):
        return {"main": seeded(HookedAfterModel)}

    def warm_steps(self):
        return [
            Call("before hook", x48(1)),
            Do("register_forward_hook", lambda s: s["main"].sub.register_forward_hook(add_one_hook)),
            Call("after hook", x48(2)),
        ]


class TopHookModel(HookedModel):
    def inner(self, x):
        return torch.relu(self.sub(x)) * 4.0

    forward = inner


class HookTop(Case):
    name, changes = "hook_top", "forward hook on the loaded module itself, registered before the warm start (`load` and `backend` routes)"
    routes = ("load", "backend")  # cache_compile(m.inner) never runs the module's own hooks
    error_words = ("hook",)

    def build(self, phase, workdir):
        m = seeded(TopHookModel)
        if phase == "warm":
            m.register_forward_hook(add_one_hook)
        return {"main": m}


# ---------------------------------------------------------------------------
# the review: shape guards, strides
# ---------------------------------------------------------------------------

SHAPE_WORDS = ("shape", "size", "dim")


class DecodeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def inner(self, h):
        h = self.proj(h)
        if h.size(1) == 1:  # decode fast path
            return h * 0.5
        return h.softmax(-1)

    forward = inner


class DecodeBranch(Case):
    name, changes = "decode_branch", "dynamic=True, `if h.size(1) == 1` decode path: cached on seq 16, warm seq 1"
    dynamic = True
    error_words = SHAPE_WORDS

    def build(self, phase, workdir):
        return {"main": seeded(DecodeModel)}

    def cold_steps(self):
        return [Call("seq16", lambda: ((randn(2, 16, 8),), {}))]

    def warm_steps(self):
        return [Call("seq1", lambda: ((randn(2, 1, 8, seed=1),), {}))]


class WidthModel(nn.Module):
    def inner(self, x):
        if x.shape[1] > 4:
            return x * 2.0
        return x - 1.0

    forward = inner


class ShapeGt4(Case):
    name, changes = "shape_gt4", "dynamic=True, branch on `x.shape[1] > 4`: cached at 8, warm at 3"
    dynamic = True
    error_words = SHAPE_WORDS

    def build(self, phase, workdir):
        return {"main": seeded(WidthModel)}

    def cold_steps(self):
        return [Call("width8", lambda: ((randn(2, 8),), {}))]

    def warm_steps(self):
        return [Call("width3", lambda: ((randn(2, 3, seed=1),), {}))]


class PairModel(nn.Module):
    def inner(self, a, b):
        return torch.cat([a * 2.0, b + 1.0])

    forward = inner


class EqualDims(Case):
    name, changes = "equal_dims", "dynamic=True, two inputs of equal dims at capture (5, 5), warm (5, 2)"
    dynamic = True
    error_words = SHAPE_WORDS

    def build(self, phase, workdir):
        return {"main": seeded(PairModel)}

    def cold_steps(self):
        return [Call("5,5", lambda: ((randn(5, 4), randn(5, 4, seed=1)), {}))]

    def warm_steps(self):
        return [Call("5,2", lambda: ((randn(5, 4, seed=2), randn(2, 4, seed=3)), {}))]


class TransposedModel(nn.Module):
    def inner(self, x):
        return x * 2.0 + 1.0

    forward = inner


def transposed_call() -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (randn(6, 4, seed=1).t(),), {}


class Transposed(Case):
    name, changes = "transposed", "dynamic=True, a transposed (non-contiguous) input of the cached shape (4, 6)"
    dynamic = True
    error_words = ("stride", "contiguous", "layout")

    def build(self, phase, workdir):
        return {"main": seeded(TransposedModel)}

    def cold_steps(self):
        return [Call("contiguous", lambda: ((randn(4, 6),), {}))]

    def warm_steps(self):
        return [Call("transposed", transposed_call)]


class TransposedStaticModel(TransposedModel):
    def inner(self, x):
        return x * 3.0 - 1.0

    forward = inner


class TransposedStatic(Transposed):
    name, changes = "transposed_static", "dynamic=False, a transposed (non-contiguous) input of the cached shape (4, 6)"
    dynamic = False

    def build(self, phase, workdir):
        return {"main": seeded(TransposedStaticModel)}


# ---------------------------------------------------------------------------
# torch.cond branch subgraphs, compiler options, edited defaults
# ---------------------------------------------------------------------------


def cond_sin(x):
    return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))


def cond_exp(x):
    return torch.cond(x.sum() > 0, lambda t: t.exp() * 100, lambda t: t.cos(), (x,))


class CondBranches(Case):
    name, changes = "cond_branches", "two functions whose `torch.cond` branches compute sin vs exp()*100, one cache dir"
    eager_imports_dynamo = True
    error_words = ("cond",)
    uncached_with = {"eager": "the eager compiler stores the graph's Python code, not the branch GraphModules of torch.cond"}

    def build(self, phase, workdir):
        return {"sin": cond_sin, "exp": cond_exp}

    def cold_steps(self):
        return [Call("sin", lambda: ((positive(4, 8),), {}), "sin"), Call("exp", lambda: ((positive(4, 8),), {}), "exp")]

    def warm_steps(self):
        return [Call("exp", lambda: ((positive(4, 8, seed=1),), {}), "exp"),
                Call("sin", lambda: ((positive(4, 8, seed=2),), {}), "sin")]


def sin_as_cos(x):
    return torch.ops.aten.cos.default(x)


#: the decomposition of the options cases: sin computed as cos
SIN_AS_COS = {torch.ops.aten.sin.default: sin_as_cos}
#: the inner compilers that apply custom_decompositions (the eager one runs the Dynamo graph as it is)
DECOMPOSING = ("inductor", "torchair")


def sin_program(x):
    return torch.sin(x) * 2.0 + 1.0


def sin_program_kept(x):
    return torch.sin(x) * 3.0 + 1.0


def sin_program_added(x):
    return torch.sin(x) * 4.0 + 1.0


class OptionDropped(Case):
    name, changes = "option_dropped", "`custom_decompositions` (sin -> cos) cached, warm start without the option"
    error_words = ("decomposition",)
    program = staticmethod(sin_program)
    with_option = ("cold", "same")

    def build(self, phase, workdir):
        return {"main": self.program}

    def options(self, phase):
        return {"custom_decompositions": SIN_AS_COS} if phase in self.with_option else {}

    def reference(self, eager, args, kwargs, phase, compiler):
        if phase in self.with_option and compiler in DECOMPOSING:
            with _sin_as_cos():
                return eager(*args, **kwargs)
        return eager(*args, **kwargs)


class OptionKept(OptionDropped):
    name, changes = "option_kept", "`custom_decompositions` (sin -> cos) cached, warm start with the same option"
    program = staticmethod(sin_program_kept)
    with_option = ("cold", "same", "warm")


class OptionAdded(OptionDropped):
    name, changes = "option_added", "cached without options, warm start with `custom_decompositions` (sin -> cos)"
    program = staticmethod(sin_program_added)
    with_option = ("warm",)


class _sin_as_cos(torch.overrides.TorchFunctionMode):
    """Eager reference of a program compiled with SIN_AS_COS."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.sin, torch.Tensor.sin):
            func = torch.cos
        return func(*args, **(kwargs or {}))


EDITED_SOURCE = '''
import torch


def helper(h, factor={factor}):
    return h * factor


class EditedDefault(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def inner(self, x):
        return helper(self.lin(x))

    forward = inner
'''


class DefaultArg(Case):
    name, changes = "default_arg", "edited default argument of a helper (`factor=2.0` -> `3.0` in the source file)"
    error_words = ("helper", "default", "edited")

    def build(self, phase, workdir):
        src = os.path.join(workdir, "edited_src")
        os.makedirs(src, exist_ok=True)
        with open(os.path.join(src, "guard_edited_default.py"), "w") as f:
            f.write(EDITED_SOURCE.format(factor="3.0" if phase == "warm" else "2.0"))
        if src not in sys.path:
            sys.path.insert(0, src)
        module = importlib.import_module("guard_edited_default")
        return {"main": module.EditedDefault().eval()}


def edited_module(workdir: str, name: str, source: str) -> Any:
    """Write ``source`` as module ``name`` (this phase's version of a source file) and import it."""
    src = os.path.join(workdir, "edited_src")
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, f"{name}.py"), "w") as f:
        f.write(source)
    if src not in sys.path:
        sys.path.insert(0, src)
    return importlib.import_module(name)


# ---------------------------------------------------------------------------
# structured inputs, instances
# ---------------------------------------------------------------------------


class ListArgModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, xs):
        return self.lin(xs[0]) * xs[0].shape[0] + xs[1].mean(0)

    forward = inner


class NestedList(Case):
    name, changes = "nested_list", "tensors in a list argument with new shapes: [(2, 8), (3, 8)] -> [(5, 8), (6, 8)]"
    error_words = SHAPE_WORDS

    def build(self, phase, workdir):
        return {"main": seeded(ListArgModel)}

    def cold_steps(self):
        return [Call("small", lambda: (([randn(2, 8), randn(3, 8, seed=1)],), {}))]

    def warm_steps(self):
        return [Call("large", lambda: (([randn(5, 8, seed=2), randn(6, 8, seed=3)],), {}))]


class DictArgModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, d):
        return self.lin(d["a"]) * d["a"].shape[0] + d["b"].mean(0)

    forward = inner


class NestedDict(Case):
    name, changes = "nested_dict", "tensors in a dict argument with new shapes: {a: (2, 8), b: (3, 8)} -> {a: (5, 8), b: (6, 8)}"
    error_words = SHAPE_WORDS

    def build(self, phase, workdir):
        return {"main": seeded(DictArgModel)}

    def cold_steps(self):
        return [Call("small", lambda: (({"a": randn(2, 8), "b": randn(3, 8, seed=1)},), {}))]

    def warm_steps(self):
        return [Call("large", lambda: (({"a": randn(5, 8, seed=2), "b": randn(6, 8, seed=3)},), {}))]


@dataclasses.dataclass
class Batch:
    a: torch.Tensor
    b: torch.Tensor


class DataclassArgModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, batch):
        return self.lin(batch.a) * batch.a.shape[0] + batch.b.mean(0)

    forward = inner


class DataclassArg(Case):
    name, changes = "dataclass_arg", "a dataclass argument holding tensors, with new shapes (2, 8)/(3, 8) -> (5, 8)/(6, 8)"
    error_words = SHAPE_WORDS

    def build(self, phase, workdir):
        return {"main": seeded(DataclassArgModel)}

    def cold_steps(self):
        return [Call("small", lambda: ((Batch(randn(2, 8), randn(3, 8, seed=1)),), {}))]

    def warm_steps(self):
        return [Call("large", lambda: ((Batch(randn(5, 8, seed=2), randn(6, 8, seed=3)),), {}))]


class HeadedModel(nn.Module):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = head

    def inner(self, x):
        return self.head(self.lin(x))

    forward = inner


class TwoInstances(Case):
    name, changes = "two_instances", "two instances of one class, ReLU head vs Tanh head (same parameters), one cache dir"
    error_words = ("head",)

    def build(self, phase, workdir):
        relu, tanh = seeded(HeadedModel, nn.ReLU()), seeded(HeadedModel, nn.Tanh())
        return {"tanh": tanh, "relu": relu} if phase == "warm" else {"relu": relu, "tanh": tanh}

    def cold_steps(self):
        return [Call("relu", x48(0), "relu"), Call("tanh", x48(0), "tanh")]

    def warm_steps(self):
        return [Call("tanh", x48(1), "tanh"), Call("relu", x48(2), "relu")]


# ---------------------------------------------------------------------------
# parameters and buffers
# ---------------------------------------------------------------------------


class CastModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        return self.lin(x.to(self.lin.weight.dtype))

    forward = inner


class ParamDouble(Case):
    name, changes = "param_double", "parameter dtype float32 -> float64 via `.double()` (the forward casts its input)"
    error_words = ("dtype", "float64", "double")

    def build(self, phase, workdir):
        m = seeded(CastModel)
        return {"main": m.double() if phase == "warm" else m}


class BufferAddedModel(nn.Module):
    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("offset", torch.full((8,), 0.5))
        if extra:
            self.register_buffer("extra", torch.full((8,), 2.0))

    def inner(self, x):
        h = self.lin(x)
        for b in self.buffers():
            h = h + b
        return h

    forward = inner


class BufferAdded(Case):
    name, changes = "buffer_added", "a buffer added (the forward adds every buffer)"
    error_words = ("buffer", "extra")

    def build(self, phase, workdir):
        return {"main": seeded(BufferAddedModel, phase == "warm")}


class BufferRenamedModel(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer(name, torch.full((8,), 0.5))

    def inner(self, x):
        h = self.lin(x)
        for name, b in self.named_buffers():
            h = h + b * len(name)
        return h

    forward = inner


class BufferRenamed(Case):
    name, changes = "buffer_renamed", "a buffer renamed `off` -> `offset` (the forward weighs buffers by name length)"
    error_words = ("buffer", "off")

    def build(self, phase, workdir):
        return {"main": seeded(BufferRenamedModel, "offset" if phase == "warm" else "off")}


# ---------------------------------------------------------------------------
# issue 17: what a method call resolves to, what a graph calls by name, generated code,
# process state Dynamo folds, numpy values, torch function modes, mutable attributes
# ---------------------------------------------------------------------------


def patched_act(self, h):
    return torch.tanh(h) * 3.0


class PatchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def act(self, h):
        return torch.relu(h)

    def inner(self, x):
        return self.act(self.lin(x))

    forward = inner


_PATCHNET_ACT = PatchNet.act


class MethodPatched(Case):
    name, changes = "method_patched", "a method monkeypatched onto the class at run time (cold only): `PatchNet.act = patched_act`"
    error_words = ("act", "resolves")
    compilers = ("eager",)

    def build(self, phase, workdir):
        PatchNet.act = _PATCHNET_ACT if phase == "warm" else patched_act
        return {"main": seeded(PatchNet)}


class ActBaseA(nn.Module):
    def act(self, h):
        return torch.relu(h)


class ActBaseB(nn.Module):
    def act(self, h):
        return torch.sigmoid(h) - 0.5


class SwitchNet(ActBaseA):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        return self.act(self.lin(x))

    forward = inner


class BaseSwitched(Case):
    name, changes = "base_switched", "the base class switched (`SwitchNet.__bases__` ActBaseA -> ActBaseB: another `act`)"
    error_words = ("act", "resolves")
    compilers = ("eager",)

    def build(self, phase, workdir):
        SwitchNet.__bases__ = (ActBaseB,) if phase == "warm" else (ActBaseA,)
        return {"main": seeded(SwitchNet)}


OVERRIDE_SOURCE = '''
import torch


class Base(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def act(self, h):
        return torch.relu(h)


class Child(Base):
{override}
    def inner(self, x):
        return self.act(self.lin(x))

    forward = inner
'''


class SubclassOverride(Case):
    name, changes = "subclass_override", "an override of `act` added in the subclass (source file edited; the base's `act` unchanged)"
    error_words = ("act", "resolves", "edited")
    compilers = ("eager",)

    def build(self, phase, workdir):
        override = "    def act(self, h):\n        return torch.tanh(h) * 2.0\n" if phase == "warm" else ""
        module = edited_module(workdir, "guard_subclass_override", OVERRIDE_SOURCE.format(override=override))
        return {"main": module.Child().eval()}


ALLOW_SOURCE = '''
import torch
import torch._dynamo


@torch._dynamo.allow_in_graph
def helper(h):
    return torch.sin(h) * {factor}


class AllowNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def inner(self, x):
        return helper(self.lin(x)) + 1.0

    forward = inner
'''


class AllowInGraphEdit(Case):
    name, changes = "allow_in_graph_edit", "the body of a `torch._dynamo.allow_in_graph` helper edited (`* 2.0` -> `* 3.0`)"
    error_words = ("helper", "edited")
    eager_imports_dynamo = True  # the module itself imports torch._dynamo (allow_in_graph)

    def build(self, phase, workdir):
        module = edited_module(workdir, "guard_allow_in_graph", ALLOW_SOURCE.format(factor="3.0" if phase == "warm" else "2.0"))
        return {"main": module.AllowNet().eval()}


CUSTOM_OP_SOURCE = '''
import torch

LIB = torch.library.Library("tcbmatrix", "DEF")
LIB.define("scaled_sin(Tensor x) -> Tensor")


def scaled_sin_impl(x):
    return torch.sin(x) * {factor}


LIB.impl("scaled_sin", scaled_sin_impl, "CompositeImplicitAutograd")


class OpNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def inner(self, x):
        return torch.ops.tcbmatrix.scaled_sin(self.lin(x)) + 1.0

    forward = inner
'''


class CustomOpEdit(Case):
    name, changes = "custom_op_edit", "the Python CompositeImplicitAutograd kernel of a `torch.library` op edited (`* 2.0` -> `* 3.0`)"
    eager_imports_dynamo = True  # calling a Python-kernel op imports torch._dynamo (its dispatch wrapper)
    error_words = ("scaled_sin", "edited")

    def build(self, phase, workdir):
        module = edited_module(workdir, "guard_custom_op", CUSTOM_OP_SOURCE.format(factor="3.0" if phase == "warm" else "2.0"))
        return {"main": module.OpNet().eval()}


DATACLASS_SOURCE = '''
import dataclasses

import torch


@dataclasses.dataclass
class Scaled:
    h: torch.Tensor
    scale: float = {scale}


class DataclassNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def inner(self, x):
        out = Scaled(self.lin(x))
        return out.h * out.scale

    forward = inner
'''


class DataclassDefault(Case):
    name, changes = "dataclass_default", "an edited `@dataclass` field default (`scale: float = 2.0` -> `3.0`; its `__init__` is generated code)"
    error_words = ("__init__", "resolves", "edited")
    compilers = ("eager",)

    def build(self, phase, workdir):
        module = edited_module(workdir, "guard_dataclass_default", DATACLASS_SOURCE.format(scale="3.0" if phase == "warm" else "2.0"))
        return {"main": module.DataclassNet().eval()}


class ReluTwice(nn.Module):
    def forward(self, h):
        return torch.relu(h) * 2.0


class SigmoidThrice(nn.Module):
    def forward(self, h):
        return torch.sigmoid(h) * 3.0


class FxSubModel(nn.Module):
    def __init__(self, sub: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.sub = torch.fx.symbolic_trace(sub)

    def inner(self, x):
        return self.sub(self.lin(x))

    forward = inner


class FxSubmodule(Case):
    name, changes = "fx_submodule", "a torch.fx GraphModule submodule re-traced from other code (ReluTwice -> SigmoidThrice)"
    error_words = ("forward", "resolves", "sub")
    compilers = ("eager",)

    def build(self, phase, workdir):
        return {"main": seeded(FxSubModel, SigmoidThrice() if phase == "warm" else ReluTwice())}


class EnvReadModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        h = self.lin(x)
        if os.environ.get("GUARD_MATRIX_FORWARD_ENV"):
            return h * 2.0
        return h

    forward = inner


class EnvRead(Case):
    name, changes = "env_read", "an environment variable read in forward (`os.environ.get`): unset cold, set warm"
    error_words = ("GUARD_MATRIX_FORWARD_ENV", "environment")
    compilers = ("eager",)

    def build(self, phase, workdir):
        return {"main": seeded(EnvReadModel)}


def _process_group(rank: int | None) -> None:
    """A (fake, one-process) default process group of world size 2 with this rank, or none."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if rank is not None:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=rank, world_size=2, store=FakeStore())


class DistModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        h = self.lin(x)
        if torch.distributed.is_initialized():
            return h * (torch.distributed.get_rank() + 2.0)
        return h

    forward = inner


class DistInitialized(Case):
    name, changes = "dist_initialized", "`dist.is_initialized()` in forward: cached in a plain process, served inside a process group"
    error_words = ("process group",)
    compilers = ("eager",)

    def build(self, phase, workdir):
        _process_group(0 if phase == "warm" else None)
        return {"main": seeded(DistModel)}

    def cold_steps(self):
        return [Call("x", x48()), Do("no group", lambda s: _process_group(None))]

    def warm_steps(self):
        return [Call("x", x48(1)), Do("no group", lambda s: _process_group(None))]


class DistRankModel(DistModel):
    def inner(self, x):
        h = self.lin(x)
        if torch.distributed.is_initialized():
            return h * (torch.distributed.get_rank() + 3.0)
        return h

    forward = inner


class DistRank(DistInitialized):
    name, changes = "dist_rank", "`dist.get_rank()` in forward, one cache dir: cached by rank 1, served to rank 0"

    def build(self, phase, workdir):
        _process_group(0 if phase == "warm" else 1)
        return {"main": seeded(DistRankModel)}


class HashModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        return self.lin(x) * float(hash("npu_cached") % 7 + 1)

    forward = inner


class HashStr(Case):
    name, changes = "hash_str", "`hash(str)` in forward (randomized per process: such a frame is never replayed)"
    error_words = ("hash",)
    compilers = ("eager",)
    uncached_with = {"eager": "hash(str) differs per process: the frame is not replayable (a counted fallback)"}
    eager_imports_dynamo = True  # even unchanged it is compiled (by Dynamo) at every start

    def build(self, phase, workdir):
        return {"main": seeded(HashModel)}


class NumpyAttrModel(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        import numpy as np

        self.lin = nn.Linear(8, 8)
        self.scale = 1 / np.sqrt(d)

    def inner(self, x):
        return self.lin(x) * self.scale

    forward = inner


class NumpyAttr(Case):
    name, changes = "numpy_attr", "a numpy float attribute `self.scale = 1 / np.sqrt(d)`, d 4 -> 16"
    error_words = ("scale",)
    compilers = ("eager",)

    def build(self, phase, workdir):
        return {"main": seeded(NumpyAttrModel, 16 if phase == "warm" else 4)}


def numpy_call(seed: int, n: int = 8) -> Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]:
    return lambda: ((randn(4, 8, seed=seed), randn(n, seed=seed + 10).numpy()), {})


class NumpyArgModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x, a):
        return self.lin(x) + torch.as_tensor(a)

    forward = inner


class NumpyArg(Case):
    name, changes = "numpy_arg", "a numpy array argument, new values (cold and warm) and a new shape (8,) -> (1,) warm"
    error_words = SHAPE_WORDS
    compilers = ("eager",)

    def build(self, phase, workdir):
        return {"main": seeded(NumpyArgModel)}

    def cold_steps(self):
        return [Call("a(8)", numpy_call(0))]

    def warm_steps(self):
        return [Call("a(8)", numpy_call(1)), Call("a(1)", numpy_call(2, 1))]


class DefaultDeviceModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def inner(self, x):
        return self.lin(x) + torch.arange(8)

    forward = inner


class DefaultDevice(Case):
    name, changes = "default_device", '`torch.set_default_device("cpu")` in the cold script, not in the warm one'
    error_words = ("function mode", "device")
    compilers = ("eager",)

    def build(self, phase, workdir):
        torch.set_default_device(None if phase == "warm" else "cpu")
        return {"main": seeded(DefaultDeviceModel)}

    def cold_steps(self):
        return [Call("x", x48()), Do("reset", lambda s: torch.set_default_device(None))]


class KVModel(nn.Module):
    """A self-growing cache attribute, as a hand-written decoder's KV cache."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.cache = torch.zeros(0, 8)

    def inner(self, x):
        self.cache = torch.cat([self.cache, self.lin(x)])
        return self.cache.sum(0) * self.cache.shape[0]

    forward = inner


def kv_call(seed: int) -> Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]:
    return lambda: ((randn(1, 8, seed=seed),), {})


class KVCacheLoad(Case):
    name, changes = "kv_cache_load", "a self-growing cache attribute (`self.cache = torch.cat(...)`), 3 decode steps per process"
    error_words = ("cache",)
    guards = "load"

    def options(self, phase):
        return {"guards": self.guards}

    def build(self, phase, workdir):
        self._twin = seeded(KVModel)  # the eager reference's own cache (a call grows it)
        return {"main": seeded(KVModel)}

    def reference(self, eager, args, kwargs, phase, compiler):
        twin = getattr(self._twin, eager.__name__) if isinstance(eager, types.MethodType) else self._twin
        return twin(*args, **kwargs)

    def cold_steps(self):
        return [Call(f"step{i}", kv_call(i)) for i in range(3)]

    def warm_steps(self):
        return [Call(f"step{i}", kv_call(i + 5)) for i in range(3)]


class KVCacheCall(KVCacheLoad):
    name = "kv_cache_call"
    changes = 'the same cache pattern with `guards="call"` (variants chosen per call, not rejected at load)'
    guards = "call"
    compilers = ("eager",)


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        AttrFloat(), AttrInt(), AttrBool(), AttrStr(), AttrNone(), AttrTuple(), AttrEnum(),
        SubAttr(), CfgAttr(), HFConfig(),
        GlobalSame(), GlobalOther(), ClosureCell(),
        TrainBefore(), TrainAfter(), GradMode(), Autocast(), DefaultDtype(),
        ModuleListLen(), ModuleDictKeys(),
        KwargAlpha(), KwargAlphaSecond(), UseCache(), OutputAttentionsNone(),
        HookBefore(), HookAfter(), HookTop(),
        DecodeBranch(), ShapeGt4(), EqualDims(), Transposed(), TransposedStatic(),
        CondBranches(), OptionDropped(), OptionKept(), OptionAdded(), DefaultArg(),
        NestedList(), NestedDict(), DataclassArg(), TwoInstances(),
        ParamDouble(), BufferAdded(), BufferRenamed(),
        MethodPatched(), BaseSwitched(), SubclassOverride(), AllowInGraphEdit(), CustomOpEdit(),
        DataclassDefault(), FxSubmodule(), EnvRead(), DistInitialized(), DistRank(), HashStr(),
        NumpyAttr(), NumpyArg(), DefaultDevice(), KVCacheLoad(), KVCacheCall(),
    )
}

#: the subset run through `torch.compile(backend="npu_cached")` cold + `load()` warm
LOAD_ROUTE = (
    "attr_float", "attr_str", "sub_attr", "global_other", "closure_cell", "train_before", "train_after",
    "grad_mode", "autocast", "default_dtype", "modulelist_len", "moduledict_keys", "kwarg_alpha",
    "kwarg_alpha_second", "hook_before", "hook_top", "decode_branch", "equal_dims", "transposed",
    "cond_branches", "option_dropped", "option_kept", "option_added", "nested_list", "two_instances",
    "param_double", "buffer_added",
    "method_patched", "base_switched", "allow_in_graph_edit", "custom_op_edit", "fx_submodule", "dist_rank",
    "dist_initialized", "env_read",
    "numpy_attr", "default_device", "kv_cache_load", "kv_cache_call",
)


#: with Inductor (every warm change is a real compile), the load route runs the cases where that
#: route differs: graph-level keys, options, instances, module hooks, shapes
INDUCTOR_LOAD_ROUTE = (
    "attr_float", "train_after", "kwarg_alpha", "autocast", "default_dtype", "modulelist_len", "hook_top",
    "decode_branch", "equal_dims", "transposed", "cond_branches", "option_dropped", "option_kept", "option_added",
    "nested_list", "two_instances", "allow_in_graph_edit", "custom_op_edit", "kv_cache_load",
)


def cases_for(route: str, compiler: str) -> list[str]:
    if route == "cache_compile":
        names = list(CASES)
    elif route == "backend":  # warm torch.compile replaying: the checks differ from load()'s, not the graphs
        names = list(LOAD_ROUTE) if compiler == "eager" else []
    else:
        names = list(INDUCTOR_LOAD_ROUTE if compiler == "inductor" else LOAD_ROUTE)
    return [n for n in names if route in CASES[n].routes and compiler in CASES[n].compilers]
