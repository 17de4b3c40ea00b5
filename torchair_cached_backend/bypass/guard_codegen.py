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
import builtins
import copy
import io
import re
import sys
import tokenize
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
    params = frozenset(defs) | ({"___cells"} if builder.uses_cells else set())
    full_sites: list[str] = []
    full_body, _ = load_check_body([(i, builder_param(builder, x)) for i, x in enumerate(everything)], fail="False",
                                   sites=full_sites, params=params, prefix="___tcb_f")
    full = (f"# npu_cached full guard check, format {CHECKS_FORMAT}\n" + "".join(s + "\n" for s in full_sites)
            + f"def ___full_check({call_params}):\n" + "\n".join(full_body + ["    return True"]) + "\n")
    # evaluated once per load: no memoizing sites (they would only cost their setup)
    body, count = load_check_body([(i, g["expr"]) for i, g in enumerate(builder.guards) if g["scope"] == "load"],
                                  params=frozenset({"L"}), prefix="___tcb_l")
    lines.append("def ___load_check(L):\n" + "\n".join(body + ["    return -1"]))
    lines.append(f"___load_checks = {count}")
    return "\n".join(lines) + "\n", full


_ITEM = "___tcb_m"  # the loop variable of a check repeated per item of a module list
_KEY = "___tcb_k"


def load_check_body(guards: list[tuple[int, str]], fail: str | None = None, sites: list[str] | None = None,
                    params: frozenset[str] = frozenset(), prefix: str = "___tcb_") -> tuple[list[str], int]:
    """The body of ``___load_check`` (evaluated once at load; returns the index of a guard
    that fails, -1 when all hold; the messages are made only then, from the JSON meta) and
    how many checks it holds. A guard repeated for every item of a module list (the same
    check on ``layers[i]`` for each ``i``) is written once, in a loop over those items, so
    the checks grow with the distinct shapes of the layers, not with the layer count. Every
    guard is still evaluated, on the same values: the loop binds ``layers._modules['i']``
    to a name, and the template reads it where the guard read the path. ``fail``: what a
    failing check returns instead of its guard's index (``"False"`` for the full check).

    The statements are then made cheaper without changing what any guard reads or compares
    (:class:`_Cheaper`): a read many guards share (``L['self']._modules['model']``, a
    ``dict(type(x).__mro__[1].__dict__)`` copy) is bound to a local once, where a guard
    reads it unconditionally, and read from there; ``sites`` (module-level lines, filled
    here) receives one memoizing check object per resolved-method guard (``params``: the
    function's parameter names, which may shadow a builtin the guards call; ``prefix``: of
    the names bound, distinct per function whose module shares a namespace)."""
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
    cheaper = _Cheaper(sites, params, prefix)
    bound: dict[str, str] = {}
    body = cheaper.statements([(expr, str(fail or index)) for index, expr in plain], bound, "    ")
    count = len(plain)
    for (owner, keys), checks in loops.items():
        body.append(f"    for {_KEY} in {keys!r}:")
        body.append(f"        {_ITEM} = {cheaper.rewrite(f'{owner}._modules[{_KEY}]', bound)}")
        body += cheaper.statements([(template, str(fail or index)) for index, template in checks], dict(bound),
                                   "        ")
        count += len(checks)
    return body, count


#: builtins and helpers that only read (the same arguments give the same value within one check)
_READ_CALLS = frozenset({"type", "dict", "len", "tuple", "list", "id", "___odict_getitem", "___resolved"})
_READ_METHODS = frozenset({("dict", "keys"), ("dict", "__getitem__")})


