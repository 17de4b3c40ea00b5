"""The fourth review's stale replays: a warm start that served a cached Inductor graph where
Dynamo would have re-traced (or run eagerly). One cold process caches the model; each warm
process changes one thing and must match eager (and a fresh ``torch.compile``):

* ``silu`` / ``relu``: a torch function replaced at its import path (``F.silu = ...``,
  ``torch.relu = ...``). Dynamo guards the function by identity; we found it again by its
  path, i.e. found the replacement, and replayed kernels computing the original.
* ``mode``: a ``TorchDispatchMode`` active around the call. Dynamo does not compile under one
  (the call runs eagerly, through the mode); the replayed kernels bypassed the mode.

With the ``eager`` inner compiler the graph calls the live function (through the mode), so the
answers were right by accident: these need compiled kernels.
"""

from __future__ import annotations

import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import os
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode
    import torchair_cached_backend as tcb
    from torchair_cached_backend.bypass.loader import CacheMiss
    from child_helpers import LOGS, frames, stats

    class Doubler(TorchDispatchMode):
        # a user mode that changes what sin computes (as a quantization simulator would)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 2 if func is torch.ops.aten.sin.default else out

    class Act(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.sin(F.silu(torch.relu(self.lin(x)) - 0.1))

    def tripled(t):
        return t * 3.0

    def absolute(t):
        return t.abs()

    ROOT = os.environ["ROOT"]
    m = Act().eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = {}
    with torch.no_grad():
        if os.environ["PHASE"] == "cold":
            f = torch.compile(m, backend="npu_cached", options={"cache_dir": ROOT, "compiler": "inductor"})
            emit({"ok": bool(torch.allclose(f(x), m(x), atol=1e-5)), "stats": stats()})
            raise SystemExit
        silu, relu = F.silu, torch.relu
        for change in ("none", "silu", "relu", "mode_route", "mode"):
            tcb.reset_stats()
            f0, l0 = frames(), len(LOGS)
            F.silu, torch.relu = (tripled if change == "silu" else silu), (absolute if change == "relu" else relu)
            entry = out[change] = {"miss": None}
            try:  # a miss is reported, not compiled (each change loads the cache as the cold process left it)
                if change == "mode_route":
                    f = torch.compile(m, backend="npu_cached", options={"cache_dir": ROOT, "compiler": "inductor"})
                else:
                    f = tcb.load(m, ROOT, compiler="inductor", fallback=False)
            except CacheMiss as miss:
                entry["miss"] = str(miss)
            else:
                if change.startswith("mode"):
                    with Doubler():
                        got, want = f(x), m(x)
                else:
                    got, want = f(x), m(x)
                entry["ok"] = bool(torch.allclose(got, want, atol=1e-5))
            entry.update(frames=frames() - f0, stats=stats(), logs=LOGS[l0:])
    emit(out)
    """
)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    from subprocess_helpers import run_python

    root = tmp_path_factory.mktemp("round4_stale")
    env = {"ROOT": str(root / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}
    cold = run_python(CHILD, env=dict(env, PHASE="cold"))
    assert cold["ok"] and cold["stats"]["misses"] == 1, cold
    return run_python(CHILD, env=dict(env, PHASE="warm", TORCHINDUCTOR_CACHE_DIR=str(root / "inductor_warm")))


@pytest.mark.slow
def test_unchanged_it_replays(warm):
    entry = warm["none"]
    assert entry["miss"] is None and entry["ok"], entry
    assert entry["frames"] == 0 and entry["stats"]["bypass_loads"] == 1 and entry["stats"]["fallbacks"] == 0, entry


@pytest.mark.slow
@pytest.mark.parametrize("change", ["silu", "relu"])
def test_a_torch_function_replaced_at_its_path_is_not_the_cached_one(warm, change):
    entry = warm[change]
    assert entry.get("ok") is not False, f"the replay computed the original {change}: {entry}"
    assert entry["miss"] and "not a replacement" in entry["miss"], entry


@pytest.mark.slow
def test_a_torch_dispatch_mode_runs_the_call_eagerly_as_torch_compile_does(warm):
    entry = warm["mode"]
    assert entry["miss"] is None and entry["ok"], f"the replayed kernels bypassed the dispatch mode: {entry}"
    assert entry["stats"]["fallback_reasons"] == {"no cached variant matches the call": 1}, entry
    assert any("dispatch mode" in line for line in entry["logs"]), entry["logs"]
    assert entry["frames"] == 0, "Dynamo does not compile under a dispatch mode: the call ran eagerly"


BACKWARD_HOOKS = textwrap.dedent(
    """
    import os
    import torch
    import torch.nn.modules.module as nn_module
    import torchair_cached_backend as tcb
    from child_helpers import LOGS, frames, stats

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)
            self.out = torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.out(torch.relu(self.lin(x)))

    def halve(module, grad_input, grad_output):  # a gradient-scaling hook (as a clipping library's)
        seen.append(type(module).__name__)
        return tuple(None if g is None else g * 0.5 for g in grad_input)

    ROOT, PHASE = os.environ["ROOT"], os.environ["PHASE"]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = {}
    for route in (("cold",) if PHASE == "cold" else ("load", "compile")):
        for where in ("global", "root"):
            m, ref = Net(), Net()
            if route == "cold":
                f = torch.compile(m, backend="npu_cached", options={"cache_dir": ROOT, "compiler": "eager"})
            elif route == "load":
                f = tcb.load(m, ROOT, compiler="eager")
            else:
                f = torch.compile(m, backend="npu_cached", options={"cache_dir": ROOT, "compiler": "eager"})
            handles = []
            if route != "cold":  # registered after the warm start, before the step
                if where == "global":
                    handles.append(nn_module.register_module_full_backward_hook(halve))
                else:
                    handles += [m.register_full_backward_hook(halve), ref.register_full_backward_hook(halve)]
            seen = []
            xa = x.detach().clone().requires_grad_(True)
            f(xa).sum().backward()
            got_seen = list(seen)
            seen = []
            xb = x.detach().clone().requires_grad_(True)
            # the reference: eager, or a fresh torch.compile (whose OptimizedModule is a module too)
            (ref if route == "load" else torch.compile(ref, backend="eager"))(xb).sum().backward()
            out[f"{route}-{where}"] = {
                "ok": bool(torch.allclose(xa.grad, xb.grad)) and all(
                    torch.allclose(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters())),
                "hooks": got_seen, "eager_hooks": list(seen)}
            for h in handles:
                h.remove()
    emit({"out": out, "frames": frames(), "stats": stats(), "logs": LOGS[-6:]})
    """
)


def test_backward_hooks_registered_after_a_warm_start_run(run, tmp_path):
    """A full backward hook (global, or the root module's) registered after the warm start:
    eager (and a fresh torch.compile, which breaks the graph at each module call for a global
    one) runs it in the backward and uses the gradients it returns; the replay skipped it."""
    env = {"ROOT": str(tmp_path)}
    cold = run(BACKWARD_HOOKS, env=dict(env, PHASE="cold"))
    assert all(v["ok"] for v in cold["out"].values()), cold
    warm = run(BACKWARD_HOOKS, env=dict(env, PHASE="warm"))
    for name, entry in warm["out"].items():
        assert entry["ok"], f"{name}: gradients differ from eager's (the hook did not run): {entry}"
        assert sorted(entry["hooks"]) == sorted(entry["eager_hooks"]), f"{name}: {entry}"
    assert warm["stats"]["fallback_reasons"].get("global module hooks registered (run eagerly)") == 1, warm["stats"]


@pytest.mark.slow
def test_a_torch_dispatch_mode_on_the_backend_route_runs_eagerly_and_is_counted(warm):
    entry = warm["mode_route"]
    assert entry["ok"] and entry["frames"] == 0, entry
    assert entry["stats"]["fallback_reasons"] == {"backend route: a torch dispatch mode is active (runs eagerly)": 1}, \
        f"the call ran eagerly uncounted: {entry}"


FORWARD_HOOK_ROUTE = textwrap.dedent(
    """
    import os
    import torch
    import torch.nn.modules.module as nn_module
    from child_helpers import LOGS, frames, stats

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.sin(self.lin(x))

    m = Net().eval()
    x = torch.randn(4, 8)
    if os.environ["PHASE"] == "warm":  # registered before the first call of the warm process
        nn_module.register_module_forward_hook(lambda mod, args, out: out * 2 if isinstance(mod, torch.nn.Linear) else out)
    with torch.no_grad():
        f = torch.compile(m, backend="npu_cached", options={"cache_dir": os.environ["ROOT"], "compiler": "eager"})
        ok = bool(torch.allclose(f(x), m(x)))
    emit({"ok": ok, "frames": frames(), "stats": stats(), "logs": LOGS[-4:]})
    """
)


def test_a_global_forward_hook_before_the_first_call_of_the_backend_route(run, tmp_path):
    """The backend route installed the replay for the first call (the guard that fails while a
    global hook is registered is only checked on later calls): the hook did not run."""
    env = {"ROOT": str(tmp_path)}
    assert run(FORWARD_HOOK_ROUTE, env=dict(env, PHASE="cold"))["ok"]
    warm = run(FORWARD_HOOK_ROUTE, env=dict(env, PHASE="warm"))
    assert warm["ok"], f"the replayed graph ran without the global hook: {warm['logs']}"
    assert warm["stats"]["fallback_reasons"].get("backend route: global module hooks registered (traced)"), warm["stats"]
