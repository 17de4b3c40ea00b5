"""Tests for ``code_codec`` on code objects Dynamo really emits.

Sample functions live at module level so their classes and globals resolve by
``module.qualname``; the cross-process test imports this file by name.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import marshal
import math
import os
import secrets
import struct
import subprocess
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend

from torchair_cached_backend import code_codec
from torchair_cached_backend.code_codec import (
    CodecError,
    code_fingerprint,
    decode_value,
    dumps_code,
    encode_value,
    loads_code,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

NT = collections.namedtuple("NT", "a b")


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Perm(enum.Flag):
    R = 1
    W = 2


@dataclasses.dataclass
class DC:
    a: torch.Tensor
    b: int = 0


def plain_function(x: Any) -> Any:
    return x


# ---- sample functions: each makes Dynamo bake a different constant ---------


def ret_dtype(x: torch.Tensor) -> Any:
    return x + 1, x.dtype


def ret_shape(x: torch.Tensor) -> Any:
    return x + 1, x.shape, x.shape[1:]


def ret_device(x: torch.Tensor) -> Any:
    return x + 1, x.device


def ret_slice(x: torch.Tensor) -> Any:
    return x[1:3] + 1, slice(1, 3), slice(x.dtype, None)


def ret_namedtuple(x: torch.Tensor) -> Any:
    return NT(x + 1, x.dtype)  # Dynamo bakes the bound method NT._make


def ret_enum(x: torch.Tensor) -> Any:
    return x + 1, Color(2)


def ret_dataclass(x: torch.Tensor) -> Any:
    return DC(x + 1, 3)


def ret_closure(x: torch.Tensor) -> Any:
    y = x * 2

    def inner(z: torch.Tensor) -> torch.Tensor:
        return z + y

    return inner  # Dynamo bakes this module's __dict__ and inner's code


def ret_misc(x: torch.Tensor) -> Any:
    return x + torch.finfo(x.dtype).eps, x.layout, torch.finfo(x.dtype), type(None), list[int]


def ret_graph_break(x: torch.Tensor) -> Any:
    y = x + 1
    torch._dynamo.graph_break()
    return y * 2, x.dtype  # the resume function carries the dtype


def ret_listcomp_break(x: torch.Tensor) -> Any:
    return x + 1, [f.name for f in dataclasses.fields(DC)]  # listcomp graph break


def uses_set(x: Any) -> Any:
    return x if x in {"a", "b", "c", "d"} else None  # frozenset constant


SAMPLES: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        ret_dtype,
        ret_shape,
        ret_device,
        ret_slice,
        ret_namedtuple,
        ret_enum,
        ret_dataclass,
        ret_closure,
        ret_misc,
        ret_graph_break,
        ret_listcomp_break,
    )
}
MARSHAL_OK_TODAY = {"ret_dataclass"}  # Dynamo loads DC via globals


def sample_input() -> torch.Tensor:
    return torch.arange(12.0).reshape(3, 4)


def compile_samples() -> dict[str, list[types.CodeType]]:
    """Run every sample under ``torch.compile`` and collect Dynamo's output code."""
    import torch._dynamo.convert_frame as convert_frame

    captured: list[types.CodeType] = []
    torch._dynamo.reset()
    handle = convert_frame.register_bytecode_hook(lambda code, new_code: captured.append(new_code))
    out: dict[str, list[types.CodeType]] = {}
    try:
        for name, fn in SAMPLES.items():
            captured.clear()
            torch.compile(fn, backend="eager", dynamic=False)(sample_input())
            out[name] = list(captured)
    finally:
        handle.remove()
    return out


def _marshals(code: types.CodeType) -> bool:
    try:
        marshal.dumps(code)
    except ValueError:
        return False
    return True