class _Cheaper:
    """Rewrites a check's guard statements into cheaper, equivalent ones.

    * Common reads: an attribute, constant subscript or read-only call that several guards
      evaluate is bound to a local (``___tcb_v<n> = ...``) just before the first guard that
      evaluates it unconditionally (outside the right side of an ``or``/``if``; the right
      side of a top-level ``and`` counts, since the guard fails without it), and later
      guards read the local. Guards only read, so a value read once is the value each guard
      would have read; a read that raises there would have made that guard raise (a failure
      either way), and one read only conditionally before is left in place there.
    * ``___fn_digest(___resolved(owner, 'name')) == digest`` becomes a call of a per-site
      :class:`~.guard_runtime.ResolvedSite` (memoized, re-validated by identity per call).
    * ``___dict_contains(key, d)`` becomes ``dict.__contains__(d, key)`` (the same C call,
      without a Python frame).
    """

    def __init__(self, sites: list[str] | None, params: frozenset[str], prefix: str) -> None:
        self.sites = sites
        self.shadowed = params
        self.prefix = prefix
        self.counter = 0

    # -- single-guard rewrites -----------------------------------------------------
    def _direct(self, tree: ast.AST) -> ast.AST:
        outer = self

        class Direct(ast.NodeTransformer):
            def visit_Compare(self, node: ast.Compare) -> ast.AST:
                self.generic_visit(node)
                site = outer._site(node)
                return node if site is None else site

            def visit_Call(self, node: ast.Call) -> ast.AST:
                self.generic_visit(node)
                if (isinstance(node.func, ast.Name) and node.func.id == "___dict_contains" and not node.keywords
                        and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                        and "___dict_has" not in outer.shadowed):
                    return ast.Call(ast.Name("___dict_has", ast.Load()), [node.args[1], node.args[0]], [])
                return node

        return Direct().visit(tree)

    def _site(self, node: ast.Compare) -> ast.AST | None:
        if self.sites is None or len(node.ops) != 1 or not isinstance(node.ops[0], ast.Eq):
            return None
        left, right = node.left, node.comparators[0]
        if not (isinstance(right, ast.Constant) and isinstance(right.value, str) and isinstance(left, ast.Call)
                and isinstance(left.func, ast.Name) and left.func.id == "___fn_digest" and len(left.args) == 1
                and not left.keywords):
            return None
        inner = left.args[0]
        if not (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "___resolved"
                and len(inner.args) == 2 and not inner.keywords and isinstance(inner.args[1], ast.Constant)
                and isinstance(inner.args[1].value, str)):
            return None
        name = f"{self.prefix}r{len(self.sites)}"
        self.sites.append(f"{name} = ___resolved_site({inner.args[1].value!r}, {right.value!r})")
        return ast.Call(ast.Name(name, ast.Load()), [inner.args[0]], [])

    # -- common reads ----------------------------------------------------------------
    def _pure(self, node: ast.AST, banned: set[str]) -> bool:
        if isinstance(node, ast.Name):
            return node.id not in banned
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Attribute):
            return self._pure(node.value, banned)
        if isinstance(node, ast.Subscript):
            return self._pure(node.value, banned) and self._pure(node.slice, banned)
        if isinstance(node, ast.Tuple):
            return all(self._pure(e, banned) for e in node.elts)
        if isinstance(node, ast.Call) and not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args):
            f = node.func
            reads = ((isinstance(f, ast.Name) and f.id in _READ_CALLS and f.id not in self.shadowed)
                     or (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                         and (f.value.id, f.attr) in _READ_METHODS and f.value.id not in self.shadowed))
            return reads and all(self._pure(a, banned) for a in node.args)
        return False

    def _occurrences(self, tree: ast.AST, banned: set[str], found: list[tuple[str, ast.AST, bool]]) -> None:
        """(key, node, evaluated unconditionally) of every candidate read in one guard."""

        def walk(node: ast.AST, always: bool, fails_if_false: bool, callee: bool = False) -> None:
            if isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)) and not callee and self._pure(node, banned):
                found.append((ast.dump(node), node, always))
            if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                return  # another scope
            if isinstance(node, ast.BoolOp):
                first, *rest = node.values
                keeps = isinstance(node.op, ast.And) and fails_if_false
                walk(first, always, keeps)
                for value in rest:
                    walk(value, always and keeps, keeps)
            elif isinstance(node, ast.IfExp):
                walk(node.test, always, False)
                walk(node.body, False, False)
                walk(node.orelse, False, False)
            elif isinstance(node, ast.Compare):
                walk(node.left, always, False)
                for i, comparator in enumerate(node.comparators):
                    walk(comparator, always and i == 0, False)
            elif isinstance(node, ast.NamedExpr):
                walk(node.value, always, False)
            elif isinstance(node, ast.Call):
                walk(node.func, always, False, callee=True)
                for arg in node.args:
                    walk(arg, always, False)
            else:
                for child in ast.iter_child_nodes(node):
                    walk(child, always, False)

        walk(tree, True, True)

    def _replace(self, tree: ast.AST, bound: dict[str, str], keep: str | None = None) -> ast.AST:
        class Put(ast.NodeTransformer):
            def visit(self, node: ast.AST) -> ast.AST:
                if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                    return node
                if isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
                    key = ast.dump(node)
                    if key != keep and key in bound:
                        return ast.copy_location(ast.Name(bound[key], ast.Load()), node)
                return super().visit(node)

        return Put().visit(tree)

    def rewrite(self, expr: str, bound: dict[str, str]) -> str:
        """One expression with the reads already bound replaced by their locals."""
        return ast.unparse(self._replace(ast.parse(expr, mode="eval").body, bound))

    def statements(self, checks: list[tuple[str, str]], bound: dict[str, str], indent: str) -> list[str]:
        """``if not (guard): return <fail>`` for each (guard, fail), cheaper; ``bound``
        (key -> local) holds the reads bound before and receives the ones bound here."""
        trees = [self._direct(ast.parse(expr, mode="eval").body) for expr, _ in checks]
        banned = {n.target.id for t in trees for n in ast.walk(t)
                  if isinstance(n, ast.NamedExpr) and isinstance(n.target, ast.Name)}
        counts: dict[str, int] = {}
        first_always: dict[str, int] = {}
        nodes: dict[str, ast.AST] = {}
        for position, tree in enumerate(trees):
            found: list[tuple[str, ast.AST, bool]] = []
            self._occurrences(tree, banned, found)
            for key, node, always in found:
                counts[key] = counts.get(key, 0) + 1
                nodes.setdefault(key, node)
                if always:
                    first_always.setdefault(key, position)
        binds: dict[int, list[str]] = {}
        for key, position in first_always.items():
            if counts[key] >= 2 and key not in bound:
                binds.setdefault(position, []).append(key)
        out = []
        for position, (tree, (_, fail)) in enumerate(zip(trees, checks, strict=True)):
            for key in sorted(binds.get(position, ()), key=len):  # a read's parts are shorter: bound first
                name = f"{self.prefix}v{self.counter}"
                self.counter += 1
                value = self._replace(copy.deepcopy(nodes[key]), bound, keep=key)
                out.append(f"{indent}{name} = {ast.unparse(value)}")
                bound[key] = name
            # parenthesized: a template is unparsed without the guard's own parentheses (``not a and b``)
            out.append(f"{indent}if not ({ast.unparse(self._replace(copy.deepcopy(tree), bound))}): return {fail}")
        return out


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


