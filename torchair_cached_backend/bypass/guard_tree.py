"""A frame's every-call checks (``guards="call"`` on the backend route) as one C++ guard tree.

Dynamo evaluates its own guards in C++ (``torch._C._dynamo.guards``: a root manager over
the frame's locals, accessor nodes that read an attribute or item once for every guard
below them, leaf guards that compare). Our checks are stored as Python expressions over
``L[...]`` (the frame's locals) and ``___G[...]`` (its globals); here each expression of a
kind with an exact C++ counterpart becomes a path of accessors plus a leaf, and everything
else (resolved-method checks, object aliasing, process state, symbolic shapes, kinds added
later) stays Python: one generated function over the same locals (``guard_codegen``'s
loop/shared-read rewriting, memoizing resolved-method sites), run as the tree's lambda guard.

Mapped, each as Python evaluates it (``P`` a path of ``L['x']``, ``___G['x']``, ``.attr``,
``[constant]``, ``type(...)``):

* ``P is <constant>`` -> ID_MATCH (identity, of a constant the checks keep alive);
* ``type(P) is int and P == 3`` (int, float, str, bool, not NaN) and ``___eq(P, c)`` (c of
  those types or a dtype, not NaN) -> TYPE_MATCH + EQUALS_MATCH (type, then ``is`` or ``==``);
* ``len(P) == n`` with ``P`` a dict or OrderedDict now (hook dicts, ``_modules``) -> TYPE_MATCH +
  DICT_LENGTH (``PyDict_Size``, what ``len`` returns for those two types; Dynamo's LENGTH_CHECK
  is ``PySequence_Length``, which errs on a mapping: other lengths stay Python);
* ``hasattr(P, 'a')`` -> a ``getattr`` node with nothing below (it fails iff ``getattr`` raises;
  ``hasattr`` is False or raises then). ``not hasattr`` stays Python: Dynamo's NO_HASATTR
  swallows every exception where ``hasattr`` only swallows AttributeError;
* ``[not] ___dict_has(P, 'k')`` with ``P`` an exact dict now -> TYPE_MATCH(dict) + DICT_CONTAINS
  (stricter only if that dict is later replaced by a dict subclass);
* the static tensor check (type, dtype, device, requires_grad, ``size()``, ``stride()``) ->
  TENSOR_MATCH, Dynamo's own check of the same properties (stricter: it also compares the
  dispatch key set, taken from this call's tensor, so a conjugate/negative-bit view or an
  inference tensor is another entry).

Stricter is safe: a failing tree only sends the call back to our frame callback, which
re-checks with the Python checks and installs the variant again. A ``torch`` whose C++
guard API lacks a piece, a value that cannot be read now, or anything else that goes wrong
while building: None, and the caller keeps the Python check.
"""

from __future__ import annotations

import ast
import collections
import itertools
import re
import types
from collections.abc import Callable
from typing import Any

from . import guard_runtime

_MISSING = object()
_DICTS = (dict, collections.OrderedDict)
_EQ_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
_counter = itertools.count()


class _NotMapped(Exception):
    """An expression with no exact C++ counterpart (it stays Python)."""


def _api() -> Any:
    """``torch._C._dynamo.guards`` with every piece used here, and Dynamo's manager enum; None if any is missing."""
    try:
        from torch._C._dynamo import guards as cg
        from torch._dynamo.guards import GuardManagerType, get_framelocals_idx
    except Exception:
        return None
    need = ("framelocals_manager", "globals_dict_manager", "dict_getitem_manager", "getattr_manager",
            "getitem_manager", "type_manager", "add_id_match_guard", "add_type_match_guard",
            "add_equals_match_guard", "add_length_check_guard", "add_dict_contains_guard",
            "add_tensor_match_guard", "add_lambda_guard", "check")
    root_cls = getattr(cg, "RootGuardManager", None)
    if root_cls is None or not all(hasattr(root_cls, n) for n in need):
        return None
    return cg, GuardManagerType.GUARD_MANAGER, get_framelocals_idx


