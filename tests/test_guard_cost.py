"""Cheaper guard evaluation that checks the same things: the memoized resolved-method
checks and function digests still fail on every reassignment they depend on, reads shared
by guards are bound once yet re-read on every call, a read only made conditionally is never
made unconditional, and the generated checks do fewer operations. One warm process runs the
``guards="call"`` route end to end, with each mutation made between two calls."""

from __future__ import annotations

import ast
import textwrap
import types

import pytest

from torchair_cached_backend.bypass import guard_runtime
from torchair_cached_backend.bypass.guard_codegen import load_check_body
from torchair_cached_backend.bypass.guard_runtime import HELPERS, ResolvedSite, _fn_digest


# --------------------------------------------------------------------------- resolved methods
def _decorate(flag):
    def wrap(fn):
        def wrapper(self, x, k=1.0):
            return fn(self, x, k) if flag else -fn(self, x, k)

        return wrapper

    return wrap


def _classes():
    class Base:
        @_decorate(True)
        def helper(self, x, k=1.0):
            return x * k

        def plain(self, x, *, scale=2.0):
            return x * scale

    class Child(Base):
        pass

    return Base, Child


def _site(cls, name):
    site = ResolvedSite(name, _fn_digest(guard_runtime._resolved(cls, name)))
    # the memo is made from the second evaluation on: two calls, then it must be in use
    assert site.holds(cls) and site.holds(cls) and site.memo, "the memo is not engaged"
    assert site.holds(cls)
    return site


def test_resolved_site_fails_on_a_reassigned_code_or_defaults():
    Base, Child = _classes()
    site = _site(Child, "plain")
    fn = Base.plain
    code, kwdefaults = fn.__code__, fn.__kwdefaults__
    fn.__code__ = (lambda self, x, *, scale=2.0: x + scale).__code__
    assert not site.holds(Child)
    fn.__code__ = code
    assert site.holds(Child)
    fn.__kwdefaults__["scale"] = 3.0  # the same dict, mutated in place
    assert not site.holds(Child)
    kwdefaults["scale"] = 2.0
    assert site.holds(Child)
    fn.__kwdefaults__ = {"scale": 2.0, "extra": 1}
    assert not site.holds(Child)


def test_resolved_site_fails_on_a_changed_closure_cell_or_wrapped_function():
    Base, Child = _classes()
    site = _site(Child, "helper")
    wrapper = Base.helper
    cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__, strict=True))
    cells["flag"].cell_contents = False
    assert not site.holds(Child)
    cells["flag"].cell_contents = True
    assert site.holds(Child)
    inner = cells["fn"].cell_contents  # the decorated function, one level down
    code = inner.__code__
    inner.__code__ = (lambda self, x, k=1.0: x - k).__code__
    assert not site.holds(Child)
    inner.__code__ = code
    assert site.holds(Child)
    inner.__defaults__ = (5.0,)
    assert not site.holds(Child)


def test_resolved_site_fails_on_a_monkeypatched_method_or_new_bases():
    Base, Child = _classes()
    site = _site(Child, "plain")
    Child.plain = lambda self, x, *, scale=2.0: x  # defined earlier in the MRO now
    assert not site.holds(Child)
    del Child.plain
    assert site.holds(Child)
    original = Base.plain
    Base.plain = lambda self, x, *, scale=2.0: x  # replaced where it was defined
    assert not site.holds(Child)
    Base.plain = original
    assert site.holds(Child)

    class Other:
        def plain(self, x, *, scale=2.0):
            return -x

    Child.__bases__ = (Other,)
    assert not site.holds(Child)


def test_a_bound_value_identity_does_not_pin_is_rechecked_by_value():
    # a list default can change in place: no memo is trusted for it, the digest is recomputed
    def fn(x, table=[1, 2]):  # noqa: B006 - the mutable default is the point
        return x

    class Owner:
        method = fn

    site = ResolvedSite("method", _fn_digest(fn))
    assert site.holds(Owner) and site.holds(Owner) and site.holds(Owner)
    fn.__defaults__[0].append(3)
    assert not site.holds(Owner)


