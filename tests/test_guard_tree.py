"""``guards="call"`` on the backend route as a C++ guard tree (``bypass/guard_tree.py``):
for every guard kind mapped to C++ (and the kinds left in Python), the recorded check as
Python evaluates it (all hold; one that raises fails) and the tree agree: both accept the
state the tree was built from, both reject each change of the guarded state, both accept
again once it is restored. Then the same on a real transformers tiny Llama, the entry
Dynamo's frame cache holds with the tree against the one with the Python guard, in one
warm process of the backend route."""

from __future__ import annotations

import collections
import types

import pytest
import torch
from subprocess_helpers import run_python

from torchair_cached_backend.bypass import guard_runtime
from torchair_cached_backend.bypass.guard_runtime import HELPERS
from torchair_cached_backend.bypass.guard_tree import build_tree


@pytest.fixture(params=[True, False], ids=["fast-forms", "parsed"])
def forms(request, monkeypatch):
    """Each unit case with the commonest forms read by regex and with every check parsed."""
    from torchair_cached_backend.bypass import guard_tree

    monkeypatch.setattr(guard_tree, "FAST_FORMS", request.param)
    guard_tree._parse_memo.clear()
    return request.param


def _frame(self, x, *args, **kwargs):  # the frame whose locals the checks read
    return x


CODE = _frame.__code__


class _Checks:
    """What build_tree reads of a frame's GuardChecks."""

    def __init__(self, exprs: list[str], consts: list, scope: dict | None = None) -> None:
        self.namespace = dict(HELPERS)
        self.namespace["___G"] = scope if scope is not None else {}
        for i, value in enumerate(consts):
            self.namespace[f"___c{i}"] = value
        self.meta = [{"expr": e, "scope": "call"} for e in exprs]


def _python(checks: _Checks, local: dict, hooks: tuple = ()) -> bool:
    """The entry's Python guard: no global module hooks, then the recorded checks as the
    Python full check evaluates them."""
    if any(hooks):
        return False
    try:
        return all(eval(m["expr"], checks.namespace, {"L": local}) for m in checks.meta)  # noqa: S307 - test exprs
    except Exception:
        return False


def _agree(exprs, consts, local, changes, *, python=0, hooks=None, scope=None):
    """Build the tree from ``local``; each change (mutate, restore) is rejected by both."""
    checks = _Checks(exprs, consts, scope)
    hooks = hooks or tuple(collections.OrderedDict() for _ in range(4))
    tree = build_tree(checks, CODE, local, (), hooks)
    assert tree is not None, "the tree was not built"
    assert tree.python == python, f"{tree.python} checks left in Python, expected {python}"
    root = tree.root
    assert _python(checks, local, hooks) and root.check(local)
    for i, (mutate, restore) in enumerate(changes):
        mutate()
        try:
            assert not _python(checks, local, hooks), f"change {i}: the Python check accepts it (a bad test)"
            assert not root.check(local), f"change {i}: the tree accepts what the Python check rejects"
        finally:
            restore()
        assert _python(checks, local, hooks) and root.check(local), f"change {i}: not accepted once restored"
    return tree


def _setter(obj, name, value):
    old = vars(obj).get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name, _MISSING)

    def mutate():
        setattr(obj, name, value)

    def restore():
        if old is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, old)

    return mutate, restore


_MISSING = object()


class _Cfg:
    pass


class _OtherCfg:
    pass


def _act(x):
    return x


def _other(x):
    return -x


class _Mod(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 3))
        self.flag, self.n, self.scale, self.name = True, 3, 2.0, "a"
        self.dtype, self.cfg, self.act, self.extra = torch.float32, _Cfg(), _act, 1


def _local(**extra):
    return {"self": _Mod(), "x": torch.zeros(2, 3), "args": (), "kwargs": {}, **extra}


