"""The graph-break stand-ins a replay calls in place of Dynamo's resume functions.

``ResumeDispatch`` / ``ResumeFactory`` run the first transformed variant of the code
after a graph break whose guards hold (else compile it with Dynamo, else run the
original continuation eagerly); ``ResumeRouter`` routes by receiver when several
instances share one resume global. Only programs with graph breaks import this
module (``loader_resume`` builds these); ``replay`` re-exports the classes.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

from ..logs import log, warn_once
from ..stats import record_fallback


class ResumeDispatch:
    """Stands in for a resume function: the first transformed variant whose guards
    hold, else the original continuation compiled by Dynamo (``compile``: a counted
    fallback, and the program gains the variant), else run eagerly (correct, counted)."""

    __slots__ = ("variants", "eager", "name", "compile", "compiled", "__weakref__")

    def __init__(self, variants: list[tuple[Callable[..., bool], types.CodeType]], eager: types.CodeType,
                 scope: dict[str, Any], name: str, compile: Callable[[Any], Callable[..., Any]] | None = None) -> None:
        self.variants = [(check, types.FunctionType(code, scope, name)) for check, code in variants]
        self.eager = types.FunctionType(eager, scope, name)
        self.name = name
        self.compile = compile
        self.compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for check, fn in self.variants:
            try:
                ok = check(*args, **kwargs)
            except Exception:
                ok = False
            if ok:
                return fn(*args, **kwargs)
        if self.compile is not None:
            if self.compiled is None:
                self.compiled = self.compile(self.eager)
            return self.compiled(*args, **kwargs)
        _eager_resume(self.name)
        return self.eager(*args, **kwargs)


class ResumeFactory:
    """Stands in for the factory Dynamo installs for resume functions with free
    variables: given the cells, the dispatch over variants built with them."""

    __slots__ = ("variants", "eager", "scope", "name", "compile")

    def __init__(self, variants: list[tuple[Callable[..., bool], types.CodeType]], eager: types.CodeType,
                 scope: dict[str, Any], name: str, compile: Callable[[Any], Callable[..., Any]] | None = None) -> None:
        self.variants = variants
        self.eager = eager
        self.scope = scope
        self.name = name
        self.compile = compile

    def __call__(self, cells: tuple[Any, ...]) -> Callable[..., Any]:
        scope, name = self.scope, self.name

        def resume(*args: Any, **kwargs: Any) -> Any:
            for check, code in self.variants:
                try:
                    ok = check(*args, ___cells=cells, **kwargs)
                except Exception:
                    ok = False
                if ok:
                    return types.FunctionType(code, scope, name, None, cells)(*args, **kwargs)
            eager = types.FunctionType(self.eager, scope, name, None, cells)
            if self.compile is not None:
                return self.compile(eager)(*args, **kwargs)
            _eager_resume(name)
            return eager(*args, **kwargs)

        return resume


_compiled_counted: set[str] = set()
#: continuations run as Python because Dynamo compiled nothing in them at cold (not fallbacks)
counts = {"as_python": 0}


def as_python(name: str) -> Callable[[Any], Callable[..., Any]]:
    """The "compile" of a continuation in which Dynamo compiled nothing at cold: the
    continuation itself, run as Python (as Dynamo ran it), counted in ``counts``."""

    def run_as_python(fn: Any) -> Any:
        counts["as_python"] += 1
        if name not in _python_logged:
            _python_logged.add(name)
            log.info("npu_cached: the code after a graph break (%s) runs as Python, as Dynamo ran it at cold "
                     "(it compiled nothing in it)", name)
        return fn

    return run_as_python


_python_logged: set[str] = set()


def note_compiled_resume(name: str) -> None:
    """A continuation no cached variant fits is compiled by Dynamo: a counted fallback, warned once."""
    if name not in _compiled_counted:
        _compiled_counted.add(name)
        record_fallback("code after a graph break compiled (no cached variant fits)")
        log.warning("npu_cached: no cached variant of the code after a graph break (%s) fits (a value it reads "
                    "changed); compiling it with Dynamo (the cache gains this variant)", name)


class ResumeRouter:
    """Stands in for a resume function whose variants check the receiver, when several
    instances of one class are replayed (one module global, e.g. the layers of a model
    each with its own ``cache_compile``): each call goes to the dispatch built for the
    instance it receives (argument ``index``); an instance no replay was built for runs
    the original continuation eagerly (a counted fallback)."""

    __slots__ = ("index", "factory", "routes", "eager", "scope", "name")

    def __init__(self, index: int, factory: bool, eager: types.CodeType, scope: dict[str, Any], name: str) -> None:
        self.index = index
        self.factory = factory
        self.routes: dict[int, tuple[Any, Any]] = {}
        self.eager = eager
        self.scope = scope
        self.name = name

    def add(self, receiver: Any, target: Any) -> None:
        self.routes[id(receiver)] = (weakref.ref(receiver), target)

    def _route(self, args: tuple[Any, ...]) -> Any:
        if len(args) > self.index:
            route = self.routes.get(id(args[self.index]))
            if route is not None and route[0]() is args[self.index]:
                return route[1]
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.factory:  # called with the cells; returns the resume function
            cells = args[0]

            def resume(*a: Any, **k: Any) -> Any:
                target = self._route(a)
                if target is None:
                    _eager_resume(self.name)
                    return types.FunctionType(self.eager, self.scope, self.name, None, cells)(*a, **k)
                return target(cells)(*a, **k)

            return resume
        target = self._route(args)
        if target is None:
            _eager_resume(self.name)
            return types.FunctionType(self.eager, self.scope, self.name)(*args, **kwargs)
        return target(*args, **kwargs)


_eager_counted: set[str] = set()


def _eager_resume(name: str) -> None:
    if name not in _eager_counted:
        _eager_counted.add(name)
        record_fallback("code after a graph break runs eagerly (no cached variant fits)")
    warn_once(f"eager-resume:{name}", "npu_cached: no cached variant of the code after a graph break (%s) fits; "
              "it runs eagerly (correct, not compiled; counted in stats().fallbacks)", name)