def test_fn_digest_memo_follows_nested_and_in_place_changes():
    # the former memo (ids of the directly bound objects) missed both of these
    Base, _ = _classes()
    wrapper = Base.helper
    before = _fn_digest(wrapper)
    assert _fn_digest(wrapper) == before
    inner = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__, strict=True))["fn"].cell_contents
    code = inner.__code__
    inner.__code__ = (lambda self, x, k=1.0: x - k).__code__
    assert _fn_digest(wrapper) != before
    inner.__code__ = code
    assert _fn_digest(wrapper) == before
    plain = Base.plain
    digest = _fn_digest(plain)
    plain.__kwdefaults__["scale"] = 7.0
    assert _fn_digest(plain) != digest


# --------------------------------------------------------------------------- generated code
def _compile(guards: list[str], *, sites: bool = True) -> tuple[types.FunctionType, list[str]]:
    prelude: list[str] = []
    body, _ = load_check_body(list(enumerate(guards)), fail="False", sites=prelude if sites else None,
                              params=frozenset({"L"}), prefix="___t_")
    namespace = dict(HELPERS)
    exec("\n".join(prelude + ["def full(L):", *body, "    return True"]), namespace)  # noqa: S102 - generated above
    return namespace["full"], body


def _model(n: int):
    layers = types.SimpleNamespace(_modules={str(i): types.SimpleNamespace(scale=2.0, idx=i) for i in range(n)})
    model = types.SimpleNamespace(_modules={"layers": layers}, flag=True)
    return {"self": types.SimpleNamespace(_modules={"model": model}, config=types.SimpleNamespace(depth=n))}


def _guards(n: int) -> list[str]:
    m = "L['self']._modules['model']"
    out = [f"(type({m}.flag) is bool)", f"({m}.flag is True)", f"(len({m}._modules['layers']._modules) == {n})",
           f"(type(L['self'].config.depth) is int and L['self'].config.depth == {n})"]
    for i in range(n):
        item = f"{m}._modules['layers']._modules['{i}']"
        out += [f"(type({item}.scale) is float and {item}.scale == 2.0)", f"({item}.idx == {i})"] if i == 0 else \
            [f"(type({item}.scale) is float and {item}.scale == 2.0)"]
    return out


def test_shared_reads_are_bound_once_and_reread_every_call():
    full, body = _compile(_guards(4))
    text = "\n".join(body)
    assert text.count("['model']") == 1 and text.count("['layers']") == 1, text  # walked once, not per guard
    scope = _model(4)
    assert full(scope) is True
    scope["self"]._modules["model"] = types.SimpleNamespace(**dict(vars(scope["self"]._modules["model"]), flag=False))
    assert full(scope) is False  # a replaced submodule is seen on the next call
    scope = _model(4)
    scope["self"]._modules["model"]._modules["layers"]._modules["3"].scale = 3.0
    assert full(scope) is False
    scope["self"]._modules["model"]._modules["layers"]._modules["3"].scale = 2
    assert full(scope) is False  # the type half
    scope = _model(4)
    scope["self"].config.depth = 5
    assert full(scope) is False


def test_a_conditional_read_is_never_made_unconditional():
    # both guards read L['a'].b only when L['a'] is not None: binding it up front would
    # raise (fail) for a None that every guard accepts
    guards = ["(L['a'] is None or L['a'].b == 1)", "(L['a'] is None or L['a'].b > 0)",
              "(L['c'].d == 1 if L['c'] is not None else True)", "(L['c'] is None or L['c'].d >= 1)"]
    full, body = _compile(guards)
    assert full({"a": None, "c": None}) is True, body
    ok = types.SimpleNamespace(b=1, d=1)
    assert full({"a": ok, "c": ok}) is True
    assert full({"a": types.SimpleNamespace(b=2), "c": ok}) is False


def test_the_right_side_of_a_top_level_and_is_read_once():
    # the guard fails unless its right side is evaluated, so a read there is shared too
    guards = ["(type(L['x'].v) is int and L['x'].w.z == 1)", "(L['x'].w.z > 0)"]
    full, body = _compile(guards)
    assert "\n".join(body).count(".w") == 1, body
    assert full({"x": types.SimpleNamespace(v=1, w=types.SimpleNamespace(z=1))}) is True
    assert full({"x": types.SimpleNamespace(v=1.0, w=types.SimpleNamespace(z=1))}) is False