# --------------------------------------------------------------------------- kinds mapped to C++
@pytest.mark.usefixtures("forms")
def test_identity_type_and_typed_equality_agree():
    local = _local()
    m = local["self"]
    exprs = ["(L['self'].flag is True)", "(L['self'].act is ___c0)", "(type(L['self'].cfg) is ___c1)",
             "(type(L['self'].n) is int and L['self'].n == 3)", "(type(L['self'].scale) is float and L['self'].scale == 2.0)",
             "(type(L['self'].name) is str and L['self'].name == 'a')", "(___eq(L['self'].dtype, ___c2))"]
    _agree(exprs, [_act, _Cfg, torch.float32], local, [
        _setter(m, "flag", False), _setter(m, "flag", 1), _setter(m, "act", _other), _setter(m, "cfg", _OtherCfg()),
        _setter(m, "n", 4), _setter(m, "n", 3.0), _setter(m, "n", True), _setter(m, "scale", 2.5),
        _setter(m, "scale", 2), _setter(m, "name", "b"), _setter(m, "dtype", torch.float16),
        _setter(m, "dtype", "float32")])


@pytest.mark.usefixtures("forms")
def test_hook_dict_lengths_hasattr_and_instance_dict_entries_agree():
    local = _local()
    m = local["self"]
    exprs = ["(len(L['self']._forward_hooks) == 0)", "(len(L['self']._forward_pre_hooks) == 0)",
             "(hasattr(L['self'], 'extra'))", "(not ___dict_has(L['self'].__dict__, 'forward'))",
             "(___dict_has(L['self'].__dict__, 'extra'))"]
    handle = []

    def hook():
        handle.append(m.register_forward_hook(lambda *a: None))

    def pre_hook():
        handle.append(m.register_forward_pre_hook(lambda *a: None))

    def unhook():
        handle.pop().remove()

    def forward_override():
        m.forward = lambda x: x

    def no_override():
        del m.forward

    def drop_extra():
        del m.extra

    def put_extra():
        m.extra = 1

    _agree(exprs, [], local, [(hook, unhook), (pre_hook, unhook), (forward_override, no_override),
                              (drop_extra, put_extra)])


@pytest.mark.usefixtures("forms")
def test_static_tensor_checks_agree():
    local = _local()
    m = local["self"]
    exprs = ["(type(L['x']) is ___c0 and L['x'].dtype is ___c1 and L['x'].device == ___c2 and "
             "L['x'].requires_grad is False and L['x'].size() == (2, 3) and L['x'].stride() == (3, 1))",
             "(type((___t := L['self']._parameters['weight'])) is ___c3 and ___t.dtype is ___c1 and "
             "___t.device == ___c2 and ___t.requires_grad is True and ___t.size() == (4, 3) and ___t.stride() == (3, 1))"]
    x = local["x"]

    def put(value):
        return (lambda: local.__setitem__("x", value)), (lambda: local.__setitem__("x", x))

    def no_grad():
        m.weight.requires_grad_(False)

    def grad():
        m.weight.requires_grad_(True)

    def new_weight():
        m._parameters["weight"] = torch.nn.Parameter(torch.ones(3, 4))

    weight = m.weight

    def old_weight():
        m._parameters["weight"] = weight

    _agree(exprs, [torch.Tensor, torch.float32, torch.device("cpu"), torch.nn.Parameter], local, [
        put(torch.zeros(3, 2)), put(torch.zeros(3, 2).t()), put(torch.zeros(2, 3, dtype=torch.float64)),
        put(torch.zeros(2, 3, requires_grad=True)), put(torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)),
        put([0.0]), (no_grad, grad), (new_weight, old_weight)])


def _classes():
    def deco(flag):
        def wrap(fn):
            def wrapper(self, x, k=1.0):
                return fn(self, x, k) if flag else -fn(self, x, k)

            return wrapper

        return wrap

    class Base:
        @deco(True)
        def helper(self, x, k=1.0):
            return x * k

        def plain(self, x, *, scale=2.0):
            return x * scale

    class Child(Base):
        pass

    class Other:
        def plain(self, x, *, scale=2.0):
            return x * scale

        helper = plain

    return Base, Child, Other


