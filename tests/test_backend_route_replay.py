"""The backend route replays: a warm ``torch.compile(model, backend="npu_cached")`` whose
program is cached installs the replayed bytecode and its checks into Dynamo's frame cache
(``bypass/frame_install.py``) - no Dynamo frame traced, no inner compile - and whatever
the checks reject goes to Dynamo's normal path, giving the changed program's answer.

Cold and warm run in fresh processes (one cold process per model kind, shared by the
tests of the module); every warm process reports Dynamo's frame count, the installs and
the outputs against eager.
"""

from __future__ import annotations

import os
import shutil

import pytest
from subprocess_helpers import run_python

pytestmark = pytest.mark.timeout(600)

PRELUDE = r'''
import os, sys
import torch
import torchair_cached_backend as tcb
from torch._dynamo.utils import counters

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.scale = 2.0

    def act(self, y):
        return torch.relu(y)

    def forward(self, x):
        return self.b(self.act(self.a(x) * self.scale))

class Broken(Net):
    def forward(self, x):
        y = self.a(x) * self.scale
        print("", end="")  # a graph break: the continuation replays too
        return self.b(self.act(y))

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.l(x))

class Loop(torch.nn.Module):
    """A graph break inside a loop over blocks: Dynamo skips this frame, each block's forward replays."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            print("", end="")
        return x

import functools

def deco(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return wrapper

class Decorated(Net):
    """Two methods behind one decorator: one wrapper code object, each with its own cells."""

    @deco
    def forward(self, x):
        return self.b(self.act(self.a(x) * self.scale))

    @deco
    def other(self, x):
        return self.a(x) * 10

def build(cls, seed=0):
    torch.manual_seed(seed)
    return cls().eval()

def compiled(model, cache_dir, **kw):
    opts = dict({"cache_dir": cache_dir, "compiler": "eager"}, **kw.pop("options", {}))
    return torch.compile(model, backend="npu_cached", options=opts, **kw)

def frames():
    return counters["frames"]["total"]

def installs():
    from torchair_cached_backend.bypass import frame_install
    return frame_install.counts["installed"]

def close(a, b):
    return bool(torch.allclose(a, b, atol=1e-5))

X4, X7 = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.randn(7, 8, generator=torch.Generator().manual_seed(2))
'''

COLD_PLAIN = PRELUDE + r'''
root = os.environ["ROOT"]
with torch.no_grad():
    for name, cls, kw in (("net", Net, {}), ("broken", Broken, {}), ("loop", Loop, {}), ("deco", Decorated, {}), ("dyn", Net, {"dynamic": True}),
                         ("inductor", Broken, {"options": {"compiler": "inductor"}})):
        model = build(cls)
        fn = compiled(model, os.path.join(root, name), **kw)
        fn(X4)
        if name == "dyn":
            fn(X7)
emit({"frames": frames()})
'''


@pytest.fixture(scope="module")
def plain_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("route_plain")
    out = run_python(COLD_PLAIN, env={"ROOT": str(root)})
    assert out["frames"] > 0  # the cold process traced
    shutil.copytree(root / "net", root / "net_pristine")  # the cold variant alone (tests add variants to net)
    return str(root)


def test_plain_module_graph_breaks_and_skipped_frame_replay_without_tracing(plain_cache) -> None:
    out = run_python(PRELUDE + r'''
root = os.environ["ROOT"]
res = {}
with torch.no_grad():
    for name, cls in (("net", Net), ("broken", Broken), ("loop", Loop)):
        model = build(cls)
        want = model(X4)
        fn = compiled(model, os.path.join(root, name))
        got = fn(X4)
        again = fn(X4)
        res[name] = close(got, want) and close(again, want)
res.update(frames=frames(), installs=installs(), loads=tcb.stats().bypass_loads, stats=tcb.stats().as_dict())
emit(res)
''', env={"ROOT": plain_cache})
    assert out["net"] and out["broken"] and out["loop"], out
    assert out["frames"] == 0, out  # no Dynamo frame traced
    # net, broken, and loop's 3 blocks: with every check per call (guards not named) one entry
    # serves the three blocks (no receiver is fixed), so 3 installs and 4 programs built (the
    # loop's root runs as Python; its block's program once)
    assert out["installs"] == 3 and out["loads"] == 4, out
    assert out["stats"]["misses"] == 0 and out["stats"]["fallbacks"] == 0, out