def test_a_parameter_shadowing_a_builtin_is_not_taken_for_it():
    body, _ = load_check_body([(0, "(type(x.a) is int)"), (1, "(type(x.a) is int)")], fail="False",
                              params=frozenset({"type", "x"}))
    assert not any(line.strip().startswith("___tcb_v") and "type(" in line for line in body), body


def _operations(source: str) -> int:
    return sum(isinstance(n, (ast.Attribute, ast.Subscript, ast.Call)) for n in ast.walk(ast.parse(source)))


def test_generated_check_does_fewer_operations_and_uses_sites():
    guards = _guards(8) + [f"(___fn_digest(___resolved(___c{i % 3}, 'forward')) == 'd{i}')" for i in range(6)] \
        + [f"(not ___dict_contains('forward', L['self']._modules['model']._modules['layers']._modules['{i}'].__dict__))"
           for i in range(8)]
    _, body = _compile(guards)
    written = _operations("\n".join(guards))
    generated = _operations("def full(L):\n" + "\n".join(body))
    assert generated * 2 <= written, (generated, written)
    text = "\n".join(body)
    assert "___fn_digest" not in text and text.count("___t_r") == 6, text
    assert "___dict_contains" not in text and "___dict_has" in text


# --------------------------------------------------------------------------- end to end
CODE = textwrap.dedent(
    """
    import os
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import frames, same, stats

    def deco(flag):
        def wrap(fn):
            def wrapper(self, x, k=1.0):
                return fn(self, x, k) if flag else -fn(self, x, k)
            return wrapper
        return wrap

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        @deco(True)
        def helper(self, x, k=1.0):
            return x * k

        def forward(self, x):
            return self.helper(self.lin(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    ROOT = os.environ["ROOT"]
    m, x = Net(), torch.randn(2, 4)
    out = {}
    with torch.no_grad():
        if os.environ["PHASE"] == "cold":
            f = torch.compile(m, backend="npu_cached", options={"cache_dir": ROOT, "compiler": "eager"})
            out["cold"] = same(f(x), m(x))
        elif os.environ["PHASE"] == "plain":
            f = tcb.load(m, ROOT, compiler="eager")
            out["first"] = same(f(x), m(x))
        else:
            f = tcb.load(m, ROOT, compiler="eager", guards="call")
            (variant,) = f._variants
            replay, served = variant.fn, [0]

            def counted(*args, **kwargs):
                served[0] += 1
                return replay(*args, **kwargs)

            variant.fn = counted
            out["first"] = same(f(x), m(x)) and same(f(x), m(x)) and same(f(x), m(x))
            replays = [served[0]]
            wrapper = Block.helper
            cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__))
            inner = cells["fn"].cell_contents
            code, defaults = inner.__code__, inner.__defaults__

            def check(name):
                out[name] = same(f(x), m(x))
                replays.append(served[0])

            inner.__code__ = (lambda self, x, k=1.0: x - k).__code__
            check("code")
            inner.__code__ = code
            check("code_back")
            inner.__defaults__ = (3.0,)
            check("defaults")
            inner.__defaults__ = defaults
            cells["flag"].cell_contents = False
            check("cell")
            cells["flag"].cell_contents = True
            Block.helper = lambda self, x, k=1.0: x + 1
            check("patched")
            Block.helper = wrapper
            check("restored")
            out["served"] = replays
    emit({"out": out, "stats": stats(), "frames": frames()})
    """
)


@pytest.fixture(scope="module")
def warm_call(tmp_path_factory):
    from subprocess_helpers import run_python

    root = str(tmp_path_factory.mktemp("guard_cost"))
    cold = run_python(CODE, env={"ROOT": root, "PHASE": "cold"})
    assert cold["out"]["cold"], cold
    return root, run_python(CODE, env={"ROOT": root, "PHASE": "warm"})