@pytest.mark.usefixtures("forms")
def test_resolved_methods_agree():
    """What ``obj.name`` resolves to, by code and bound values: every reassignment the
    memoized Python site re-validates is rejected by the tree as well."""
    Base, Child, Other = _classes()
    digest = {n: guard_runtime._fn_digest(guard_runtime._resolved(Child, n)) for n in ("helper", "plain")}
    exprs = [f"(___fn_digest(___resolved(___c0, {n!r})) == {d!r})" for n, d in digest.items()]
    helper, plain = Base.helper, Base.plain
    cells = dict(zip(helper.__code__.co_freevars, helper.__closure__, strict=True))
    inner = cells["fn"].cell_contents

    def patch(attr, value, owner=Base):
        return _setter(owner, attr, value)

    def cell(name, value):
        old = cells[name].cell_contents

        def mutate():
            cells[name].cell_contents = value

        def restore():
            cells[name].cell_contents = old

        return mutate, restore

    def fn_attr(fn, attr, value):
        return _setter(fn, attr, value)

    def kwdefault(value):
        def mutate():
            plain.__kwdefaults__["scale"] = value

        def restore():
            plain.__kwdefaults__["scale"] = 2.0

        return mutate, restore

    def rebase():
        Child.__bases__ = (Other,)

    def unbase():
        Child.__bases__ = (Base,)

    tree = _agree(exprs, [Child], {"self": None}, [
        patch("plain", lambda self, x, *, scale=2.0: x + scale),  # monkeypatched onto the class
        patch("plain", lambda self, x, *, scale=2.0: x * scale, owner=Child),  # an override in the subclass
        fn_attr(plain, "__code__", (lambda self, x, *, scale=2.0: x - scale).__code__),
        fn_attr(plain, "__kwdefaults__", {"scale": 3.0}), kwdefault(3.0),
        fn_attr(helper, "__defaults__", (2.0,)), cell("flag", False),
        fn_attr(inner, "__defaults__", (3.0,))])  # the decorated function, one level down
    rebase()  # a switched base class
    try:
        assert not _python(tree_checks := _Checks(exprs, [Child]), {"self": None}) and not tree.root.check({"self": None})
    finally:
        unbase()
    # the same bases again are a new __mro__ tuple: the tree is stricter there (the route then
    # re-checks in Python and installs the variant again), never looser
    assert _python(tree_checks, {"self": None}) and not tree.root.check({"self": None})


@pytest.mark.usefixtures("forms")
def test_code_identity_agrees():
    local = _local()
    m = local["self"]
    fp = guard_runtime._code_fp(_act.__code__)
    _agree([f"(___code_fp(L['self'].act.__code__) == {fp!r})"], [], local, [
        _setter(m, "act", _other), _setter(_act, "__code__", _other.__code__)])


@pytest.mark.usefixtures("forms")
def test_global_module_hooks_and_globals_agree():
    # the four global hook dicts the route's Python guard checks: forward pre/post, backward pre/post
    hooks = tuple(collections.OrderedDict() for _ in range(4))
    scope = {"FLAG": True, "mod": types.SimpleNamespace(k=3)}
    exprs = ["(___G['FLAG'] is True)", "(type(___G['mod'].k) is int and ___G['mod'].k == 3)"]

    def hook(i):
        return (lambda: hooks[i].__setitem__(1, print)), (lambda: hooks[i].clear())

    _agree(exprs, [], _local(), [
        hook(0), hook(1), hook(2), hook(3),
        ((lambda: scope.__setitem__("FLAG", False)), (lambda: scope.__setitem__("FLAG", True))),
        ((lambda: scope.pop("FLAG")), (lambda: scope.__setitem__("FLAG", True))),
        _setter(scope["mod"], "k", 4)], hooks=hooks, scope=scope)