def _unshadowed(expr: str, params: set[str]) -> str:
    """``expr`` with each builtin it calls by name that a parameter of the frame shadows
    (``def forward(self, x, type=None)`` and a guard's ``type(...)``) read from
    ``___builtins`` instead: in parameter form the name would be the argument."""
    shadowed = params & _BUILTIN_NAMES
    if not shadowed or not any(name in expr for name in shadowed):
        return expr
    lines = expr.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    edits: list[int] = []
    previous = None
    for tok in tokenize.generate_tokens(io.StringIO(expr).readline):
        if tok.type == tokenize.NAME and tok.string in shadowed and not (
                previous is not None and previous.type == tokenize.OP and previous.string == "."):
            edits.append(starts[tok.start[0] - 1] + tok.start[1])
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            previous = tok
    for at in reversed(edits):
        expr = expr[:at] + "___builtins." + expr[at:]
    return expr


_BUILTIN_NAMES = frozenset(dir(builtins))


def builder_param(builder: GuardTable, expr: str) -> str:
    """L-form -> parameter form: ``L['x']`` is the parameter ``x``; a free variable
    is read from the closure cells the check is given."""
    expr = _unshadowed(expr, builder.params)

    def local(m: re.Match[str]) -> str:
        name = m.group(2)
        if name in builder.params:
            return name
        if name in builder.freevars:
            builder.uses_cells = True
            return f"___cells[{builder.freevars.index(name)}].cell_contents"
        raise Unsupported(f"guard reads frame local {name!r}")

    return LOCAL_RE.sub(local, expr)


def without_lines(code: types.CodeType) -> types.CodeType:
    """``code`` (and the functions it defines) with a line table that says "no location"
    for every instruction: the generated checks never report a location (a failure is
    described from its guard's text), and the full tables are ~30% of the marshalled checks
    every warm start reads, hashes and loads. (A valid table, one byte per 8 code units, not
    an empty one, on which Python 3.11's traceback formatting fails.)"""
    if sys.version_info[:2] != (3, 11):  # the table's format is version-specific: keep the compiler's
        return code
    consts = tuple(without_lines(c) if type(c) is types.CodeType else c for c in code.co_consts)
    units = len(code.co_code) // 2
    table = bytes(0x80 | (15 << 3) | (min(8, units - i) - 1) for i in range(0, units, 8))  # 15: no location
    return code.replace(co_linetable=table, co_consts=consts)


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