def test_torch_frames_are_skipped_as_dynamo_skips_them_without_its_line_table_walk(plain_cache) -> None:
    """Around every module call run torch's own frames (``Module._wrapped_call_impl``, ``_call_impl``,
    Dynamo's ``DisableContext`` wrapper): the callback gives Dynamo's answer for them (skipped, the
    code marked to be skipped from then on, the same reason recorded) without Dynamo's
    ``first_real_inst_idx``, which walks each whole function's line table with ``dis``."""
    out = run_python(PRELUDE + r'''
from torch._dynamo import convert_frame
walks = []
real = convert_frame.first_real_inst_idx
convert_frame.first_real_inst_idx = lambda code: walks.append(code.co_qualname) or real(code)
with torch.no_grad():
    model = build(Net)
    want = model(X4)
    fn = compiled(model, os.path.join(os.environ["ROOT"], "net"))
    got, again = fn(X4), fn(X4)
emit({"ok": close(got, want) and close(again, want), "frames": frames(), "installs": installs(), "walks": walks})
''', env={"ROOT": plain_cache})
    assert out["ok"] and out["frames"] == 0 and out["installs"] == 1, out
    assert out["walks"] == [], out  # before: Module._wrapped_call_impl, Module._call_impl, ...


def test_a_torch_frame_gets_dynamos_own_skip(plain_cache) -> None:
    """For every torch frame of a warm call the callback answers without Dynamo, Dynamo's own
    callback gives the same answer, field by field (strategy, applied to the code, reason)."""
    out = run_python(PRELUDE + r'''
from torch._dynamo import convert_frame
from torchair_cached_backend.bypass import frame_install
pairs = []
real = frame_install.ReplayingCallback._tcb_torch_skip
def both(self, frame):
    ours = real(self, frame)
    if ours is not None:
        theirs = convert_frame.CatchErrorsWrapper.__call__(self, frame, None, {})
        pairs.append([[str(r.frame_exec_strategy.cur_action), str(r.frame_exec_strategy.recursive_action), r.apply_to_code, r.skip_reason, r.guarded_code is None]
                      for r in (ours, theirs)] + [frame.f_code.co_qualname])
    return ours
frame_install.ReplayingCallback._tcb_torch_skip = both
with torch.no_grad():
    model = build(Net)
    got = compiled(model, os.path.join(os.environ["ROOT"], "net"))(X4)
emit({"ok": close(got, model(X4)), "frames": frames(), "pairs": pairs})
''', env={"ROOT": plain_cache})
    assert out["ok"] and out["frames"] == 0, out
    names = {name for _, _, name in out["pairs"]}
    assert {"Module._wrapped_call_impl", "Module._call_impl"} <= names, names
    for ours, theirs, name in out["pairs"]:
        assert ours == theirs, (name, ours, theirs)


def test_shared_wrapper_code_is_guarded_by_its_cells(plain_cache) -> None:
    """The entry installed for the decorated forward is on the wrapper's code object, which the
    decorated ``other`` shares: its guard must reject a frame of ``other`` (same receiver, same
    arguments, other cells), else ``other(x)`` would be answered by ``forward``'s replay."""
    out = run_python(PRELUDE + r'''
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
model = build(Decorated)
with torch.no_grad():
    want = model(X4)
    got = compiled(model, os.path.join(os.environ["ROOT"], "deco"))(X4)
code = Decorated.forward.__code__
assert Decorated.other.__code__ is code
entries = _debug_get_cache_entry_list(code)
def frame_locals(method):
    return {"self": model, "args": (X4,), "kwargs": {}, "fn": method.__wrapped__}
with torch.no_grad():  # as the call was (grad mode is checked per call)
    checks = [bool(e.guard_manager.check(frame_locals(m))) for e in entries for m in (Decorated.forward, Decorated.other)]
emit({"ok": close(got, want), "frames": frames(), "installs": installs(), "checks": checks})
''', env={"ROOT": plain_cache})
    assert out["ok"] and out["frames"] == 0 and out["installs"] == 1, out
    assert out["checks"] == [True, False], out  # forward's frame passes, other's does not