class _Tree:
    """Managers by path (a tuple of steps), each made once with the value it reads now."""

    def __init__(self, api: Any, code: types.CodeType, local: dict[str, Any], scope: Any) -> None:
        self.cg, self.enum, self.idx = api
        self.root = self.cg.RootGuardManager()
        self.code = code
        self.local = local
        self.scope = scope
        self.nodes: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self.keep: list[Any] = []  # what ID_MATCH compares with: alive while the tree is
        self.private: dict[str, Any] = {}
        self.ids: set[tuple[Any, ...]] = set()

    def pin(self, obj: Any) -> tuple[Any, ...]:
        """The path of a fixed object (held in a private dict the tree reads as its globals)."""
        name = f"obj{id(obj)}"
        self.private[name] = obj
        return (("private", name),)

    def node(self, path: tuple[Any, ...]) -> tuple[Any, Any]:
        """(manager, value now) of ``path``; raises when the value cannot be read now."""
        hit = self.nodes.get(path)
        if hit is not None:
            return hit
        step, source = path[-1], repr(path)
        if len(path) == 1:
            kind, name = step
            if kind == "local":
                if name not in self.local or name not in self.code.co_varnames + self.code.co_cellvars + \
                        self.code.co_freevars:
                    raise _NotMapped(name)
                value = self.local[name]
                manager = self.root.framelocals_manager(key=(name, self.idx(self.code, name)), source=source,
                                                        example_value=value, guard_manager_enum=self.enum)
            elif kind == "global":
                if type(self.scope) is not dict:
                    raise _NotMapped("globals")
                value = self.scope[name]  # exact dict: PyDict_GetItem is what ``___G[name]`` does
                g = self.root.globals_dict_manager(f_globals=self.scope, source="G", example_value=self.scope,
                                                   guard_manager_enum=self.enum)
                manager = g.dict_getitem_manager(key=name, source=source, example_value=value,
                                                 guard_manager_enum=self.enum)
            elif kind == "private":
                value = self.private[name]
                g = self.root.globals_dict_manager(f_globals=self.private, source="P", example_value=self.private,
                                                   guard_manager_enum=self.enum)
                manager = g.dict_getitem_manager(key=name, source=source, example_value=value,
                                                 guard_manager_enum=self.enum)
            else:
                raise _NotMapped(kind)
        else:
            parent, parent_value = self.node(path[:-1])
            kind = step[0]
            if kind == "attr":
                value = getattr(parent_value, step[1])
                manager = parent.getattr_manager(attr=step[1], source=source, example_value=value,
                                                 guard_manager_enum=self.enum)
            elif kind == "item":
                value = parent_value[step[1]]
                manager = parent.getitem_manager(key=step[1], source=source, example_value=value,
                                                 guard_manager_enum=self.enum)
            elif kind == "type":
                value = type(parent_value)
                manager = parent.type_manager(source=source, example_value=value, guard_manager_enum=self.enum)
            elif kind == "typedict":  # the class's own dict (what its ``__dict__`` proxy shows)
                value = parent_value.__dict__
                manager = parent.type_dict_manager(source=source, example_value=None, guard_manager_enum=self.enum)
            elif kind == "dictitem":  # of an exact dict (a class's, a function's keyword defaults)
                value = parent_value[step[1]]
                manager = parent.dict_getitem_manager(key=step[1], source=source, example_value=value,
                                                      guard_manager_enum=self.enum)
            else:
                raise _NotMapped(kind)
        self.nodes[path] = (manager, value)
        return manager, value