def test_guards_call_catches_each_change_between_two_calls(warm_call):
    _, warm_call = warm_call
    out = warm_call["out"]
    assert all(v for k, v in out.items() if k != "served"), out
    # replayed 3 times, then not replayed (and right) after each change, replayed again once undone
    counts = out["served"]
    steps = ["code", "code_back", "defaults", "cell", "patched", "restored"]
    replayed = {step: counts[i + 1] > counts[i] for i, step in enumerate(steps)}
    assert counts[0] == 3 and replayed == {"code": False, "code_back": True, "defaults": False, "cell": False,
                                           "patched": False, "restored": True}, (counts, warm_call["stats"])
    assert warm_call["stats"]["bypass_loads"] == 1, warm_call["stats"]


def test_checks_of_an_older_format_are_rebuilt_never_run(warm_call):
    # an entry whose checks were generated by an older version (CHECKS_FORMAT) is never
    # evaluated: the call compiles and replaces it, and the next process replays the new one
    import glob
    import json

    from subprocess_helpers import run_python

    from torchair_cached_backend.bypass.guard_runtime import CHECKS_FORMAT

    root, _ = warm_call
    (path,) = glob.glob(f"{root}/programs/*/manifest.json")

    def formats() -> set[int]:
        with open(path) as f:
            return {frame["guards"]["format"] for frame in json.load(f)["program"]["frames"].values()}

    with open(path) as f:
        manifest = json.load(f)
    for frame in manifest["program"]["frames"].values():
        frame["guards"]["format"] = CHECKS_FORMAT - 1
    with open(path, "w") as f:
        json.dump(manifest, f)
    rebuilt = run_python(CODE, env={"ROOT": root, "PHASE": "plain"})
    assert rebuilt["out"]["first"] and rebuilt["frames"] >= 1, rebuilt
    assert rebuilt["stats"]["bypass_loads"] == 0, rebuilt["stats"]
    again = run_python(CODE, env={"ROOT": root, "PHASE": "plain"})
    assert again["out"]["first"] and again["frames"] == 0 and again["stats"]["bypass_loads"] == 1, again
    assert CHECKS_FORMAT in formats()  # the rebuilt frame (the older one stays, never run: program.py's call)


def test_environment_reads_match_os_environ(monkeypatch):
    names = ("TCB_GUARD_COST_UNSET", "TCB_GUARD_COST_SET")
    monkeypatch.delenv(names[0], raising=False)
    monkeypatch.setenv(names[1], "héllo")
    read = HELPERS["___env"]
    assert read(names) == (None, "héllo") == tuple(__import__("os").environ.get(n) for n in names)
    monkeypatch.setenv(names[0], "1")
    assert read(names) == ("1", "héllo")  # a change between two calls is seen


SHADOWING = r'''
import os, sys
import torch
import torchair_cached_backend as tcb

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = torch.nn.Linear(4, 4)

    def forward(self, x, type=None, len=3):  # parameters named like builtins the guards call
        y = self.l(x)
        if type == "double":
            y = y * 2
        return y * len

m = M().eval()
x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
d = os.environ["ROOT"]
with torch.no_grad():
    if os.environ["PHASE"] == "cold":
        f = torch.compile(m, backend="npu_cached", options={"cache_dir": d, "compiler": "eager"})
        emit({"ok": bool(torch.allclose(f(x, type="double"), m(x, type="double")))})
    else:
        f = tcb.load(m, d, compiler="eager")
        same = bool(torch.allclose(f(x, type="double"), m(x, type="double")))
        replayed = tcb.stats().fallbacks == 0
        other = bool(torch.allclose(f(x, type=None, len=5), m(x, type=None, len=5)))
        emit({"same": same, "replayed": replayed, "other": other, "stats": tcb.stats().as_dict()})
'''


def test_a_forward_whose_parameters_shadow_builtins_replays(tmp_path):
    """Guards call builtins by name (``type(...)``, ``len(...)``); in the generated checks the
    frame's parameters are names too, so a forward taking ``type=`` or ``len=`` made every
    check fail at capture and the frame never replayed. Shadowed builtins are read from
    ``___builtins``: the frame replays, and another argument value still falls back."""
    from subprocess_helpers import run_python

    root = str(tmp_path)
    assert run_python(SHADOWING, env={"ROOT": root, "PHASE": "cold"})["ok"]
    warm = run_python(SHADOWING, env={"ROOT": root, "PHASE": "warm"})
    assert warm["same"] and warm["replayed"], warm
    assert warm["stats"]["bypass_loads"] >= 1, warm
    assert warm["other"], warm  # specialized on type="double": the other value is compiled, right


