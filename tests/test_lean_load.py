"""The lean warm path (issue 18): faster forms of load-time work compute exactly what the
forms they replace computed, and still catch every change those caught."""

from __future__ import annotations

import json

import pytest
import torch

from torchair_cached_backend import store_layout
from torchair_cached_backend.bypass import sources


def _reference_tensor_state(obj):
    state = {}
    for prefix, tensors in (("param:", obj.named_parameters()), ("buffer:", obj.named_buffers())):
        for name, t in tensors:
            state[prefix + name] = [list(t.shape), str(t.dtype), str(t.device)]
    return state


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False)])
        self.shared = self.blocks[0]  # one module under two names
        self.head = torch.nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # a tied parameter
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("absent", None)
        self.norm = torch.nn.BatchNorm1d(4).to(torch.float16)
        self.blocks[1].register_parameter("extra", None)


class _OwnNames(_Tied):
    def named_parameters(self, *args, **kwargs):  # a class's own walk is the one that counts
        yield from (("renamed." + n, p) for n, p in super().named_parameters(*args, **kwargs))


@pytest.mark.parametrize("cls", [_Tied, _OwnNames])
def test_tensor_state_is_named_parameters_and_buffers(cls):
    model = cls()
    state = sources.tensor_state(model)
    assert state == _reference_tensor_state(model)
    assert list(state) == list(_reference_tensor_state(model))  # same names, same order
    prefix = "param:renamed." if cls is _OwnNames else "param:"
    assert prefix + "head.weight" not in state and prefix + "embed.weight" in state  # tied: first name only


def test_tensor_state_still_sees_a_change():
    model = _Tied()
    before = sources.tensor_state(model)
    model.blocks[1].weight = torch.nn.Parameter(torch.zeros(4, 3))
    after = sources.tensor_state(model)
    assert sources.tensor_state_difference(before, after) == ["param:blocks.1.weight: [[4, 4], 'torch.float32', "
                                                             "'cpu'] -> [[4, 3], 'torch.float32', 'cpu']"]
    model.norm.to(torch.float32)
    assert any("norm" in d for d in sources.tensor_state_difference(after, sources.tensor_state(model)))


def _nested(depth: int, kind: str) -> object:
    value: object = 1
    for i in range(depth - 1):
        value = {"k": value, "n": i} if (kind == "dict" or i % 2) else [value, "x"]
    return {"top": value, "flat": []} if kind == "dict" else [{}, value]


@pytest.mark.parametrize("kind", ["dict", "mixed"])
def test_depth_bound_is_exact(kind):
    # the deepest accepted document has MAX_DEPTH levels; one more is refused, whatever the mix
    limit = store_layout.MAX_DEPTH
    ok = json.dumps(_nested(limit, kind))
    assert store_layout.loads_bounded(ok) == json.loads(ok)
    with pytest.raises(store_layout.JsonBoundsError, match="nesting deeper"):
        store_layout.loads_bounded(json.dumps(_nested(limit + 1, kind)))
    store_layout._check_depth([[1], [[2]]], limit=3)
    with pytest.raises(store_layout.JsonBoundsError):
        store_layout._check_depth([[1], [[[2]]]], limit=3)


@pytest.mark.parametrize("text, refused", [
    ('{"n": 12345678901234567890}', False),  # 20 digits: the longest integer accepted
    ('{"n": -123456789012345678901}', True),
    ('[1.5, -0.25, 3e99, 1e-99]', False),
    ('[1e308]', False),
    ('[1e999]', True),
    ('[-1E+400]', True),
    ('[0.%s1]' % ("0" * 30), False),  # a long fraction: the hooks, finite
    ('{"sha": "8e209a%s"}' % ("1" * 20), False),
    ('[%s.0]' % ("9" * 400), True),  # too long to be finite
    ('{"x": NaN}', True),
    ('[Infinity]', True),
    ('{"s": "%s"}' % ("7" * 40), False),  # a digit run in a string: the hooks, nothing refused
])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_number_bounds_are_exact(text, refused, as_bytes):
    # integers up to 20 digits and finite floats only, in numbers; a digit run inside a string is text
    raw = text.encode() if as_bytes else text
    if refused:
        with pytest.raises(store_layout.JsonBoundsError):
            store_layout.loads_bounded(raw)
    else:
        assert store_layout.loads_bounded(raw) == json.loads(text)


def _make(src: str, cell: object = "cache") -> object:
    """A function ``f`` built from ``src`` inside a maker whose closure holds ``cell``."""
    namespace: dict = {}
    exec(compile(f"def maker(cell):\n{src}\n    return f\n", "<lean>", "exec"), namespace)  # noqa: S102
    return namespace["maker"](cell)


_BODY = "    def f(x, scale=2.0, *, mode='a'):\n        return (x * scale, mode, cell)"


def test_function_digest_catches_each_change():
    from torchair_cached_backend.bypass.guard_runtime import _fn_digest

    base = _fn_digest(_make(_BODY))
    assert _fn_digest(_make(_BODY)) == base  # the same function made again
    changed = [
        _make(_BODY.replace("x * scale", "x + scale")),  # the body
        _make(_BODY.replace("scale=2.0", "scale=3.0")),  # a default
        _make(_BODY.replace("scale=2.0", "scale=2")),  # a default's type (2 == 2.0)
        _make(_BODY.replace("mode='a'", "mode='b'")),  # a keyword-only default
        _make(_BODY, cell="other"),  # a closure value
        _make(_BODY, cell=True),  # a closure value of another type (True == 1)
        _make("    def f(x, scale=2.0, *, mode='a'):\n        return (x, scale, mode, cell)"),  # same name, other code
    ]
    digests = [_fn_digest(fn) for fn in changed]
    assert base not in digests and len(set(digests)) == len(digests)
    one, true = _make(_BODY, cell=1), _make(_BODY, cell=True)
    assert _fn_digest(one) != _fn_digest(true)
    fn = _make(_BODY)
    fn.__defaults__ = (5.0,)  # reassigned in place: the memo does not hide it
    assert _fn_digest(fn) not in (base, *digests)