def test_inductor_kernels_replay_into_an_empty_inductor_dir(plain_cache, tmp_path) -> None:
    empty = tmp_path / "inductor"
    empty.mkdir()
    out = run_python(PRELUDE + r'''
model = build(Broken)
with torch.no_grad():
    want = model(X4)
    fn = compiled(model, os.path.join(os.environ["ROOT"], "inductor"), options={"compiler": "inductor"})
    got = fn(X4)
emit({"ok": bool(torch.allclose(got, want, atol=1e-4)), "frames": frames(), "installs": installs(),
      "stats": tcb.stats().as_dict(), "written": sum(len(f) for _, _, f in os.walk(os.environ["TORCHINDUCTOR_CACHE_DIR"]))})
''', env={"ROOT": plain_cache, "TORCHINDUCTOR_CACHE_DIR": str(empty)})
    assert out["ok"] and out["frames"] == 0 and out["installs"] == 1, out
    assert out["stats"]["misses"] == 0 and out["written"] == 0, out


def test_dynamic_shapes_reset_and_other_options(plain_cache) -> None:
    """Both shapes replay from one dynamic variant; reset() drops the installed entries
    (they are installed again from the cache, not traced); a torch.compile with another
    cache dir never reuses them (it traces)."""
    out = run_python(PRELUDE + r'''
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
root = os.environ["ROOT"]
model = build(Net)
res = {}
with torch.no_grad():
    fn = compiled(model, os.path.join(root, "dyn"), dynamic=True)
    res["shapes"] = close(fn(X4), model(X4)) and close(fn(X7), model(X7))
    res["frames_dynamic"] = frames()
    code = type(model).forward.__code__
    res["entries"] = len(_debug_get_cache_entry_list(code))
    torch._dynamo.reset()
    res["entries_after_reset"] = len(_debug_get_cache_entry_list(code))
    fn = compiled(model, os.path.join(root, "dyn"), dynamic=True)
    res["after_reset"] = close(fn(X7), model(X7))
    res["frames_after_reset"] = frames()
    res["installs"] = installs()
    other = compiled(model, os.path.join(root, "empty"), dynamic=True)
    res["other"] = close(other(X4), model(X4))
    res["frames_other"] = frames()
    res["entries_other"] = len(_debug_get_cache_entry_list(code))
emit(res)
''', env={"ROOT": plain_cache})
    assert out["shapes"] and out["frames_dynamic"] == 0, out
    assert out["entries"] >= 1 and out["entries_after_reset"] == 0, out
    assert out["after_reset"] and out["frames_after_reset"] == 0 and out["installs"] == 2, out
    assert out["other"] and out["frames_other"] > 0, out  # other options: traced, not our entry
    assert out["entries_other"] >= 2, out