# --------------------------------------------------------------------------- faster, same values
def _sample_functions():
    import collections.abc
    import dataclasses
    import enum
    import functools

    import torch

    class Color(enum.IntEnum):
        RED = 1

    @dataclasses.dataclass
    class Point:
        x: float = 1.5
        tags: tuple = ("a", 2, 3.0)

    def nested(a, b=(1, 2.0, "x", None, b"y", -0.0, 10**30), *, c=frozenset({"p", "q"})):
        table = {k: [v for v in range(k)] for k in range(a)}
        return (lambda z: z + b[0])(len(table)), c, 1j, ...

    def level(n):
        def inner(x, k=n):
            return x * k + n
        return inner

    deep = level(1)
    for i in range(6):  # a chain of closures deeper than the description goes
        deep = (lambda f, j: (lambda x, j=j: f(x) + j))(deep, i)
    empty = (lambda: (lambda: late))()  # an empty cell (late is assigned below)
    late = 1  # noqa: F841 - what the empty cell would hold
    odd = nested.__code__.replace(co_consts=(*nested.__code__.co_consts, torch.float32, [1, 2]))
    values = [None, True, 1, 1.0, -0.0, "s", b"b", (1, (2, "x")), [1, [2]], {"b": 1, "a": (2,)},
              collections.OrderedDict(a=1), Color.RED, Point, Point(), torch, torch.float32, torch.device("cpu"),
              torch.ones(3), torch.nn.Linear(2, 2), functools.partial(nested, 1), Point().__repr__, len,
              deep, empty, level(2), nested, collections.abc.Mapping.get, types.SimpleNamespace(a=[1])]
    functions = [nested, deep, empty, level(3), Point.__init__, Point.__eq__, torch.nn.Module.add_module,
                 torch.nn.Module.__call__, collections.abc.Mapping.get, functools.reduce]
    return values, functions, odd


def _walked_fingerprint(code):
    """The codec's fingerprint as written before its walk skipped atom constants: every
    constant mapped one by one. Digests stored by either must hold for the other."""
    import hashlib
    import importlib.util
    import marshal
    import sys

    from torchair_cached_backend import code_codec

    def item(value):
        t = type(value)
        if t in code_codec._FP_ATOMS:
            return value
        if t is types.CodeType:
            return tree(value)
        if t is tuple:
            return ("t", tuple(item(v) for v in value))
        return code_codec._fp_item(value)  # frozensets and values that are not plain data

    def tree(c):
        return ("c", *(getattr(c, f, None) for f in code_codec._FP_FIELDS), c.co_code,
                getattr(c, "co_exceptiontable", b""), tuple(item(v) for v in c.co_consts))

    tag = (code_codec.FINGERPRINT_VERSION, *sys.version_info[:2], importlib.util.MAGIC_NUMBER)
    return hashlib.sha256(marshal.dumps((tag, tree(code)), 2)).hexdigest()


def test_code_fingerprint_is_the_codecs():
    # the guards fingerprint with the codec, whose faster walk hashes exactly the bytes of the
    # constant-by-constant walk: digests stored before hold after
    import gc

    from torchair_cached_backend import code_codec

    _, functions, odd = _sample_functions()
    codes = [f.__code__ for f in functions if hasattr(f, "__code__")] + [odd]
    codes += [o.__code__ for o in gc.get_objects() if type(o) is types.FunctionType][:3000]
    assert all(code_codec.code_fingerprint(c) == _walked_fingerprint(c) for c in codes)
    assert all(guard_runtime._code_fp(c) == code_codec.code_fingerprint(c) for c in codes[:50])
    # still what the code does, not where it is: a constant's type counts, a line number does not
    one = compile("def f():\n    return 1\n", "a.py", "exec").co_consts[0]
    same = compile("\n\ndef f():\n    return 1\n", "elsewhere/b.py", "exec").co_consts[0]
    other = [compile(f"def f():\n    return {v}\n", "a.py", "exec").co_consts[0] for v in ("1.0", "True", "'1'")]
    fp = code_codec.code_fingerprint
    assert fp(one) == fp(same) and len({fp(one), *map(fp, other)}) == 4


