"""Generating a frame's check module from its guard expressions, and testing it.

The guard expressions come from ``guard_capture`` in Dynamo's own form, over
``L['name']`` (frame locals) and ``___G[...]`` (the module globals). Here they
become a module with three functions that bind like the frame's function
(``___bind``, ``___call_check``, ``___full_check``: ``L['x']`` becomes the
parameter ``x``) and one load-time check over a locals dict (``___load_check``).
Before it is stored, the module is run on the values it was made from: every
guard must hold.
"""

from __future__ import annotations

import ast
import re
import types
from typing import Any, Protocol

from .. import code_codec
from .guard_runtime import CHECKS_FORMAT, HELPERS, decode_const, receiver_value
from .signature import call_args


class GuardTable(Protocol):
    """What code generation reads of a frame's collected guards (``guard_capture`` fills
    it); a protocol here, so this module never imports the capture side."""

    guards: list[dict[str, Any]]
    consts: list[Any]
    receiver: str | None
    resume: bool
    params: set[str]
    freevars: list[str]
    uses_cells: bool


LOCAL_RE = re.compile(r"(?<![\w\]'\"])L\[(['\"])([A-Za-z_][A-Za-z0-9_]*)\1\]")


class Unsupported(Exception):
    """A guard that cannot be checked in another process; the message names it."""


def signature_params(code: types.CodeType, with_cells: bool) -> tuple[str, list[str]]:
    """The parameter list of ``code`` as Python source (no defaults), and the names it binds."""
    names = list(code.co_varnames[: code.co_argcount])
    parts = list(names)
    if code.co_posonlyargcount:
        parts.insert(code.co_posonlyargcount, "/")
    i = code.co_argcount + code.co_kwonlyargcount
    kwonly = list(code.co_varnames[code.co_argcount : i])
    varargs = varkw = None
    if code.co_flags & 0x04:
        varargs = code.co_varnames[i]
        i += 1
    if code.co_flags & 0x08:
        varkw = code.co_varnames[i]
    if varargs:
        parts.append("*" + varargs)
    elif kwonly or with_cells:
        parts.append("*")
    parts.extend(kwonly)
    if with_cells:
        parts.append("___cells=()")
    if varkw:
        parts.append("**" + varkw)
    bound = names + ([varargs] if varargs else []) + kwonly + ([varkw] if varkw else [])
    return ", ".join(parts), bound


def source_module(builder: GuardTable, call_params: str, defs: list[str]) -> tuple[str, str]:
    """(the checks every warm start loads: ``___bind``, ``___call_check``, ``___load_check``;
    ``___full_check``, stored apart and loaded only where it is used: ``guards="call"``
    or a receiver not fixed at load)."""
    lines = [f"# npu_cached guard checks, format {CHECKS_FORMAT}"]
    call = [g["expr"] for g in builder.guards if g["scope"] == "call"]
    everything = [g["expr"] for g in builder.guards]
    if builder.resume and builder.receiver is not None:
        call.insert(0, f"({builder.receiver} is ___recv)")
    bound = [f"{n!r}: {n}" for n in defs]
    if builder.uses_cells:
        bound += [f"{n!r}: ___cells[{i}].cell_contents" for i, n in enumerate(builder.freevars)]
    lines.append(f"def ___bind({call_params}):\n    return {{{', '.join(bound)}}}")
    lines.append(f"def ___call_check({call_params}):\n    return {' and '.join(builder_param(builder, x) for x in call) or 'True'}")
    # every guard per call (guards="call", a receiver not fixed at load): a function like the
    # load-time one, per-layer guards in loops, False at the first that fails (or raises)
    full_body, _ = load_check_body([(i, builder_param(builder, x)) for i, x in enumerate(everything)], fail="False")
    full = (f"# npu_cached full guard check, format {CHECKS_FORMAT}\n"
            f"def ___full_check({call_params}):\n" + "\n".join(full_body + ["    return True"]) + "\n")
    body, count = load_check_body([(i, g["expr"]) for i, g in enumerate(builder.guards) if g["scope"] == "load"])
    lines.append("def ___load_check(L):\n" + "\n".join(body + ["    return -1"]))
    lines.append(f"___load_checks = {count}")
    return "\n".join(lines) + "\n", full


_ITEM = "___tcb_m"  # the loop variable of a check repeated per item of a module list
_KEY = "___tcb_k"