def _path(node: ast.AST) -> tuple[Any, ...]:
    """The accessor steps of an expression that only reads (raises _NotMapped otherwise)."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        key = node.slice.value
        if isinstance(node.value, ast.Name) and type(key) is str:
            if node.value.id == "L":
                return (("local", key),)
            if node.value.id == "___G":
                return (("global", key),)
            raise _NotMapped(node.value.id)
        if type(key) in (str, int):
            return _path(node.value) + (("item", key),)
    elif isinstance(node, ast.Attribute):
        return _path(node.value) + (("attr", node.attr),)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type"
          and len(node.args) == 1 and not node.keywords):
        return _path(node.args[0]) + (("type",),)
    elif (_is_call(node, "dict", 1) and isinstance(node.args[0], ast.Attribute)
          and node.args[0].attr == "__dict__"):
        # ``dict(K.__dict__)``: a copy of a class's own dict, read as that dict (same items), where
        # ``K`` is a class by construction (``type(...)``, an item of an ``__mro__``)
        owner = _path(node.args[0].value)
        if owner[-1] == ("type",) or (len(owner) > 1 and owner[-2] == ("attr", "__mro__")
                                      and owner[-1][0] == "item" and type(owner[-1][1]) is int):
            return owner + (("typedict",),)
    raise _NotMapped(ast.dump(node)[:40])


#: False: every check parsed (tests compare the two)
FAST_FORMS = True
_KEY = r"'[^'\\\n]*'"
_PATH = rf"(?:L|___G)\[{_KEY}\](?:\.[A-Za-z_][A-Za-z0-9_]*|\[{_KEY}\]|\[[0-9]+\])*"
_CONST = r"___c[0-9]+"
_FAST_RE = re.compile("|".join(f"(?P<{kind}>{form})" for kind, form in zip(("id", "type", "has", "len", "dh", "site"), (
    rf"\((?P<id_p>{_PATH}) is (?P<id_v>{_CONST}|None|True|False)\)",
    rf"\(type\((?P<type_p>{_PATH})\) is (?P<type_v>{_CONST})\)",
    rf"\(hasattr\((?P<has_p>{_PATH}), '(?P<has_a>[A-Za-z_][A-Za-z0-9_]*)'\)\)",
    rf"\(len\((?P<len_p>{_PATH})\) == (?P<len_n>[0-9]+)\)",
    rf"\((?P<dh_not>not )?___dict_has\((?P<dh_p>{_PATH}), '(?P<dh_k>[^'\\\n]*)'\)\)",
    rf"\(___fn_digest\(___resolved\((?P<site_p>{_CONST}), '(?P<site_n>[A-Za-z_][A-Za-z0-9_]*)'\)\) == "
    rf"'(?P<site_d>[0-9a-f:]+)'\)",
), strict=True)))
_ROOT_RE = re.compile(rf"(L|___G)\[({_KEY})\]")
_STEP_RE = re.compile(rf"\.([A-Za-z_][A-Za-z0-9_]*)|\[({_KEY})\]|\[([0-9]+)\]")


def _fast_path(text: str) -> tuple[Any, ...]:
    """The steps of a path the fast forms matched (the same steps :func:`_path` reads off its parse)."""
    m = _ROOT_RE.match(text)
    root: tuple[Any, ...] = (("local" if m.group(1) == "L" else "global", m.group(2)[1:-1]),)  # type: ignore[union-attr]
    steps = [("attr", a) if a else ("item", k[1:-1]) if k else ("item", int(n))
             for a, k, n in _STEP_RE.findall(text, m.end())]  # type: ignore[union-attr]
    return root + tuple(steps)


_parse_memo: dict[str, ast.AST] = {}


def _parsed(expr: str) -> ast.AST:
    """The expression's tree (never modified here), parsed once per process: a program's
    variants and frames share most of their checks."""
    node = _parse_memo.get(expr)
    if node is None:
        if len(_parse_memo) > 50_000:
            _parse_memo.clear()
        node = _parse_memo[expr] = ast.parse(expr, mode="eval").body
    return node


def _const(node: ast.AST, namespace: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id.startswith("___c") and node.id[4:].isdigit():
        return namespace[node.id]
    raise _NotMapped("not a constant")


def _is_call(node: ast.AST, name: str, n: int) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
            and len(node.args) == n and not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args))


def _equals_ok(value: Any) -> bool:
    """Types whose ``==`` with an equal-typed value is the identity-then-compare EQUALS_MATCH does."""
    import torch

    return type(value) in (int, float, str, bool, torch.dtype) and value == value


class _Mapper:
    def __init__(self, tree: _Tree, namespace: dict[str, Any]) -> None:
        self.tree = tree
        self.ns = namespace

    def map(self, expr: str) -> None:
        """Add the guard ``expr`` to the tree, or raise _NotMapped."""
        verbose = [expr]
        if FAST_FORMS and self._fast(expr, verbose):
            return
        node = _parsed(expr)
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            if self._tensor(node, verbose) or self._typed_equals(node, verbose):
                return
            raise _NotMapped("and")
        if (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)
                and isinstance(node.comparators[0], ast.Constant) and type(node.comparators[0].value) is str):
            left, digest = node.left, node.comparators[0].value
            if _is_call(left, "___fn_digest", 1) and _is_call(left.args[0], "___resolved", 2):
                self._resolved(_const(left.args[0].args[0], self.ns), _const(left.args[0].args[1], self.ns), digest)
                return
            if _is_call(left, "___code_fp", 1):
                self._code(_path(left.args[0]), digest, verbose)
                return
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            op, left, right = node.ops[0], node.left, node.comparators[0]
            if isinstance(op, ast.Is):
                value = _const(right, self.ns)
                if _is_call(left, "type", 1) and isinstance(value, type):
                    manager, _ = self.tree.node(_path(left.args[0]))
                    self._type(manager, value, verbose)
                    return
                manager, _ = self.tree.node(_path(left))
                self._id(manager, value, verbose)
                return
            if isinstance(op, ast.Eq) and _is_call(left, "len", 1):
                n = _const(right, self.ns)
                if type(n) is not int:
                    raise _NotMapped("len")
                manager, value = self.tree.node(_path(left.args[0]))
                kind = type(value)
                if kind not in _DICTS:  # LENGTH_CHECK is PySequence_Length (and errs on a mapping)
                    raise _NotMapped("len of a non-dict")
                self._type(manager, kind, verbose)
                manager.add_dict_length_check_guard(n, verbose, None)  # PyDict_Size: len() of these types
                return
            raise _NotMapped("compare")
        if _is_call(node, "___eq", 2):
            value = _const(node.args[1], self.ns)
            if not _equals_ok(value):
                raise _NotMapped("eq")
            self._equals(_path(node.args[0]), value, verbose)
            return
        if _is_call(node, "hasattr", 2):
            attr = _const(node.args[1], self.ns)
            if type(attr) is not str:
                raise _NotMapped("hasattr")
            self.tree.node(_path(node.args[0]) + (("attr", attr),))
            return
        negated = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)
        inner = node.operand if negated else node
        if (isinstance(inner, ast.Compare) and len(inner.ops) == 1 and isinstance(inner.ops[0], ast.In)
                and isinstance(inner.left, ast.Constant) and type(inner.left.value) is str):
            self._contains(_path(inner.comparators[0]), inner.left.value, not negated, verbose)
            return
        if _is_call(inner, "___dict_contains", 2) or _is_call(inner, "___dict_has", 2):
            key_node, dict_node = inner.args if inner.func.id == "___dict_contains" else inner.args[::-1]
            key = _const(key_node, self.ns)
            if type(key) is not str:
                raise _NotMapped("dict key")
            self._contains(_path(dict_node), key, not negated, verbose)
            return
        raise _NotMapped("kind")

    def _contains(self, path: tuple[Any, ...], key: str, contains: bool, verbose: list[str]) -> None:
        """``key in P`` / ``dict.__contains__(P, key)`` for an exact dict ``P`` (a str key: no
        hashing error): TYPE_MATCH(dict) + DICT_CONTAINS, both must hold (DICT_CONTAINS alone
        says nothing useful of a non-dict)."""
        manager, value = self.tree.node(path)
        if type(value) is not dict:
            raise _NotMapped("not a dict")
        self._type(manager, dict, verbose)
        manager.add_dict_contains_guard(contains, key, verbose, None)

    def _fast(self, expr: str, verbose: list[str]) -> bool:
        """The commonest forms read without a parse (most of a start's build time): each regex
        admits only text whose parse is the form :meth:`map` maps the same way (a path of
        ``L['k']`` / ``___G['k']``, ``.name``, ``['k']``, ``[n]`` with keys free of quotes and
        backslashes); anything else, False (then parsed)."""
        m = _FAST_RE.fullmatch(expr)
        if m is None:
            return False
        kind = m.lastgroup
        if kind == "site":
            self._resolved(self.ns[m.group("site_p")], m.group("site_n"), m.group("site_d"))
            return True
        path = _fast_path(m.group(kind + "_p"))
        if kind == "id":
            token = m.group("id_v")
            value = {"None": None, "True": True, "False": False}[token] if token in ("None", "True", "False") \
                else self.ns[token]
            self._id(self.tree.node(path)[0], value, verbose)
        elif kind == "type":
            value = self.ns[m.group("type_v")]
            if not isinstance(value, type):
                return False
            self._type(self.tree.node(path)[0], value, verbose)
        elif kind == "has":
            self.tree.node(path + (("attr", m.group("has_a")),))
        elif kind == "len":
            manager, value = self.tree.node(path)
            if type(value) not in _DICTS:
                raise _NotMapped("len of a non-dict")
            self._type(manager, type(value), verbose)
            manager.add_dict_length_check_guard(int(m.group("len_n")), verbose, None)
        elif kind == "dh":
            self._contains(path, m.group("dh_k"), m.group("dh_not") is None, verbose)
        else:
            return False
        return True

    def _code(self, path: tuple[Any, ...], digest: str, verbose: list[str]) -> None:
        """``___code_fp(P) == digest``: the fingerprint is a function of the (immutable) code
        object, so while ``P`` is this call's code object it holds (another object, even an
        equal one, fails: stricter)."""
        manager, value = self.tree.node(path)
        if type(value) is not types.CodeType or guard_runtime._code_fp(value) != digest:
            raise _NotMapped("code")
        self._id(manager, value, verbose)

    def _resolved(self, owner: Any, name: Any, digest: str) -> None:
        """``___fn_digest(___resolved(owner, name)) == digest`` as the identities its memo
        (``guard_runtime.ResolvedSite``) re-validates on every call, all of them: ``owner.__mro__``,
        each class before the defining one still without ``name`` (its dict), the defining
        class's entry, and the function's bound state (``_bound_snapshot``: code, defaults,
        keyword defaults and their items, cell contents, recursively). The digest is taken
        now; where the memo would not engage (state not pinned by identities) it stays Python."""
        if not isinstance(owner, type) or type(name) is not str or not hasattr(self.tree.root, "type_dict_manager"):
            raise _NotMapped("resolved")
        mro = owner.__mro__
        before = []
        for klass in mro:
            raw = klass.__dict__.get(name, _MISSING)
            if raw is not _MISSING:
                break
            before.append(klass)
        else:
            raise _NotMapped("unresolved")
        if type(raw) not in (types.FunctionType, staticmethod, classmethod, property):
            raise _NotMapped("attribute kind")  # what unwraps it is fixed by the raw object's identity
        fn = guard_runtime.unwrap_attribute(raw)
        got, nodes = guard_runtime._fn_digest_and_state(fn)
        if got != digest or nodes is None:
            raise _NotMapped("digest")
        verbose = [f"what {owner.__qualname__}.{name} resolves to is unchanged"]
        tree = self.tree
        manager, _ = tree.node(tree.pin(owner) + (("attr", "__mro__"),))
        self._id(manager, mro, verbose)
        defining = klass
        for earlier in before:
            manager, _ = tree.node(tree.pin(earlier) + (("typedict",),))
            if (id(manager), name) not in tree.ids:
                tree.ids.add((id(manager), name))
                manager.add_dict_contains_guard(False, name, verbose, None)
        manager, _ = tree.node(tree.pin(defining) + (("typedict",), ("dictitem", name)))
        self._id(manager, raw, verbose)
        for fn_, code, defaults, kwdefaults, items, cells, contents in nodes:
            base = tree.pin(fn_)
            for attr, value in (("__code__", code), ("__defaults__", defaults), ("__kwdefaults__", kwdefaults)):
                self._id(tree.node(base + (("attr", attr),))[0], value, verbose)
            if items is not None:
                manager, _ = tree.node(base + (("attr", "__kwdefaults__"),))
                manager.add_dict_length_check_guard(len(items), verbose, None)
                for key, value in items:
                    self._id(tree.node(base + (("attr", "__kwdefaults__"), ("dictitem", key)))[0], value, verbose)
            for cell, content in zip(cells, contents, strict=True):
                self._id(tree.node(tree.pin(cell) + (("attr", "cell_contents"),))[0], content, verbose)

    def _type(self, manager: Any, cls: type, verbose: list[str]) -> None:
        key = (id(manager), "type", id(cls))
        if key in self.tree.ids:
            return
        self.tree.ids.add(key)
        self.tree.keep.append(cls)
        manager.add_type_match_guard(id(cls), verbose, None)

    def _id(self, manager: Any, value: Any, verbose: list[str]) -> None:
        key = (id(manager), id(value))
        if key in self.tree.ids:
            return
        self.tree.ids.add(key)
        self.tree.keep.append(value)
        manager.add_id_match_guard(id(value), verbose, None)

    def _equals(self, path: tuple[Any, ...], value: Any, verbose: list[str]) -> None:
        manager, _ = self.tree.node(path)
        self.tree.keep.append(value)
        self._type(manager, type(value), verbose)
        manager.add_equals_match_guard(value, verbose, None)

    def _typed_equals(self, node: ast.BoolOp, verbose: list[str]) -> bool:
        """``type(P) is int and P == 3``."""
        if len(node.values) != 2:
            return False
        first, second = node.values
        if not (isinstance(first, ast.Compare) and len(first.ops) == 1 and isinstance(first.ops[0], ast.Is)
                and _is_call(first.left, "type", 1) and isinstance(first.comparators[0], ast.Name)
                and first.comparators[0].id in _EQ_TYPES and first.comparators[0].id not in self.ns
                and isinstance(second, ast.Compare) and len(second.ops) == 1 and isinstance(second.ops[0], ast.Eq)):
            return False
        path = _path(first.left.args[0])
        if _path(second.left) != path:
            return False
        value = _const(second.comparators[0], self.ns)
        if type(value) is not _EQ_TYPES[first.comparators[0].id] or not _equals_ok(value):
            return False
        self._equals(path, value, verbose)
        return True

    def _tensor(self, node: ast.BoolOp, verbose: list[str]) -> bool:
        """The static tensor check of ``guard_capture`` (all six parts, in that order)."""
        import torch

        parts = node.values
        if len(parts) != 6:
            return False
        head = parts[0]
        if not (isinstance(head, ast.Compare) and len(head.ops) == 1 and isinstance(head.ops[0], ast.Is)
                and _is_call(head.left, "type", 1)):
            return False
        target = head.left.args[0]
        if isinstance(target, ast.NamedExpr):
            if not (isinstance(target.target, ast.Name) and target.target.id == "___t"):
                return False
            ref: Any = ("name", "___t")
            path = _path(target.value)
        else:
            path = _path(target)
            ref = ("path", path)

        def is_ref(n: ast.AST) -> bool:
            if ref[0] == "name":
                return isinstance(n, ast.Name) and n.id == "___t"
            try:
                return _path(n) == ref[1]
            except _NotMapped:
                return False

        def attr_cmp(n: ast.AST, attr: str, op: type) -> Any:
            if not (isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], op)
                    and isinstance(n.left, ast.Attribute) and n.left.attr == attr and is_ref(n.left.value)):
                raise _NotMapped(attr)
            return _const(n.comparators[0], self.ns)

        def method_cmp(n: ast.AST, name: str) -> Any:
            call = n.left if isinstance(n, ast.Compare) else None
            if not (isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], ast.Eq)
                    and isinstance(call, ast.Call) and not call.args and not call.keywords
                    and isinstance(call.func, ast.Attribute) and call.func.attr == name and is_ref(call.func.value)
                    and isinstance(n.comparators[0], ast.Tuple)):
                raise _NotMapped(name)
            value = ast.literal_eval(n.comparators[0])
            if type(value) is not tuple:
                raise _NotMapped(name)
            return value

        pytype = _const(head.comparators[0], self.ns)
        dtype = attr_cmp(parts[1], "dtype", ast.Is)
        device = attr_cmp(parts[2], "device", ast.Eq)
        grad = attr_cmp(parts[3], "requires_grad", ast.Is)
        size = method_cmp(parts[4], "size")
        stride = method_cmp(parts[5], "stride")
        manager, value = self.tree.node(path)
        if not (type(value) is pytype and pytype in (torch.Tensor, torch.nn.Parameter)
                and value.dtype is dtype and value.device == device and value.requires_grad is grad
                and type(grad) is bool and value.size() == size and value.stride() == stride
                and value.layout == torch.strided and all(type(d) is int for d in size + stride)):
            raise _NotMapped("tensor")
        manager.add_tensor_match_guard(value, list(size), list(stride), repr(path), verbose, None, pytype,
                                       torch._C._dispatch_keys(value))
        return True


class GuardTree:
    """A built tree: ``root`` (a RootGuardManager), what its identity checks compare with
    (``keep``: hold it as long as the root), and how many recorded checks are C++ / Python."""

    __slots__ = ("root", "keep", "mapped", "python")

    def __init__(self, root: Any, keep: list[Any], mapped: int, python: int) -> None:
        self.root, self.keep, self.mapped, self.python = root, keep, mapped, python


def _residual(rest: list[tuple[int, str]], namespace: dict[str, Any],
              code: types.CodeType) -> Callable[[dict[str, Any]], bool]:
    """The checks left in Python as one function over the frame's locals, in their recorded
    order, each as written (a resolved-method check through a memoizing
    :class:`~.guard_runtime.ResolvedSite`, as the generated full check runs it)."""
    prefix = f"___tcb_t{next(_counter)}_"
    lines = [f"def {prefix}check(L):"]
    for n, (_, expr) in enumerate(rest):
        site = _site_call(expr)
        if site is not None:
            name, digest, owner = site
            namespace[f"{prefix}s{n}"] = guard_runtime.ResolvedSite(name, digest).holds
            expr = f"{prefix}s{n}({owner})"
        lines.append(f"    if not ({expr}): return False")
    lines.append("    return True")
    exec(compile("\n".join(lines) + "\n", f"<npu_cached guard tree rest {code.co_name}>", "exec"), namespace)  # noqa: S102 - our own checksummed checks
    return namespace[f"{prefix}check"]


def _site_call(expr: str) -> tuple[str, str, str] | None:
    """(name, digest, owner source) of a ``___fn_digest(___resolved(owner, name)) == digest`` check."""
    if "___resolved(" not in expr:
        return None
    node = _parsed(expr)
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)
            and isinstance(node.comparators[0], ast.Constant) and type(node.comparators[0].value) is str
            and _is_call(node.left, "___fn_digest", 1) and _is_call(node.left.args[0], "___resolved", 2)):
        return None
    owner, name = node.left.args[0].args
    if not (isinstance(name, ast.Constant) and type(name.value) is str):
        return None
    return name.value, node.comparators[0].value, ast.unparse(owner)


def build_tree(checks: Any, code: types.CodeType, local: dict[str, Any],
               frees: tuple[tuple[str, Any], ...], hooks: tuple[Any, ...]) -> GuardTree | None:
    """A RootGuardManager that accepts exactly when the entry's Python guard does (see the
    module docstring), built from this call's frame ``local`` (which the Python checks
    accept); None where that cannot be done here."""
    api = _api()
    if api is None:
        return None
    try:
        return _build(api, checks, code, local, frees, hooks)
    except Exception:
        return None


def _build(api: Any, checks: Any, code: types.CodeType, local: dict[str, Any],
           frees: tuple[tuple[str, Any], ...], hooks: tuple[Any, ...]) -> GuardTree | None:
    namespace = checks.namespace
    tree = _Tree(api, code, local, namespace.get("___G"))
    # what the entry's Python guard checks before the recorded checks: global module hooks
    # (the dicts themselves, as captured), then the function's free variables by identity
    for i, hook_dict in enumerate(hooks):
        tree.private[f"hooks{i}"] = hook_dict
        manager, _ = tree.node((("private", f"hooks{i}"),))
        manager.add_dict_length_check_guard(0, [f"no global module hooks (dict {i} of {len(hooks)})"], None)
    for name, value in frees:
        manager, _ = tree.node((("local", name),))
        tree.keep.append(value)
        manager.add_id_match_guard(id(value), [f"free variable {name} is the function's"], None)
    mapper = _Mapper(tree, namespace)
    rest: list[tuple[int, str]] = []
    mapped = 0
    for index, meta in enumerate(checks.meta):
        expr = meta["expr"]
        try:
            mapper.map(expr)
            mapped += 1
        except (_NotMapped, SyntaxError, KeyError, LookupError, AttributeError, TypeError, ValueError):
            rest.append((index, expr))
    if rest:
        residual = _residual(rest, namespace, code)

        def rest_check(L: dict[str, Any]) -> bool:
            try:
                return bool(residual(L))
            except Exception:
                return False

        tree.keep.append(rest_check)
        tree.root.add_lambda_guard(rest_check, [f"npu_cached: {len(rest)} checks of {code.co_qualname} in Python"],
                                   None)
    if not tree.root.check(local):  # the call these values came from must pass
        return None
    tree.keep += [tree.private, tree.scope, namespace]  # what the tree reads as globals, and the constants
    tree.keep.append(("tcb_counts", mapped, len(rest)))  # (read by benchmarks/per_call.py)
    return GuardTree(tree.root, tree.keep, mapped, len(rest))