def test_function_digest_does_not_depend_on_string_interning():
    import sys

    from torchair_cached_backend.bypass.guard_runtime import _fn_digest

    interned = sys.intern("cache_value")
    built = "".join(["cache", "_value"])
    assert built == interned and built is not interned
    assert _fn_digest(_make(_BODY, cell=interned)) == _fn_digest(_make(_BODY, cell=built))
    nested = (built, {"k": [built, 1.5, None]})
    assert _fn_digest(_make(_BODY, cell=nested)) == _fn_digest(_make(_BODY, cell=(interned, {"k": [interned, 1.5, None]})))


def test_function_digest_is_the_same_in_a_fresh_process():
    import subprocess
    import sys

    from torchair_cached_backend.bypass.guard_runtime import _fn_digest

    script = (f"import sys; sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r}); "
              "import test_lean_load as t; from torchair_cached_backend.bypass.guard_runtime import _fn_digest; "
              "print(_fn_digest(t._make(t._BODY, cell=('a', {'b': [1, 2.5]}))))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    assert out == _fn_digest(_make(_BODY, cell=("a", {"b": [1, 2.5]})))


def test_names_split_off_the_hit_path_stay_importable_where_they_were():
    from torchair_cached_backend import store, store_backend, store_protocol
    from torchair_cached_backend.bypass import guard_cold, guard_runtime, loader, loader_miss, loader_routes

    assert store.StorageBackend is store_backend.StorageBackend is store_protocol.StorageBackend
    for name in ("pack_checks", "checks_meta", "short"):
        assert getattr(guard_runtime, name) is getattr(guard_cold, name)
    assert guard_runtime.ResolvedSite.__module__ == guard_runtime.__name__  # the backend route's warm path runs it
    assert loader._stand_in is loader_miss._stand_in and loader._reason_kind("x was edited") == "function edited"
    assert loader._load_ddp is loader_routes._load_ddp
    assert loader._load_instance_forward is loader_routes._load_instance_forward
    with pytest.raises(AttributeError):
        guard_runtime.no_such_name  # noqa: B018


_REJECTED = r'''
import logging, os, sys
import torch
import torchair_cached_backend as tcb
from torchair_cached_backend.bypass import guard_runtime

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)
        self.k = 2

    def forward(self, x):
        return self.l(x) * self.k

calls = []
real = guard_runtime.GuardChecks.failures
guard_runtime.GuardChecks.failures = lambda self, *a: calls.append(1) or real(self, *a)
if os.environ.get("INFO"):
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
x = torch.randn(2, 4)
with torch.no_grad():
    torch.manual_seed(0)
    m = M().eval()
    if os.environ["PHASE"] == "cold":  # two variants: k == 2, then (newest) k == 3
        fn = tcb.load(m, os.environ["ROOT"], compiler="eager")
        fn(x)
        m.k = 3
        fn(x)
        ok = True
    else:  # k == 2: the newest variant is rejected at load, the older one fits
        import gc
        gc.collect()
        gc.disable()  # what outlives the load by refcounts alone
        fn = tcb.load(m, os.environ["ROOT"], compiler="eager")
        builders = sum(type(o).__name__ == "_ReplayBuilder" for o in gc.get_objects())
        gc.enable()
        ok = bool(torch.allclose(fn(x), m.l(x) * 2))
emit({"ok": ok, "explained": len(calls), "loads": tcb.stats().bypass_loads, "fallbacks": tcb.stats().fallbacks,
      "builders_alive": builders if os.environ["PHASE"] == "warm" else None})
'''


def test_a_rejected_variant_is_explained_only_when_its_reason_is_shown(tmp_path):
    """Naming the failing guards of a variant passed over on the way to one that fits cost
    ~17 ms for each layer's attention of a transformers Llama (920 guards walked with their
    text) at every warm start: it is now done only when the reason is shown (INFO logging,
    or no variant fitting)."""
    from subprocess_helpers import run_python

    env = {"ROOT": str(tmp_path)}
    run_python(_REJECTED, env={**env, "PHASE": "cold"})
    quiet = run_python(_REJECTED, env={**env, "PHASE": "warm"})
    assert quiet["ok"] and quiet["loads"] == 1 and quiet["fallbacks"] == 0, quiet
    assert quiet["explained"] == 0, quiet
    shown = run_python(_REJECTED, env={**env, "PHASE": "warm", "INFO": "1"})
    assert shown["ok"] and shown["explained"] == 1, shown


def test_a_rejected_variant_leaves_no_cycle_holding_the_load(tmp_path):
    """A variant passed over at load was kept as the exception that rejected it, whose traceback held
    the loader's frames, which held the list holding it: a reference cycle that kept the builder, the
    parsed program and its decoded values alive until the next full collection (and its allocations
    counted toward one, in the warm start's first call). Refcounting alone frees them now."""
    from subprocess_helpers import run_python

    env = {"ROOT": str(tmp_path)}
    run_python(_REJECTED, env={**env, "PHASE": "cold"})
    warm = run_python(_REJECTED, env={**env, "PHASE": "warm"})
    assert warm["ok"] and warm["loads"] == 1 and warm["fallbacks"] == 0, warm
    assert warm["builders_alive"] == 0, warm