def load_check_body(guards: list[tuple[int, str]], fail: str | None = None) -> tuple[list[str], int]:
    """The body of ``___load_check`` (evaluated once at load; returns the index of a guard
    that fails, -1 when all hold; the messages are made only then, from the JSON meta) and
    how many checks it holds. A guard repeated for every item of a module list (the same
    check on ``layers[i]`` for each ``i``) is written once, in a loop over those items, so
    the checks grow with the distinct shapes of the layers, not with the layer count. Every
    guard is still evaluated, on the same values: the loop binds ``layers._modules['i']``
    to a name, and the template reads it where the guard read the path. ``fail``: what a
    failing check returns instead of its guard's index (``"False"`` for the full check)."""
    templates: dict[tuple[str, str], list[tuple[int, str]]] = {}
    plain: list[tuple[int, str]] = []
    for index, expr in guards:
        shape = _per_item_template(expr)
        if shape is None:
            plain.append((index, expr))
        else:
            owner, key, template = shape
            templates.setdefault((owner, template), []).append((index, key))
    loops: dict[tuple[str, tuple[str, ...]], list[tuple[int, str]]] = {}
    for (owner, template), members in templates.items():
        keys = tuple(sorted((key for _, key in members), key=int))
        if len(members) < 2 or len(set(keys)) != len(keys):
            plain.extend((index, _instantiate(template, owner, key)) for index, key in members)
            continue
        loops.setdefault((owner, keys), []).append((members[0][0], template))
    plain.sort()
    # parenthesized: a template is unparsed without the guard's own parentheses (``not a and b``)
    body = [f"    if not ({expr}): return {fail or index}" for index, expr in plain]
    count = len(plain)
    for (owner, keys), checks in loops.items():
        body.append(f"    for {_KEY} in {keys!r}:")
        body.append(f"        {_ITEM} = {owner}._modules[{_KEY}]")
        body += [f"        if not ({template}): return {fail or index}" for index, template in checks]
        count += len(checks)
    return body, count


def _instantiate(template: str, owner: str, key: str) -> str:
    """A template back as one guard (the item's path where the loop variable stood)."""
    tree = ast.parse(template, mode="eval")
    item = ast.parse(f"{owner}._modules[{key!r}]", mode="eval").body

    class Put(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            return item if node.id == _ITEM else node

    return ast.unparse(Put().visit(tree))


def _per_item_template(expr: str) -> tuple[str, str, str] | None:
    """``(owner, key, template)`` when ``expr`` reads an item ``owner._modules['<digits>']``
    of a module list (the outermost such item): the template is ``expr`` with every
    occurrence of that item replaced by the loop variable. None otherwise."""
    if _ITEM in expr or _KEY in expr:
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None
    best: tuple[int, ast.Subscript] | None = None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "_modules" and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str) and node.slice.value.isdigit()):
            size = len(ast.dump(node))
            if best is None or size < best[0]:
                best = (size, node)
    if best is None:
        return None
    item = best[1]
    target = ast.dump(item)
    key = item.slice.value  # type: ignore[attr-defined]
    owner = ast.unparse(item.value.value)  # type: ignore[attr-defined]

    class Take(ast.NodeTransformer):
        def visit(self, node: ast.AST) -> ast.AST:
            if isinstance(node, ast.Subscript) and ast.dump(node) == target:
                return ast.copy_location(ast.Name(id=_ITEM, ctx=ast.Load()), node)
            return super().visit(node)

    return owner, key, ast.unparse(Take().visit(tree))


def builder_param(builder: GuardTable, expr: str) -> str:
    """L-form -> parameter form: ``L['x']`` is the parameter ``x``; a free variable
    is read from the closure cells the check is given."""

    def local(m: re.Match[str]) -> str:
        name = m.group(2)
        if name in builder.params:
            return name
        if name in builder.freevars:
            builder.uses_cells = True
            return f"___cells[{builder.freevars.index(name)}].cell_contents"
        raise Unsupported(f"guard reads frame local {name!r}")

    return LOCAL_RE.sub(local, expr)


def self_test(
    compiled: tuple[types.CodeType, types.CodeType],
    builder: GuardTable,
    code: types.CodeType,
    local_scope: dict[str, Any],
    global_scope: dict[str, Any],
    receiver: str | None,
    overrides: dict[str, Any] | None = None,
) -> None:
    """Run the generated checks on the frame's own values: all must hold (``overrides``:
    helpers that read, at capture, the state as Dynamo saw it)."""
    namespace = dict(HELPERS)
    namespace.update(overrides or {})
    namespace["___G"] = global_scope
    namespace["___cells"] = tuple(types.CellType(local_scope.get(n)) for n in builder.freevars)
    namespace["___recv"] = receiver_value(receiver, local_scope)
    for i, desc in enumerate(builder.consts):
        namespace[f"___c{i}"] = decode_const(desc)
    for part in compiled:
        exec(code_codec.loads_code(code_codec.dumps_code(part)), namespace)  # noqa: S102 - just generated above
    for entry in builder.guards:
        try:
            ok = eval(entry["expr"], namespace, {"L": local_scope})  # noqa: S307 - generated above
        except Exception as exc:
            raise Unsupported(f"guard {entry['desc']!r} cannot be evaluated: {type(exc).__name__}: {exc}") from exc
        if not ok:
            raise Unsupported(f"guard {entry['desc']!r} does not hold for the values it was made from")
    if namespace["___load_check"](local_scope) != -1:
        raise Unsupported("the generated load-time check fails for the values it was made from")
    pos, kwargs = call_args(code, local_scope)
    if builder.uses_cells:
        kwargs = dict(kwargs, ___cells=namespace["___cells"])
    if not (namespace["___full_check"](*pos, **kwargs) and namespace["___call_check"](*pos, **kwargs)):
        raise Unsupported("the generated check does not accept the call it was made from")