# --------------------------------------------------------------------------- kinds left in Python
@pytest.mark.usefixtures("forms")
def test_kinds_without_an_exact_cpp_counterpart_stay_python_and_agree():
    local = _local()
    m = local["self"]
    exprs = ["(not hasattr(L['self'], 'missing'))", "(L['self'].cfg is L['self'].__dict__['cfg'])",
             "(___grad() is False)", "(len(L['args']) == 0)", "(tuple(dict.keys(L['kwargs'])) == ())",
             "(L['self'].n > 2)"]

    def grad_on():
        torch.set_grad_enabled(True)

    def grad_off():
        torch.set_grad_enabled(False)

    def raising():  # not hasattr -> a property that raises ValueError fails it (NO_HASATTR would pass it)
        type(m).missing = property(lambda self: (_ for _ in ()).throw(ValueError("boom")))

    def unraising():
        del type(m).missing

    with torch.no_grad():
        tree = _agree(exprs, [], local, [
            _setter(m, "missing", 1), (raising, unraising), (grad_on, grad_off),
            ((lambda: local.__setitem__("args", (1,))), (lambda: local.__setitem__("args", ()))),
            ((lambda: local.__setitem__("kwargs", {"a": 1})), (lambda: local.__setitem__("kwargs", {}))),
            _setter(m, "n", 1)], python=6)
    assert tree.mapped == 0


@pytest.mark.usefixtures("forms")
def test_a_guard_kind_unknown_here_is_checked_by_python():
    """A kind another part of the package may add later is evaluated as written."""
    local = _local()
    m = local["self"]
    HELPERS_EXTRA = {"___new_kind": lambda obj: obj.n % 2 == 1}
    checks = _Checks(["(___new_kind(L['self']))"], [])
    checks.namespace.update(HELPERS_EXTRA)
    tree = build_tree(checks, CODE, local, (), (collections.OrderedDict(), collections.OrderedDict()))
    assert tree is not None and tree.python == 1 and tree.root.check(local)
    m.n = 4
    assert not _python(checks, local) and not tree.root.check(local)


@pytest.mark.usefixtures("forms")
def test_no_tree_for_a_state_the_checks_reject():
    local = _local()
    local["self"].flag = False
    checks = _Checks(["(L['self'].flag is True)"], [])
    assert build_tree(checks, CODE, local, (), (collections.OrderedDict(), collections.OrderedDict())) is None


# --------------------------------------------------------------------------- a real transformers Llama
LLAMA = r'''
import inspect, sys, torch
sys.path.insert(0, TESTS)
from hf_tiny import SIZES, _llama
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torchair_cached_backend.bypass import frame_install

def build():
    torch.manual_seed(0)
    model = _llama(SIZES["tiny"]).eval()
    return model, torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))

def compiled(model):
    return torch.compile(model, backend="npu_cached", options={"cache_dir": CACHE, "compiler": "eager"})
'''

COLD = LLAMA + r'''
model, ids = build()
with torch.no_grad():
    compiled(model)(input_ids=ids, use_cache=False)
emit({"ok": True})
'''