CHANGES = {
    # (what the warm process changes before compiling, what it changes after the first call)
    "attribute": ("model.scale = 3.0", ""),
    "method": ("Net.act = lambda self, y: torch.sigmoid(y)", ""),
    "grad_mode_after_install": ("", "torch.set_grad_enabled(True)"),
    "shape_after_install": ("", "X4 = torch.randn(3, 8)"),
    "attribute_after_install_guards_call": ("", "model.scale = 5.0"),
    # guards not named: the route re-checks every guard per call, as Dynamo does
    "attribute_after_install_default": ("", "model.scale = 5.0"),
    # guards not named, a change before the first call: the install check (load-time guards over
    # the receiver, then the per-call ones; the full check is not decoded yet) rejects it
    "attribute_default": ("model.scale = 3.0", ""),
    "method_default": ("Net.act = lambda self, y: torch.sigmoid(y)", ""),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_retraces_with_the_right_answer(plain_cache, change: str, tmp_path) -> None:
    before, after = CHANGES[change]
    guards = "call" if change.endswith("guards_call") else None if change.endswith("default") else "load"
    named = {"guards": guards} if guards else {}
    root = plain_cache
    if before and guards is None:  # the cold variant alone: no variant an earlier case traced may hold
        shutil.copytree(os.path.join(plain_cache, "net_pristine"), tmp_path / "net")
        root = str(tmp_path)
    out = run_python(PRELUDE + f'''
root = os.environ["ROOT"]
model = build(Net)
torch.set_grad_enabled(False)
{before}
fn = compiled(model, os.path.join(root, "net"), options={named!r})
first = close(fn(X4), model(X4))
frames_first, installs_first = frames(), installs()
{after}
got = fn(X4)
emit({{"first": first, "frames_first": frames_first, "ok": close(got, model(X4)), "frames": frames(),
       "installs_first": installs_first, "installs": installs()}})
''', env={"ROOT": root})
    assert out["first"] and out["ok"], out
    if before:  # rejected at install: Dynamo's path from the first call
        assert out["frames_first"] > 0 and out["installs_first"] == 0, out
    else:  # replayed first, then the installed entry's guard fails: Dynamo traces
        assert out["frames_first"] == 0 and out["installs_first"] == 1, out
        # the entry's guard failed: Dynamo traced, or another variant that holds (stored by an
        # earlier case that traced the same change into this shared cache) was installed
        assert out["frames"] > 0 or out["installs"] > out["installs_first"], out


FULL_CHECK = PRELUDE + r'''
from torchair_cached_backend.bypass import guard_runtime
decoded = []
_inflate = guard_runtime._inflate
def counting(part):
    decoded.append(len(part or b""))
    return _inflate(part)
guard_runtime._inflate = counting  # the full check (and the explanations, on a failure) are inflated
if os.environ.get("BREAK_FULL") == "1":  # a full check that cannot be decoded (never seen: its bytes are verified)
    def broken(self):
        raise ValueError("undecodable full check")
    guard_runtime.GuardChecks.full = property(broken)
root = os.environ["ROOT"]
model = build(Net)
torch.set_grad_enabled(False)
fn = compiled(model, os.path.join(root, "net"))
res = {"first": close(fn(X4), model(X4)), "decoded_first": len(decoded), "frames_first": frames()}
res.update(second=close(fn(X4), model(X4)), decoded_second=len(decoded), frames_second=frames())
model.scale = 5.0  # the per-call guard (the full check, or its two parts) still sees a change
res.update(changed=close(fn(X4), model(X4)), frames_changed=frames(), installs=installs())
emit(res)
'''


@pytest.mark.parametrize("broken", [False, True], ids=["decoded_on_second_call", "undecodable"])
def test_the_full_check_is_decoded_by_the_entrys_guard_not_on_the_first_call(plain_cache, broken: bool) -> None:
    """guards not named: the first call is checked as load() checks it (load-time guards over the
    receiver, then the per-call ones); the full check is decoded when Dynamo first evaluates the
    installed entry's guard. One that cannot be decoded is never a failed call: the same guards,
    checked in two parts."""
    out = run_python(FULL_CHECK, env={"ROOT": plain_cache, "BREAK_FULL": "1" if broken else "0"})
    assert out["first"] and out["second"] and out["changed"], out
    assert out["frames_first"] == 0 and out["frames_second"] == 0, out  # replayed, no trace
    assert out["decoded_first"] == 0, out  # not decoded for the first call
    if not broken:
        assert out["decoded_second"] >= 1, out  # decoded by the entry's guard on the second call
    # the change failed the guard: Dynamo traced (or installed another variant that holds)
    assert out["frames_changed"] > 0 or out["installs"] > 1, out


LLAMA = r'''
import hf_tiny

class WithBreak(torch.nn.Module):
    """The tiny Llama with a graph break after it (the continuation replays too)."""

    def __init__(self, llama):
        super().__init__()
        self.llama = llama

    def forward(self, input_ids, attention_mask):
        logits = self.llama(input_ids=input_ids, attention_mask=attention_mask).logits
        print("", end="")
        return logits * 2

def llama(brk):
    model, inputs = hf_tiny.build("llama")
    return (WithBreak(model).eval() if brk else model), inputs

def logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits
'''


@pytest.fixture(scope="module")
def llama_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("route_llama")
    out = run_python(PRELUDE + LLAMA + r'''
root = os.environ["ROOT"]
with torch.no_grad():
    for brk in (False, True):
        model, inputs = llama(brk)
        compiled(model, os.path.join(root, str(brk)))(**inputs)
        torch._dynamo.reset()
    model, _ = llama(False)
    fn = compiled(model.forward, os.path.join(root, "decode"), dynamic=True)
    hf_tiny.greedy_decode(fn, model, hf_tiny.prompt(5), "static", 4)
emit({"frames": frames()})
''', env={"ROOT": str(root)})
    assert out["frames"] > 0
    return str(root)


@pytest.mark.parametrize("brk", [False, True], ids=["whole", "graph_break"])
def test_tiny_llama_replays_without_tracing(llama_cache, brk: bool) -> None:
    out = run_python(PRELUDE + LLAMA + f'''
model, inputs = llama({brk})
with torch.no_grad():
    want = logits(model(**inputs))
    fn = compiled(model, os.path.join(os.environ["ROOT"], "{brk}"))
    got = logits(fn(**inputs))
emit({{"ok": close(got, want), "frames": frames(), "installs": installs(), "stats": tcb.stats().as_dict()}})
''', env={"ROOT": llama_cache})
    assert out["ok"], out
    assert out["frames"] == 0 and out["installs"] >= 1, out
    assert out["stats"]["misses"] == 0 and out["stats"]["fallbacks"] == 0, out


def test_tiny_llama_greedy_decode_replays(llama_cache) -> None:
    out = run_python(PRELUDE + LLAMA + r'''
model, _ = llama(False)
ids = hf_tiny.prompt(5)
with torch.no_grad():
    want, _ = hf_tiny.greedy_decode(model.forward, model, ids, "static", 4)
    fn = compiled(model.forward, os.path.join(os.environ["ROOT"], "decode"), dynamic=True)
    got, _ = hf_tiny.greedy_decode(fn, model, ids, "static", 4)
emit({"ok": got == want, "frames": frames(), "installs": installs(), "stats": tcb.stats().as_dict()})
''', env={"ROOT": llama_cache})
    assert out["ok"], out
    assert out["frames"] == 0 and out["installs"] >= 1, out
    assert out["stats"]["misses"] == 0, out


def test_name_registered_when_dynamo_is_imported_after_the_package() -> None:
    """``import torchair_cached_backend`` before Dynamo: the name is registered right after Dynamo's
    backend registry is imported, so ``torch.compile(backend="npu_cached")`` does not run Dynamo's
    ``_lazy_import`` of every built-in backend (~0.3 s of a warm start)."""
    out = run_python(r'''
import sys, torch
import torchair_cached_backend
before = "torch._dynamo" in sys.modules
import torch._dynamo
from torch._dynamo.backends import registry
registered = "npu_cached" in registry._BACKENDS
torch.compile(torch.nn.Linear(2, 2), backend="npu_cached")
emit({"before": before, "registered": registered, "lazy_imports": registry._lazy_import.cache_info().currsize})
''')
    assert out["before"] is False and out["registered"] is True, out
    assert out["lazy_imports"] == 0, out


def test_a_warm_torch_compile_imports_no_minifier_and_no_aot_autograd(plain_cache) -> None:
    """Dynamo wraps each backend in its minifier wrapper inside ``torch.compile``; importing
    it costs ~0.27 s (Dynamo's debugging backends, AOTAutograd). A warm replay compiles no
    graph, so for ``npu_cached`` it is imported on the first graph only; likewise our
    capture machinery, on the first frame Dynamo transforms."""
    out = run_python(PRELUDE + r'''
model = build(Net)
with torch.no_grad():
    fn = compiled(model, os.path.join(os.environ["ROOT"], "net"))
    got = fn(X4)
emit({"ok": close(got, model(X4)), "frames": frames(), "installs": installs(),
      "after_dynamo": "torch._dynamo.repro.after_dynamo" in sys.modules,
      "aot": "torch._functorch.aot_autograd" in sys.modules,
      "capture": [m for m in ("capture", "guard_capture", "guard_codegen") if "torchair_cached_backend.bypass." + m in sys.modules],
      "name": fn._torchdynamo_orig_backend.__name__ if hasattr(fn, "_torchdynamo_orig_backend") else None})
''', env={"ROOT": plain_cache})
    assert out["ok"] and out["frames"] == 0 and out["installs"] == 1, out
    assert not out["after_dynamo"] and not out["aot"], out
    assert out["capture"] == [], out  # the capture machinery waits for a frame Dynamo transforms


def test_the_minifier_still_wraps_a_cold_compile(tmp_path) -> None:
    """With ``repro_after="dynamo"`` (``TORCHDYNAMO_REPRO_AFTER``) the first graph goes through
    Dynamo's own wrapper, as before: at level 4 it checks the compiled graph's accuracy."""
    out = run_python(PRELUDE + r'''
import torch._dynamo.config as dconfig
dconfig.repro_after, dconfig.repro_level = "dynamo", 4
from torch._dynamo.repro import after_dynamo
checked = []
real = after_dynamo._accuracy_fails
after_dynamo._accuracy_fails = lambda gm, inputs, fn: checked.append(len(gm.graph.nodes)) or real(gm, inputs, fn)
model = build(Net)
with torch.no_grad():
    got = compiled(model, os.environ["ROOT"])(X4)
emit({"ok": close(got, model(X4)), "checked": len(checked), "frames": frames()})
''', env={"ROOT": str(tmp_path)})
    assert out["ok"] and out["frames"] == 1, out
    assert out["checked"] == 1, out  # Dynamo's wrapper ran on the graph


def test_the_first_instruction_is_dynamos_without_dis():
    # the frame callback asks, for every frame it sees, whether the frame already started; Dynamo's
    # own answer (first_real_inst_idx) walks the whole function with dis: the same index, read cheaply
    import types

    import torch
    import transformers.models.llama.modeling_llama as llama
    from torch._dynamo.convert_frame import first_real_inst_idx

    from torchair_cached_backend.bypass.frame_install import first_instruction

    def codes(module):
        for value in vars(module).values():
            for fn in ([value] if isinstance(value, types.FunctionType) else
                       [v for v in vars(value).values() if isinstance(v, types.FunctionType)]
                       if isinstance(value, type) else []):
                yield fn.__code__

    def gen(x):  # generator and closure code: MAKE_CELL / RETURN_GENERATOR before RESUME
        def inner():
            return x
        yield inner

    seen = [*codes(llama), *codes(torch.nn.modules.module), gen.__code__, gen(1).gi_code]
    assert len(seen) > 100, len(seen)
    for code in seen:
        assert first_instruction(code) == first_real_inst_idx(code), code.co_qualname
    assert first_instruction(gen.__code__) > 0


GPT2_TRAIN = r'''
import hf_tiny
def train_step(route, via="backend"):
    model, inputs = hf_tiny.build("gpt2")
    model.train()
    if route == "eager":
        fn = model
    elif via == "load":
        fn = tcb.load(model, os.environ["ROOT"], compiler="eager")
    else:
        fn = compiled(model, os.environ["ROOT"])
    out = fn(**inputs, labels=inputs["input_ids"])  # the loss inside the model, as HF training runs it
    out.loss.backward()
    return [out.loss.item()] + [p.grad.abs().sum().item() for p in list(model.parameters())[:3]]
'''


@pytest.fixture(scope="module")
def gpt2_train_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("route_gpt2_train")
    out = run_python(PRELUDE + GPT2_TRAIN + r'''
emit({"got": train_step("cold"), "frames": frames()})
''', env={"ROOT": str(root)})
    # GPT2LMHeadModel's loss property logs a warning once per process: a graph break in it
    # runs the decorated forwards as frames of their own (dozens of frames at cold)
    assert out["frames"] > 10, out
    return str(root)


def test_a_decorated_forward_compiled_on_its_own_replays_in_a_training_step(gpt2_train_cache) -> None:
    """Real library code, trained as users train it: ``GPT2Model.forward`` sits under
    transformers' ``capture_outputs`` wrapper (the class dict holds the wrapper, the frame runs
    the function it wraps) and its loss property logs through a dozen ``logging`` frames. The
    warm process used to trace 45 frames and recompile the graphs (2-3 s); it finds the
    wrapped function through ``__wrapped__``, runs the deep no-graph frames as Python, and so
    the continuation in which Dynamo compiled nothing at cold (0.03 s)."""
    out = run_python(PRELUDE + GPT2_TRAIN + r'''
got = train_step("warm")  # first: the warning (and its graph break) happens in this call
want = train_step("eager")
from torchair_cached_backend.bypass import replay_resume
emit({"want": want, "got": got, "frames": frames(), "graphs": counters["stats"]["unique_graphs"],
      "as_python": replay_resume.counts["as_python"], "stats": tcb.stats().as_dict()})
''', env={"ROOT": gpt2_train_cache})
    assert out["got"] == pytest.approx(out["want"], rel=1e-5), out
    assert out["graphs"] == 0 and out["stats"]["misses"] == 0, out  # no graph traced or compiled again
    # the continuation after the logging graph break, in which Dynamo compiled nothing at cold,
    # runs as Python (it was handed to Dynamo again: a trace for nothing, ~0.4 s, a counted fallback)
    assert out["as_python"] >= 1 and out["stats"]["fallbacks"] == 0, out
    assert out["frames"] <= 2, out  # what is left: comprehension frames Dynamo skips without tracing


def test_a_continuation_dynamo_ran_as_python_at_a_load_cold_start_runs_as_python_warm(tmp_path) -> None:
    """The same training step through ``tcb.load()``: its cold compiles go through Dynamo's own
    callback, which marks the continuation too. Unmarked, every warm start handed it to Dynamo
    again (a counted fallback, ~0.25 s of a 5 ms step)."""
    cold = run_python(PRELUDE + GPT2_TRAIN + r'''
emit({"got": train_step("cold", via="load"), "frames": frames()})
''', env={"ROOT": str(tmp_path)})
    assert cold["frames"] > 10, cold
    out = run_python(PRELUDE + GPT2_TRAIN + r'''
got = train_step("warm", via="load")
want = train_step("eager")
from torchair_cached_backend.bypass import replay_resume
emit({"want": want, "got": got, "frames": frames(), "as_python": replay_resume.counts["as_python"],
      "stats": tcb.stats().as_dict()})
''', env={"ROOT": str(tmp_path)})
    assert out["got"] == pytest.approx(out["want"], rel=1e-5), out
    # transformers' ForCausalLMLoss, compiled on its own (the loss property logs: a graph break), is
    # reached through a registry value load() cannot rebind: it runs as Python, said and counted
    from torchair_cached_backend.bypass.loader_callees import UNREACHED

    assert out["as_python"] >= 1 and out["frames"] == 0, out
    assert out["stats"]["fallback_reasons"] == {UNREACHED: 1}, out
    # GPT2LMHeadModel.forward sits under two decorators (can_return_tuple's wrapper calls
    # deprecate_kwarg's through its cell, which calls the forward through its own): compiled on
    # its own at cold, it replays too (it ran as plain Python, at eager speed, before)
    assert out["stats"]["bypass_loads"] == 2, out


def test_a_method_reached_through_decorator_cells_replays_under_load(tmp_path) -> None:
    """A forward under two ``functools.wraps`` decorators with a graph break inside: Dynamo
    compiles the outer wrapper and the forward as frames of their own; ``load()`` replays both
    (the replayed wrapper's cell leads to the forward's own replay, for this instance only)."""
    code = PRELUDE + r'''
def deco2(fn):
    def outer(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return outer

class TwoDeco(Net):
    @deco2
    @deco
    def forward(self, x):
        y = self.a(x) * self.scale
        print("", end="")  # a graph break inside the decorated forward
        return self.b(self.act(y))

root = os.environ["ROOT"]
with torch.no_grad():
    model, other = build(TwoDeco), build(TwoDeco, seed=1)
    fn = tcb.load(model, root, compiler="eager")
    got = fn(X4)
    plain = TwoDeco.forward(other, X4)  # another instance through the class: its own forward
emit({"ok": close(got, model(X4)), "other": close(plain, other(X4)), "frames": frames(),
      "stats": tcb.stats().as_dict()})
'''
    cold = run_python(code, env={"ROOT": str(tmp_path)})
    assert cold["ok"] and cold["frames"] >= 2, cold
    warm = run_python(code, env={"ROOT": str(tmp_path)})
    assert warm["ok"] and warm["other"], warm
    assert warm["frames"] == 0 and warm["stats"]["bypass_loads"] == 2 and warm["stats"]["fallbacks"] == 0, (warm["stats"], warm.get("logs"))


def test_a_frame_is_resolved_through_decorators_that_record_what_they_wrap() -> None:
    import functools

    from torchair_cached_backend.bypass.frame_install import _resolve

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            return fn(self, *args, **kwargs)
        return wrapper

    class M:
        @deco
        @deco
        def forward(self, x):
            return x

    @functools.lru_cache(None)
    def helper(x):
        return x

    m = M()
    inner = M.forward.__wrapped__.__wrapped__
    assert _resolve(inner.__code__, {"self": m, "x": 1}, {}, None) == (inner, m)
    plain = helper.__wrapped__
    assert _resolve(plain.__code__, {"x": 1}, {"helper": helper}, None) == (plain, None)
    # the same code with other cells is another function: not found
    other = deco(lambda self, x: x)
    assert _resolve(other.__code__, {"self": m}, {}, (object(),)) is None


def test_a_continuation_dynamo_ran_as_python_stays_marked_when_programs_merge() -> None:
    """The mark survives a merge with a process that did not see it (and the reverse)."""
    from torchair_cached_backend.bypass.program import PROGRAM_FORMAT
    from torchair_cached_backend.bypass.program_merge import merge_programs

    def program(python: bool) -> dict:
        group = {"code": "c", "name": "torch_dynamo_resume_in_f_at_3", "factory": False, "frames": []}
        return {"format": PROGRAM_FORMAT, "frames": {}, "variants": [], "callees": [],
                "resumes": {"o": dict(group, python=True) if python else group}}

    for old, new in ((True, False), (False, True)):
        merged, files = merge_programs(program(old), {"c": b"x"}, program(new), {"c": b"x"}, 4, ())
        assert merged["resumes"]["o"].get("python") is True and files == {"c": b"x"}
    merged, _ = merge_programs(program(False), {"c": b"x"}, program(False), {"c": b"x"}, 4, ())
    assert not merged["resumes"]["o"].get("python")


def test_resolving_a_frame_runs_no_user_attribute_code_on_class_attributes() -> None:
    """Looking for ``__wrapped__`` on every class attribute must not call a user's ``__getattr__``."""
    from torchair_cached_backend.bypass.frame_install import _resolve

    calls = []

    class Loud:
        def __getattr__(self, name):
            calls.append(name)
            raise RuntimeError("must not be called")

    class M:
        loud = Loud()

        def forward(self, x):
            return x

    def elsewhere(self, x):
        return x

    m = M()
    assert _resolve(M.forward.__code__, {"self": m, "x": 1}, {}, None) == (M.forward, m)
    assert _resolve(elsewhere.__code__, {"self": m, "x": 1}, {}, None) is None  # every attribute looked at
    assert calls == []
