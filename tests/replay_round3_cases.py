"""Cases of issue 17's "never replays" list (and the hook defects), run by
tests/test_replay_round3.py: each ``case_*`` is called in a cold process, then in a
fresh warm one (then a second warm one), with its own cache dir, and returns what
the test asserts. Cold compiles with ``torch.compile(..., backend="npu_cached")``
(or ``cache_compile``); warm loads with ``tcb.load`` (or ``cache_compile``). The
eager inner compiler keeps it fast.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import torchair_cached_backend as tcb

OPTS = {"compiler": "eager"}


def serve(target, phase: str, cache_dir: str, dynamic=None):
    """cold: torch.compile(npu_cached); warm: tcb.load (compiles on a miss)."""
    if phase == "cold":
        return torch.compile(target, backend="npu_cached", dynamic=dynamic, options=dict(OPTS, cache_dir=cache_dir))
    return tcb.load(target, cache_dir, **OPTS)


def close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-5))


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x).relu())


# -- 1. hooks ------------------------------------------------------------------------------


def case_global_hook(phase: str, d: str) -> dict:
    """A global forward hook registered before load() runs around the submodules too."""
    m, x = TwoLinear().eval(), torch.randn(2, 4)
    calls: list[str] = []
    if phase == "cold":
        return {"ok": close(serve(m, phase, d)(x), m(x))}
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: (calls.append(type(mod).__name__), out * 2.0)[1])
    try:
        expected, eager_calls = m(x), list(calls)
        calls.clear()
        f = serve(m, phase, d)
        got = f(x)
        return {"ok": close(got, expected), "calls": calls, "eager_calls": eager_calls}
    finally:
        handle.remove()


def case_forward_assigned(phase: str, d: str) -> dict:
    """``model.forward = tcb.load(model, dir)`` with a forward hook: the hook runs once
    per call, and every call replays (or compiles), never plain eager."""
    m, x = TwoLinear().eval(), torch.randn(2, 4)
    calls: list[int] = []
    m.register_forward_hook(lambda mod, args, out: (calls.append(1), out + 1.0)[1])
    expected = m(x)
    calls.clear()
    if phase == "cold":
        m.forward = tcb.load(m, d, **OPTS)  # a miss: compiles (and caches) through the stand-in
    else:
        m.forward = tcb.load(m, d, **OPTS)
    outs = [m(x), m(x)]
    return {"ok": all(close(o, expected) for o in outs), "hook_calls": len(calls),
            "installed": "forward" in m.__dict__}


# -- 10. transformers' compile path ---------------------------------------------------------


def case_generate(phase: str, d: str) -> dict:
    """``model.generate(..., compile_config=CompileConfig(backend="npu_cached"))`` with a
    StaticCache cold; warm, what transformers compiles (``model.__call__``) is loaded."""
    import hf_tiny
    from transformers import CompileConfig

    model, _ = hf_tiny.build("llama")
    ids = hf_tiny.prompt(5)
    common = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")
    expected = model.generate(ids, disable_compile=True, **common)
    config = CompileConfig(backend="npu_cached", mode=None, options=dict(OPTS, cache_dir=d))
    config._compile_all_devices = True  # transformers compiles on cuda/xpu/... only unless told so
    if phase != "cold":
        replay = tcb.load(model.__call__, d, **OPTS)
        model.get_compiled_call = lambda compile_config: replay
    got = model.generate(ids, compile_config=config, **common)
    return {"ok": got.tolist() == expected.tolist()}


# -- 7. more static buckets than the default variant bound ---------------------------------

BUCKETS = 18  # > 16, the default ``max_variants``


def bucket_fn(x):
    return (x * 2.0).cos() + 1.0


def _stored_variants(d: str) -> list[int]:
    from torchair_cached_backend.bypass.program import program_store

    store = program_store(d)
    return [len(store.load(k).manifest["program"]["variants"]) for k in store.keys()]


def _buckets(phase: str, d: str, sizes: list[int], options: dict) -> dict:
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64  # one frame per bucket (Dynamo's default stops at 8)
    if phase == "cold":
        f = torch.compile(bucket_fn, backend="npu_cached", dynamic=False, options=dict(OPTS, cache_dir=d, **options))
    else:
        f = tcb.load(bucket_fn, d, dynamic=False, **OPTS, **options)
    xs = [torch.randn(b, 4) for b in sizes]
    return {"ok": all(close(f(x), bucket_fn(x)) for x in xs), "stored": _stored_variants(d)}


def case_buckets_default_bound(phase: str, d: str) -> dict:
    """18 static buckets (> the default bound 16) served by every start."""
    return _buckets(phase, d, list(range(1, BUCKETS + 1)), {})


def case_buckets_max_variants(phase: str, d: str) -> dict:
    """max_variants=2: a start serving buckets 4, 5 keeps those two and evicts the three
    buckets an earlier start stored and this one did not use."""
    return _buckets(phase, d, [1, 2, 3] if phase == "cold" else [4, 5], {"max_variants": 2})


# -- 3. a forward that starts with a print --------------------------------------------------


class PrintsFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        print("forward called")
        return self.lin(x).relu()


def case_print_first(phase: str, d: str) -> dict:
    m, x = PrintsFirst().eval(), torch.randn(2, 4)
    return {"ok": close(serve(m, phase, d)(x), m.lin(x).relu())}


# -- 8. torch.cond and checkpoint with the eager inner compiler ------------------------------


class WithCond(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return torch.cond(y.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (y,))


class WithCheckpoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def block(self, t):
        return self.lin(t).relu()

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False) + 1.0


def case_cond(phase: str, d: str) -> dict:
    m = WithCond().eval()
    f = serve(m, phase, d)
    xs = [torch.randn(2, 4), -torch.randn(2, 4).abs() * 10]
    return {"ok": all(close(f(x), m(x)) for x in xs)}


def case_checkpoint(phase: str, d: str) -> dict:
    m, x = WithCheckpoint().eval(), torch.randn(2, 4)
    return {"ok": close(serve(m, phase, d)(x), m.block(x) + 1.0)}


# -- 9. a class defined inside a function; a staticmethod -------------------------------------


def make_local_net() -> nn.Module:
    class LocalNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).sigmoid() * 2.0

    return LocalNet().eval()


def case_local_class(phase: str, d: str) -> dict:
    m, x = make_local_net(), torch.randn(2, 4)
    return {"ok": close(serve(m, phase, d)(x), m(x))}


class Ops:
    @staticmethod
    def scale(x, k: float = 3.0):
        return (x * k).tanh()


def case_staticmethod(phase: str, d: str) -> dict:
    x = torch.randn(2, 4)
    f = serve(Ops.scale, phase, d)
    return {"ok": close(f(x), Ops.scale(x)) and close(f(x, 2.0), Ops.scale(x, 2.0))}


# -- 2. a graph break inside a submodule's forward or a helper -------------------------------


class NoisyLayer(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.n = n

    def forward(self, x):
        y = self.lin(x).relu()
        if self.n == 1:
            print("layer", self.n, "mean", float(y.mean()))  # .item() + print: graph breaks inside the layer
        return y + x


class WithNoisyLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(NoisyLayer(i) for i in range(3))
        self.head = nn.Linear(4, 2)

    def helper(self, y):
        print("helper")  # a graph break inside a helper method
        return y * 2.0

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(self.helper(x))


class Sandwich(nn.Module):
    """Dynamo compiles this frame and breaks at the call of the noisy layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.pre = nn.Linear(4, 4)
        self.mid = NoisyLayer(1)
        self.post = nn.Linear(4, 4)

    def forward(self, x):
        return self.post(self.mid(self.pre(x).sin())).cos()