def assert_same_value(a: object, b: object) -> None:
    """Same type and value, recursing into code objects and containers."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, types.CodeType):
        assert isinstance(b, types.CodeType)
        assert a.co_code == b.co_code and a.co_names == b.co_names
        assert len(a.co_consts) == len(b.co_consts)
        for x, y in zip(a.co_consts, b.co_consts, strict=True):
            assert_same_value(x, y)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(typing.cast(tuple, b))
        for x, y in zip(a, typing.cast(tuple, b), strict=True):
            assert_same_value(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(typing.cast(float, b))
    elif isinstance(a, torch.finfo):
        assert str(a) == str(b)
    else:
        assert a == b, (a, b)


def assert_same_output(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, types.FunctionType):
        assert isinstance(b, types.FunctionType)
        assert_same_output(a(sample_input()), b(sample_input()))
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(typing.cast(tuple, b))
        for x, y in zip(a, typing.cast(tuple, b), strict=True):
            assert_same_output(x, y)
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            assert_same_output(getattr(a, f.name), getattr(b, f.name))
    else:
        assert_same_value(a, b)


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    start = len(code_codec._PREFIX) + 4
    (size,) = struct.unpack_from(">I", data, len(code_codec._PREFIX))
    return json.loads(data[start : start + size]), data[start + size :]


def read_header(data: bytes) -> dict[str, Any]:
    return _split(data)[0]


def repack(data: bytes, **changes: object) -> bytes:
    """Rewrite header fields of a payload (to simulate other writers)."""
    header, body = _split(data)
    header.update(changes)
    raw = json.dumps(header).encode()
    return code_codec._PREFIX + struct.pack(">I", len(raw)) + raw + body


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[types.CodeType]]:
    return compile_samples()


# ---- round trips on real Dynamo output --------------------------------------


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_dynamo_code_round_trips_and_runs(compiled: dict[str, list[types.CodeType]], name: str) -> None:
    codes = compiled[name]
    assert codes, f"Dynamo produced no code for {name}"
    assert all(_marshals(c) for c in codes) == (name in MARSHAL_OK_TODAY)
    for code in codes:
        loaded = loads_code(dumps_code(code))
        assert_same_value(loaded, code)
        assert loaded.co_name == code.co_name and loaded.co_firstlineno == code.co_firstlineno

    fn = SAMPLES[name]
    rebuilt = types.FunctionType(
        loads_code(dumps_code(codes[0])), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    assert_same_output(rebuilt(sample_input()), fn(sample_input()))


def test_singleton_constants_give_equal_code(compiled: dict[str, list[types.CodeType]]) -> None:
    # code == code compares unknown constants by identity, so it holds when
    # every restored constant is a singleton (dtype, enum member, module dict);
    # a rebuilt torch.Size or annotations dict only compares equal by value.
    for name in ("ret_dtype", "ret_enum", "ret_listcomp_break"):
        code = compiled[name][0]
        assert loads_code(dumps_code(code)) == code


def test_nested_code_and_containers() -> None:
    inner = compile("def g():\n    return 1\n", "<t>", "exec").co_consts[0]
    inner = inner.replace(
        co_consts=(*inner.co_consts, torch.float16, (slice(None, torch.float32), frozenset({torch.int8, 3})))
    )
    outer = compile("x = 0", "<t>", "exec")
    outer = outer.replace(co_consts=(*outer.co_consts, inner, (DC, NT(1, Color.RED)), Perm.R | Perm.W))
    assert not _marshals(outer)
    loaded = loads_code(dumps_code(outer))
    assert_same_value(loaded, outer)
    assert loaded.co_consts[-3].co_consts[-2] is torch.float16


def test_placeholder_lookalikes_survive(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = b"A" * 16
    tokens = iter([taken, b"B" * 16])
    monkeypatch.setattr(secrets, "token_bytes", lambda n: next(tokens))  # the codec imports it lazily
    code = compile("x = 0", "<t>", "exec")
    code = code.replace(co_consts=(*code.co_consts, (taken, 0), (b"B", 0), torch.float32))
    data = dumps_code(code)
    header = read_header(data)
    assert header["token"] == (b"B" * 16).hex()  # the colliding token was skipped
    assert_same_value(loads_code(data), code)


# ---- encode_value / decode_value ---------------------------------------------

VALUES = [
    None,
    True,
    7,
    2**80,
    -0.0,
    float("nan"),
    float("inf"),
    1 + 2j,
    "\udc80text",
    b"\x00\xff",
    Ellipsis,
    NotImplemented,
    (1, (2.5, "x")),
    frozenset({"b", "a"}),
    torch.float32,
    torch.bfloat16,
    torch.device("cpu"),
    torch.device("cuda", 1),
    torch.Size([2, 3]),
    torch.Size([]),
    torch.channels_last,
    torch.strided,
    torch.finfo(torch.float16),
    torch.iinfo(torch.int8),
    slice(1, None, torch.float32),
    int,
    type(None),
    type(Ellipsis),
    NT,
    DC,
    torch.Tensor,
    Color.BLUE,
    Perm.R | Perm.W,
    SDPBackend.MATH,
    NT(1, torch.int64),
    plain_function,
    torch.add,
    len,
    tuple.__new__,
    NT._make,
    torch.Tensor.add,
    object.__setattr__,
    torch,
    torch.nn.functional,
    list[int],
    dict[str, NT],
    typing.List[int],  # noqa: UP006 -- the typing alias is the point
    typing.Optional[int],  # noqa: UP045
    typing.Union[int, str],  # noqa: UP007
    typing.Callable[[int], str],
    {"z": "torch.Tensor", 1: (int, torch.float16)},
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_value_round_trip(value: object) -> None:
    desc = encode_value(value)
    back = decode_value(json.loads(json.dumps(desc)))
    assert_same_value(back, value)
    if value is None or isinstance(value, (type, enum.Enum, torch.dtype, types.ModuleType)):
        assert back is value


def test_module_dict_round_trip() -> None:
    desc = encode_value(globals())
    assert desc == {"kind": "module_dict", "module": __name__}
    assert decode_value(desc) is globals()


@pytest.mark.parametrize(
    "value",
    [[1, 2.5, "a", None], {3, 1, 2}, range(1, 9, 3), torch.ops.aten, [torch.float16, (1, [2])]],
    ids=["list", "set", "range", "op_namespace", "nested"],
)
def test_guard_values_round_trip(value: object) -> None:
    """Values Dynamo's EQUALS_MATCH / ID_MATCH guards compare with (lists, sets, ranges,
    ``torch.ops.aten``) encode as JSON and decode equal (or identical, for namespaces)."""
    desc = encode_value(value)
    json.dumps(desc)
    back = decode_value(desc)
    assert back is value if value is torch.ops.aten else (back == value and type(back) is type(value))


def _as_module() -> torch.nn.Module:
    class Func(torch.nn.Module):  # a local class: no import name rebuilds its instance
        def forward(self, x):
            return x

    return Func()


BOUND_INSTANCE = _as_module()  # as kernels binds `apply_rotary_pos_emb` in a transformers modeling module


def test_an_instance_a_module_binds_round_trips_by_that_name() -> None:
    with pytest.raises(CodecError):
        encode_value(BOUND_INSTANCE)
    desc = code_codec.encode_global(BOUND_INSTANCE)
    assert desc == {"kind": "global", "module": __name__, "name": "BOUND_INSTANCE",
                    "type": f"{__name__}._as_module.<locals>.Func"}
    assert decode_value(json.loads(json.dumps(desc))) is BOUND_INSTANCE
    with pytest.raises(CodecError, match="no module binds this") as info:
        code_codec.encode_global(_as_module())
    assert "Fix: " in str(info.value)


@pytest.mark.parametrize(
    "value, needle",
    [
        (object(), "unsupported constant type builtins.object"),
        ([1, object()], "unsupported constant type builtins.object"),
        ({"a": {object()}}, "unsupported constant type builtins.object"),
        (lambda: None, "does not import back"),
        (slice(object()), "builtins.object"),
        (torch.nn.Identity(), "no __module__/__qualname__"),  # Dynamo's unchecked `root` constant
    ],
)
def test_encode_refuses(value: object, needle: str) -> None:
    with pytest.raises(CodecError, match="Fix: ") as info:
        encode_value(value)
    assert needle in str(info.value)


def test_local_class_refused_at_dump_with_location() -> None:
    local_nt = collections.namedtuple("local_nt", "a")  # qualname has no <locals>, module does not export it

    class Local:
        pass

    code = compile("x = 0", "<t>", "exec")
    for bad, needle in ((Local, "<locals>"), (local_nt._make, "does not import back")):
        bad_code = code.replace(co_consts=(*code.co_consts, 1, bad))
        with pytest.raises(CodecError) as info:
            dumps_code(bad_code)
        err = info.value
        assert (err.code_name, err.const_index) == ("<module>", len(code.co_consts) + 1)
        assert needle in str(err) and "Fix: " in str(err)


@pytest.mark.parametrize(
    "desc, needle",
    [
        ({"kind": "class", "module": __name__, "qualname": "f.<locals>.C"}, "<locals>"),
        ({"kind": "class", "module": "torch", "qualname": "add"}, "expected a class"),
        ({"kind": "class", "module": "torch", "qualname": "no_such_thing"}, "no attribute path"),
        ({"kind": "class", "module": "no_such_module_xyz", "qualname": "C"}, "cannot import"),
        ({"kind": "function", "module": "math", "qualname": "pi"}, "expected a function"),
        ({"kind": "function", "module": "os", "qualname": "system()"}, "not an importable dotted name"),
        ({"kind": "enum", "cls": {"kind": "class", "module": "builtins", "qualname": "int"}, "name": "x"}, "enum"),
        ({"kind": "enum", "cls": encode_value(Color), "name": "GREEN"}, "no member 'GREEN'"),
        ({"kind": "namedtuple", "cls": encode_value(NT), "names": ["a"], "fields": []}, "fields ['a']"),
        ({"kind": "dtype", "name": "add"}, "expected a dtype"),
        ({"kind": "size", "dims": ["3"]}, "non-int"),
        ({"kind": "pickle", "data": "..."}, "unknown descriptor kind"),
        ({"kind": "global", "module": __name__, "name": "NO_SUCH", "type": "x.Y"}, "no top-level name 'NO_SUCH'"),
        ({"kind": "global", "module": __name__, "name": "NT", "type": "x.Func"}, "expected a x.Func"),
        ("class", "malformed descriptor"),
    ],
)
def test_decode_refuses(desc: object, needle: str) -> None:
    with pytest.raises(CodecError) as info:
        decode_value(desc)
    assert needle in str(info.value)


# ---- payload integrity -------------------------------------------------------


def test_refuses_other_python_version(compiled: dict[str, list[types.CodeType]]) -> None:
    data = dumps_code(compiled["ret_dtype"][0])
    with pytest.raises(CodecError, match=r"written by Python 3\.99 .*version-specific"):
        loads_code(repack(data, python=[3, 99]))
    with pytest.raises(CodecError, match="bytecode magic deadbeef"):
        loads_code(repack(data, magic="deadbeef"))


def test_refuses_corrupt_payloads(compiled: dict[str, list[types.CodeType]]) -> None:
    data = dumps_code(compiled["ret_dtype"][0])
    with pytest.raises(CodecError, match="checksum"):
        loads_code(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CodecError, match="prefix"):
        loads_code(b"\x80\x04pickle")
    with pytest.raises(CodecError, match="truncated"):
        loads_code(data[: len(code_codec._PREFIX) + 10])
    with pytest.raises(CodecError, match="format"):
        loads_code(repack(data, format=999))


def test_decode_error_is_located(compiled: dict[str, list[types.CodeType]]) -> None:
    data = dumps_code(compiled["ret_dtype"][0])
    with pytest.raises(CodecError) as info:
        loads_code(repack(data, table=[{"kind": "dtype", "name": "nope"}]))
    assert info.value.code_name == "ret_dtype" and info.value.const_index is not None


# ---- fingerprint -------------------------------------------------------------


def _fp(src: str, filename: str = "<a>") -> str:
    module = compile(src, filename, "exec")
    return code_fingerprint(next(c for c in module.co_consts if isinstance(c, types.CodeType)))


def test_fingerprint_ignores_lines_not_semantics() -> None:
    base = "def f(x):\n    return x + 1\n"
    assert _fp(base) == _fp(base)
    assert _fp(base) == _fp("\n\n" + base, "<moved>")  # line/file only: harmless
    assert _fp(base) != _fp(base.replace("1", "2"))
    assert _fp(base) != _fp(base.replace("1", "1.0"))
    assert _fp(base) != _fp(base.replace("1", "True"))
    assert _fp(base) != _fp(base.replace("x + 1", "x - 1"))
    assert _fp(base) != _fp(base.replace("f(x)", "f(x, y=0)"))
    nested = "def f(x):\n    def g():\n        return {}\n    return g\n"
    assert _fp(nested.format("1")) != _fp(nested.format("2"))
    code = compile("x = 0", "<t>", "exec")
    a = code.replace(co_consts=(*code.co_consts, torch.float32))
    b = code.replace(co_consts=(*code.co_consts, torch.float16))
    assert code_fingerprint(a) != code_fingerprint(b)


# ---- fresh processes ---------------------------------------------------------

_DUMP = """
import json, sys
sys.path[:0] = [{root!r}, {here!r}]
import test_code_codec as m
from torchair_cached_backend.code_codec import dumps_code, code_fingerprint
codes = m.compile_samples()
print(json.dumps({{
    "payloads": {{n: [dumps_code(c).hex() for c in cs] for n, cs in codes.items()}},
    "consts": {{n: [m.describe(c) for c in cs] for n, cs in codes.items()}},
    "fp": code_fingerprint(m.uses_set.__code__),
}}))
"""

_LOAD = """
import json, sys
sys.path[:0] = [{root!r}, {here!r}]
from torchair_cached_backend.code_codec import loads_code, code_fingerprint
payloads = json.load(sys.stdin)
assert "test_code_codec" not in sys.modules
out = {{n: [loads_code(bytes.fromhex(p)) for p in ps] for n, ps in payloads.items()}}
import test_code_codec as m  # already imported by loads_code to resolve its classes
print(json.dumps({{
    "consts": {{n: [m.describe(c) for c in cs] for n, cs in out.items()}},
    "fp": code_fingerprint(m.uses_set.__code__),
}}))
"""


def describe(code: types.CodeType) -> list[Any]:
    """A process-independent view of ``co_consts`` (types and reprs, recursively)."""
    out: list[Any] = []
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out.append(["code", c.co_name, describe(c)])
        elif isinstance(c, dict):
            out.append(["dict", c.get("__name__")])
        else:
            out.append([f"{type(c).__module__}.{type(c).__qualname__}", repr(c)])
    return out


def _run(script: str, seed: str, stdin: str = "") -> dict[str, Any]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    proc = subprocess.run(
        [sys.executable, "-c", script.format(root=ROOT, here=HERE)],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cross_process_round_trip() -> None:
    dumped = _run(_DUMP, seed="1")
    loaded = _run(_LOAD, seed="2", stdin=json.dumps(dumped["payloads"]))
    assert loaded["consts"] == dumped["consts"]
    assert set(loaded["consts"]) == set(SAMPLES)
    assert dumped["fp"] == loaded["fp"] == code_fingerprint(uses_set.__code__)