WARM = LLAMA + r'''
from torch._dynamo.utils import counters

def entry(model, kw):
    fn = type(model).forward
    while fn is not None:
        entries = _debug_get_cache_entry_list(fn.__code__)
        if entries:
            local = dict(inspect.signature(fn, follow_wrapped=False).bind(model, **kw).arguments)
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                local[name] = cell.cell_contents
            return entries[0].guard_manager, local
        fn = getattr(fn, "__wrapped__", None)

model, ids = build()
kw = {"input_ids": ids, "use_cache": False}
managers = {}
with torch.no_grad():
    from torchair_cached_backend.bypass import guard_tree
    for tree, fast in ((False, True), (True, True), (True, False)):
        frame_install.USE_GUARD_TREE, guard_tree.FAST_FORMS = tree, fast
        compiled(model)(**kw)
        managers[(tree, fast)], local = entry(model, kw)
        torch._dynamo.reset()
    old, new, parsed = managers[(False, True)], managers[(True, True)], managers[(True, False)]
    out = {"frames": counters["frames"]["total"], "tree": hasattr(new, "_tcb_keep") and hasattr(parsed, "_tcb_keep"),
           "old_lambda": not hasattr(old, "_tcb_keep"), "changes": {}}
    layer = model.model.layers[1]

    def setter(obj, name, value):
        old_value = obj.__dict__.get(name, obj.__dict__)
        def restore():
            if old_value is obj.__dict__:
                delattr(obj, name)
            else:
                setattr(obj, name, old_value)
        return (lambda: setattr(obj, name, value)), restore

    handles = []
    def hook(module):
        return (lambda: handles.append(module.register_forward_hook(lambda *a: None))), (lambda: handles.pop().remove())
    def global_hook():
        return (lambda: handles.append(torch.nn.modules.module.register_module_forward_hook(lambda *a: None))), \
            (lambda: handles.pop().remove())
    norm_cls = type(model.model.norm)
    def norm_forward(self, x):
        return x
    weight = model.model.norm.weight
    def local_item(name, value):
        before = local[name]
        return (lambda: local.__setitem__(name, value)), (lambda: local.__setitem__(name, before))
    def kwarg(value):
        before = dict(local["kwargs"])
        return (lambda: local["kwargs"].__setitem__("input_ids", value)), (lambda: local["kwargs"].update(before))
    changes = {
        "config value": setter(model.config, "output_hidden_states", True),
        "config new attribute (not hasattr)": setter(model.config, "vision_feature_layer", 1),
        "layer attribute": setter(layer.self_attn, "scaling", 0.5),
        "layer float attribute": setter(layer.input_layernorm, "variance_epsilon", 1e-5),
        "submodule forward hook": hook(layer.mlp),
        "global module hook": global_hook(),
        "instance forward override": setter(layer.mlp, "forward", lambda x: x),
        "class method monkeypatched": setter(norm_cls, "forward", norm_forward),
        "parameter requires_grad": ((lambda: weight.requires_grad_(False)), (lambda: weight.requires_grad_(True))),
        "training flag": ((lambda: layer.self_attn.train()), (lambda: layer.self_attn.eval())),
        "input shape": kwarg(torch.randint(3, 128, (2, 9))),
        "input dtype": kwarg(ids.to(torch.int32)),
        "grad mode": ((lambda: torch.set_grad_enabled(True)), (lambda: torch.set_grad_enabled(False))),
    }
    checks = (old.root.check, new.root.check, parsed.root.check)
    out["unchanged"] = [c(local) for c in checks]
    for name, (mutate, restore) in changes.items():
        mutate()
        try:
            out["changes"][name] = [c(local) for c in checks]
        finally:
            restore()
        out["changes"][name] += [c(local) for c in checks]
emit(out)
'''


@pytest.fixture(scope="module")
def llama_cache(tmp_path_factory):
    import os

    cache = str(tmp_path_factory.mktemp("tree_llama"))
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("tree_inductor"))}
    tests = os.path.dirname(os.path.abspath(__file__))
    head = f"CACHE = {cache!r}\nTESTS = {tests!r}\n"
    assert run_python(head + COLD, env=env, timeout=600)["ok"]
    return head, env


def test_llama_tree_and_python_guard_agree_on_every_change(llama_cache):
    head, env = llama_cache
    out = run_python(head + WARM, env=env, timeout=600)
    assert out["frames"] == 0, "a warm frame was traced"
    assert out["tree"] and out["old_lambda"], "the entries are not a tree and the Python guard"
    assert out["unchanged"] == [True, True, True]
    for name, results in out["changes"].items():
        assert results[:3] == [False, False, False], f"{name}: Python, tree, tree of parsed checks: {results[:3]}"
        assert results[3:] == [True, True, True], f"{name}: not accepted once restored: {results[3:]}"
