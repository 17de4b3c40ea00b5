"""The parser behind :mod:`.inductor_env`: which config entries each ``TORCHINDUCTOR_*``
variable feeds, read from a config module's source with :mod:`ast` (never importing it).

Imported only in a process where a ``TORCHINDUCTOR_*`` variable outside
:mod:`.inductor_env`'s tables is set; a warm start without one never loads it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from .inductor_env import PREFIX


def _env_names(node: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith(PREFIX)
    }


def _called_names(node: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def _string_list(node: ast.AST | None) -> list[str]:
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def parse_config_source(source: str) -> tuple[dict[str, set[str]], list[str], list[str]]:
    """``({env var: config entries it feeds}, ignore prefixes, ignored entries)`` of one config module."""
    tree = ast.parse(source)
    helpers: dict[str, set[str]] = {}  # module-level function -> env vars it reads (with what it calls)
    calls: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            helpers[node.name] = _env_names(node)
            calls[node.name] = _called_names(node)
    for _ in range(3):  # helpers calling helpers
        for name, called in calls.items():
            for other in called & set(helpers):
                helpers[name] |= helpers[other]
    feeds: dict[str, set[str]] = {}
    ignore_prefix: list[str] = []
    ignored: list[str] = []

    def visit(body: Iterable[ast.stmt], prefix: str) -> None:
        nonlocal ignore_prefix, ignored
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
                continue
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target, value = node.targets[0].id, node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                target, value = node.target.id, node.value
            else:
                continue
            if not prefix and target == "_cache_config_ignore_prefix":
                ignore_prefix = _string_list(value)
            elif not prefix and target == "_save_config_ignore":
                ignored = _string_list(value)
            envs = _env_names(value)
            for called in _called_names(value) & set(helpers):
                envs |= helpers[called]
            for env in envs:
                feeds.setdefault(env, set()).add(prefix + target)

    visit(tree.body, "")
    return feeds, ignore_prefix, ignored