def test_bound_values_are_described_as_describe_value_does():
    # the stored function digests keep their meaning: the description (and its depth limit) is the same
    import hashlib
    import marshal

    from torchair_cached_backend.fingerprint import describe_value

    values, functions, _ = _sample_functions()
    for depth in range(7):
        for value in values:
            assert guard_runtime._describe(value, depth) == describe_value(value, depth), (value, depth)
    for fn in functions:
        if not hasattr(fn, "__code__"):
            continue
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(describe_value(cell.cell_contents))
            except ValueError:
                cells.append("<empty>")
        bound = [describe_value(fn.__defaults__), describe_value(fn.__kwdefaults__), cells]
        reference = hashlib.sha256(b"m" + marshal.dumps(bound, 0)).hexdigest()[:32]
        assert guard_runtime._bound_digest(fn) == reference, fn


def test_bulk_constant_decoding_is_the_codecs_and_refuses_what_it_refuses():
    import collections.abc

    from torchair_cached_backend import code_codec
    from torchair_cached_backend.bypass.guard_runtime import decode_const, decode_consts

    good = [{"kind": "class", "module": "collections.abc", "qualname": "Mapping"},
            {"kind": "function", "module": "collections.abc", "qualname": "Mapping.get"},
            {"kind": "module", "name": "collections.abc"}, {"kind": "dtype", "name": "float16"},
            {"kind": "int", "value": 1}, {"kind": "bool", "value": True}, {"kind": "typename", "name": "a.B"},
            {"kind": "tuple", "items": [{"kind": "int", "value": 2}]}]
    memo: dict = {}
    decoded = decode_consts(good, memo)
    assert decoded[:3] == [collections.abc.Mapping, collections.abc.Mapping.get, collections.abc]
    assert all(a is b or (a == b and type(a) is type(b)) for a, b in zip(decoded, map(decode_const, good), strict=True))
    again = decode_consts([dict(d) for d in good], memo)  # other dict objects, equal descriptors: memo hits
    assert all(a is b for a, b in zip(again, decoded, strict=True))
    bad = [{"kind": "class", "module": "collections.abc", "qualname": "Mapping.get"},  # not a class
           {"kind": "function", "module": "collections.abc", "qualname": "Mapping"},  # a class, not a function
           {"kind": "class", "module": "collections.abc", "qualname": "NoSuchThing"},
           {"kind": "class", "module": "collections.abc", "qualname": "f.<locals>.C"},
           {"kind": "class", "module": "collections.abc", "qualname": "Mapping..get"},
           {"kind": "class", "module": "", "qualname": "Mapping"}, {"kind": "module", "name": ""},
           {"kind": "class", "module": "collections.abc", "qualname": 3},
           {"kind": "int", "value": True}, {"kind": "bool", "value": 1}]  # 1 == True: never one memo key
    for desc in bad:
        with pytest.raises(code_codec.CodecError) as expected:
            code_codec.decode_value(desc)
        with pytest.raises(code_codec.CodecError) as ours:
            decode_consts([{"kind": "int", "value": 1}, {"kind": "bool", "value": True}, desc], memo)
        assert str(ours.value) == str(expected.value)


def test_generated_checks_carry_no_line_table_yet_tracebacks_format():
    import sys
    import traceback

    from torchair_cached_backend.bypass.guard_codegen import without_lines

    source = "def check(L):\n    x = L['a']\n    for i in range(2):\n        y = [j for j in range(i)]\n    return x.b\n"
    plain = compile(source, "<t>", "exec")
    bare = without_lines(plain)
    namespace: dict = {}
    exec(bare, namespace)  # noqa: S102 - the source above
    fn = namespace["check"]
    assert fn({"a": types.SimpleNamespace(b=3)}) == 3
    with pytest.raises(AttributeError) as info:
        fn({"a": 1})
    assert "AttributeError" in "".join(traceback.format_exception(info.value))
    if sys.version_info[:2] == (3, 11):
        assert len(fn.__code__.co_linetable) * 8 >= len(fn.__code__.co_code) // 2
        assert len(fn.__code__.co_linetable) < len(plain.co_consts[0].co_linetable) // 4
        assert all(p == (None, None, None, None) for p in fn.__code__.co_positions())