def case_break_in_submodule(phase: str, d: str) -> dict:
    """A graph break inside a layer's forward and inside a helper: the root frame is
    skipped by Dynamo (the break is in a loop over layers) or compiled with a break at
    the layer's call; either way the callees' own programs replay."""
    ok = True
    for name, m in (("loop", WithNoisyLayers().eval()), ("sandwich", Sandwich().eval())):
        x = torch.randn(2, 4)
        f = serve(m, phase, f"{d}_{name}")
        ok = ok and close(f(x), m(x)) and close(f(x), m(x))
    return {"ok": ok}


# -- 6. several instances of one class with a graph break (torchair-style per-layer) ----------


class CachedLayer(nn.Module):
    def __init__(self, i: int, cache_dir: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.k = float(i + 1)
        self.cached = tcb.cache_compile(self.inner_forward, cache_dir=cache_dir, compiler="eager")

    def inner_forward(self, x):
        y = self.lin(x) * self.k
        torch._dynamo.graph_break()
        return (y + self.k).relu()

    def forward(self, x):
        return self.cached(x)


def case_instances_with_break(phase: str, d: str) -> dict:
    torch.manual_seed(0)
    layers = [CachedLayer(i, d) for i in range(6)]
    x = torch.randn(2, 4)
    ok = True
    for _ in range(2):
        y = x
        for layer in layers:
            out = layer(y)
            ok = ok and close(out, layer.inner_forward(y))
            y = out
    return {"ok": ok}


# -- 5. a value read only after a graph break changes ---------------------------------------


class LateRead(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x):
        y = self.lin(x).relu()
        torch._dynamo.graph_break()
        return y * self.scale  # read only after the break


def case_late_read(phase: str, d: str) -> dict:
    m, x = LateRead(2.0 if phase == "cold" else 3.0).eval(), torch.randn(2, 4)
    f = serve(m, phase, d)
    return {"ok": close(f(x), m(x)) and close(f(x), m(x))}


# -- 4. decorated forwards and torch.nn built-in roots (Dynamo's wrap_inline frames) --------


class NoGradForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    @torch.no_grad()
    def forward(self, x):
        return self.lin(x).tanh()


class InferenceForward(NoGradForward):
    @torch.inference_mode()
    def forward(self, x):
        return self.lin(x).sigmoid()


def _builtin_roots() -> dict:
    torch.manual_seed(0)
    return {
        "seq_a": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).eval(),
        "seq_b": nn.Sequential(nn.Linear(4, 4), nn.Tanh()).eval(),  # another Sequential, same cache dir
        "encoder": nn.TransformerEncoderLayer(d_model=4, nhead=2, dim_feedforward=8, dropout=0.0,
                                              batch_first=True).eval(),
    }


def case_wrapped_roots(phase: str, d: str) -> dict:
    """Each model in its own dir except the two Sequentials, which share one."""
    x = torch.randn(2, 3, 4)
    models = {"no_grad": NoGradForward().eval(), "inference": InferenceForward().eval(), **_builtin_roots()}
    ok = {}
    for name, m in models.items():
        sub = "seq" if name.startswith("seq") else name
        f = serve(m, phase, f"{d}_{sub}")
        ok[name] = close(f(x), m(x)) and close(f(x), m(x))
    return {"ok": all(ok.values()), "each": ok}


def noisy_helper(y):
    """A module-level helper with a graph break, called by a forward."""
    print("noisy helper")
    return (y * 3.0).sin()


class CallsHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return noisy_helper(self.lin(x)) + 1.0


def case_break_in_function(phase: str, d: str) -> dict:
    m, x = CallsHelper().eval(), torch.randn(2, 4)
    f = serve(m, phase, d)
    return {"ok": close(f(x), m(x)) and close(f(x), m(x))}
