"""``TCB_PROFILE=1``: where a warm start spends its time, one stderr line per load.

Off (the default) this module is never imported and nothing on the warm path is
wrapped: zero cost. On, :func:`install` (called at package import) times the import
of each of our modules (imported when the code needs it, as without profiling) and
wraps the few functions a load goes through with timers once their module is in;
each ``load()``/``cache_compile`` load prints, after the replay's first call::

    tcb profile: load LlamaForCausalLM.forward: 6.10 ms = imports 1.20 (9 modules) + read 0.10 + verify 0.19
    + decode 1.40 + checks 0.50 + guards 1.52 (619 checks) + graphs 0.30 + other 0.89
    | first call 2.90 ms (check 0.02, run 2.88) | imported before the load: 2.10 ms (14 modules)

A warm ``torch.compile(model, backend="npu_cached")`` prints the same phases for the
program its frame callback builds, then the check that installs a variant into Dynamo's
frame cache (Dynamo then runs the replayed code itself: its first run is not timed)::

    tcb profile: backend route load LlamaForCausalLM.forward: 4.80 ms = imports 0.00 + ...
    | install check 2.10 ms (then Dynamo runs the replayed code)

(or ``(not installed: no variant's checks hold (2.10 ms), Dynamo traces the frame)``).

Phases are exclusive (an inner phase's time is not counted in the outer one), so they
add up to the load's total: ``imports`` our modules imported during the load (finding,
reading and unmarshalling their code, running their bodies; always shown), ``read`` the entry files, ``verify`` their sha256,
``decode`` manifests, bytecode and guard constants, ``checks`` build the guard
functions, ``guards`` evaluate load-time guards (with how many checks the generated
functions hold: a check repeated per layer is one check in a loop), ``graphs`` load the compiled graphs
(the compiler's own part), ``callees`` nested loads of methods replayed on their own,
``other`` the rest. Our modules imported since the previous line but before the load
began (``tcb.load`` itself imports the loader) are named apart. A replay never called
reports at exit.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .preload import on_thread

ENV = "TCB_PROFILE"
PHASES = ("imports", "read", "verify", "decode", "checks", "guards", "graphs", "callees")
PACKAGE = __name__.rpartition(".")[0]

_local = threading.local()
_pending: list[_Load] = []
#: [seconds, modules] of our imports outside any load, not yet reported
_outside = [0.0, 0]
#: [seconds, modules] of our imports on the background thread (``preload``), not yet reported
_background = [0.0, 0]


def enabled() -> bool:
    return os.environ.get(ENV, "").strip() not in ("", "0")


class _Load:
    """The timings of one load, reported once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.phases: dict[str, float] = {}
        self.total = 0.0
        self.outcome = ""
        self.first_check: float | None = None
        self.first_run: float | None = None
        self.reported = False
        self.checks = 0  # checks the load-time functions hold (a looped per-layer check counts once)
        self.modules = 0  # our modules imported during the load
        self.before = (0.0, 0)  # (seconds, modules) of our imports since the last line, before this load
        self.background = (0.0, 0)  # the same, imported by the background thread (not paid by the caller)
        self.route = False  # the backend route's load: Dynamo runs the installed code (no first run timed)
        self.built_at = 0.0  # when a route load's build returned: its install check starts there

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def line(self) -> str:
        ms = 1e3
        shown = [p for p in PHASES if p in self.phases or p != "callees"]
        parts = [f"{p} {self.phases.get(p, 0.0) * ms:.2f}" for p in shown]
        if self.checks:
            parts[shown.index("guards")] += f" ({self.checks} checks)"
        if self.modules:
            parts[shown.index("imports")] += f" ({self.modules} modules)"
        other = self.total - sum(self.phases.values())
        parts.append(f"other {max(other, 0.0) * ms:.2f}")
        kind = "backend route load" if self.route else "load"
        text = f"tcb profile: {kind} {self.name}: {self.total * ms:.2f} ms = " + " + ".join(parts)
        if self.outcome:
            text += f" ({self.outcome})"
        if self.route and not self.outcome:
            check = "-" if self.first_check is None else f"{self.first_check * ms:.2f} ms"
            text += f" | install check {check} (then Dynamo runs the replayed code)"
        elif self.first_run is not None:
            check = self.first_check or 0.0
            text += (f" | first call {(check + self.first_run) * ms:.2f} ms "
                     f"(check {check * ms:.2f}, run {self.first_run * ms:.2f})")
        elif not self.outcome:
            text += " | first call - (not replayed)"
        if self.before[1]:
            text += f" | imported before the load: {self.before[0] * ms:.2f} ms ({self.before[1]} modules)"
        if self.background[1]:
            text += (f" | imported in the background: {self.background[0] * ms:.2f} ms "
                     f"({self.background[1]} modules)")
        return text

    def report(self) -> None:
        if self.reported:
            return
        self.reported = True
        print(self.line(), file=sys.stderr, flush=True)


def _loads() -> list[_Load]:
    loads = getattr(_local, "loads", None)
    if loads is None:
        loads = _local.loads = []
    return loads


def _timers() -> list[float]:
    timers = getattr(_local, "timers", None)
    if timers is None:
        timers = _local.timers = []
    return timers


def _exclusive(call: Callable[[], Any], record: Callable[[float], None], started: float | None = None) -> Any:
    """``call()``, its time (since ``started``, default now) less the phases nested in it
    given to ``record`` (and the whole of it counted as nested in the phase around it)."""
    timers = _timers()
    timers.append(0.0)
    t0 = time.perf_counter() if started is None else started
    try:
        return call()
    finally:
        elapsed = time.perf_counter() - t0
        inner = timers.pop()
        if timers:
            timers[-1] += elapsed
        record(elapsed - inner)


def timed(phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` timed as ``phase`` of the innermost load (exclusive of inner phases)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        loads = _loads()
        if not loads:
            return fn(*args, **kwargs)
        return _exclusive(lambda: fn(*args, **kwargs), lambda seconds: loads[-1].add(phase, seconds))

    wrapper.__wrapped_by_tcb_profile__ = True  # type: ignore[attr-defined]
    return wrapper


def profiled_load(build: Callable[..., Any], route: bool = False) -> Callable[..., Any]:
    """``build_replay`` as a profiled load: its own line, nested loads counted as ``callees``;
    ``route``: the backend route's ``build_frame_variants``, whose line follows the check that
    installs a variant into Dynamo's frame cache (:func:`_timed_route_replay`)."""

    @functools.wraps(build)
    def wrapper(target: Any, *args: Any, **kwargs: Any) -> Any:
        load = _Load(_name(target))
        load.route = route
        loads, timers = _loads(), _timers()
        if not loads:
            load.before = (_outside[0], _outside[1])
            _outside[0], _outside[1] = 0.0, 0
            load.background = (_background[0], _background[1])
            _background[0], _background[1] = 0.0, 0
        loads.append(load)
        timers.append(0.0)
        t0 = time.perf_counter()
        try:
            replay = build(target, *args, **kwargs)
        except BaseException as exc:
            load.outcome = f"not replayed: {type(exc).__name__}"
            raise
        finally:
            elapsed = time.perf_counter() - t0
            timers.pop()
            loads.pop()
            load.total = elapsed
            if timers:
                timers[-1] += elapsed
            if loads:
                loads[-1].add("callees", elapsed)
            if load.outcome:
                load.report()
        if route:
            load.built_at = time.perf_counter()
            _route_pending.append(load)
            if not replay[0]:  # no variant (the frame runs as Python): nothing is installed
                _report_route()
        else:
            _time_first_call(load, replay)
        return replay

    wrapper.__wrapped_by_tcb_profile__ = True  # type: ignore[attr-defined]
    return wrapper


def _name(target: Any) -> str:
    import torch

    if isinstance(target, torch.nn.Module):
        return f"{type(target).__qualname__}.forward"
    func = getattr(target, "__func__", target)
    return getattr(func, "__qualname__", None) or repr(target)


def _time_first_call(load: _Load, replay: Any) -> None:
    """Wrap the replay's variants so its first call is timed, then the line printed."""
    variants = getattr(replay, "_variants", None) or []
    if not variants:
        load.report()
        return
    _pending.append(load)

    def timed_check(check: Callable[..., Any]) -> Callable[..., Any]:
        def first_check(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return check(*args, **kwargs)
            finally:
                if load.first_check is None:
                    load.first_check = time.perf_counter() - t0
        return first_check

    def timed_run(fn: Callable[..., Any]) -> Callable[..., Any]:
        def first_run(*args: Any, **kwargs: Any) -> Any:
            if load.reported:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                load.first_run = time.perf_counter() - t0
                load.report()
        return first_run

    for variant in variants:
        variant.check = timed_check(variant.check)
        variant.fn = timed_run(variant.fn)


#: backend route loads built, whose install has not been decided yet (the callback's thread)
_route_pending: list[_Load] = []


def _report_route(check_s: float | None = None, installed: bool = True) -> None:
    load = _route_pending.pop()
    load.first_check = check_s
    if not installed:
        spent = "" if check_s is None else f" ({check_s * 1e3:.2f} ms)"
        load.outcome = f"not installed: no variant's checks hold{spent}, Dynamo traces the frame"
    load.report()


def _timed_route_replay(replay: Callable[..., Any]) -> Callable[..., Any]:
    """``ReplayingCallback._tcb_replay``: what follows a route load built inside it (the variants'
    checks, the install into Dynamo's frame cache) is that load's install check; its result says
    whether a variant was installed (None: Dynamo traces). Whatever the options (``guards="none"``
    checks nothing), the line is printed when the callback returns."""

    @functools.wraps(replay)
    def wrapper(self: Any, frame: Any, *args: Any, **kwargs: Any) -> Any:
        mark = len(_route_pending)
        result: Any = None
        try:
            result = replay(self, frame, *args, **kwargs)
            return result
        finally:
            while len(_route_pending) > mark:
                load = _route_pending[-1]
                _report_route(time.perf_counter() - load.built_at, installed=result is not None)

    wrapper.__wrapped_by_tcb_profile__ = True  # type: ignore[attr-defined]
    return wrapper


@atexit.register
def _report_pending() -> None:
    for load in _pending + _route_pending:
        load.report()


#: (module, attribute, phase): what a load goes through, by the name it is looked up by
_TARGETS = (
    ("torchair_cached_backend.fs_security", "read_at", "read"),
    ("torchair_cached_backend.store_backend", "sha256", "verify"),
    ("torchair_cached_backend.store_backend", "parse_manifest", "decode"),
    ("torchair_cached_backend.code_codec", "loads_code", "decode"),
    ("torchair_cached_backend.bypass.guard_runtime", "decode_consts", "decode"),
    ("torchair_cached_backend.bypass.loader", "build_checks", "checks"),
    ("torchair_cached_backend.graph_load", "load_graph", "graphs"),
)


def _counted(load_holds: Callable[..., Any]) -> Callable[..., Any]:
    """``GuardChecks.load_holds`` (every load-time evaluation goes through it) adding its
    function's check count to the load's line."""

    @functools.wraps(load_holds)
    def wrapper(checks: Any, *args: Any, **kwargs: Any) -> Any:
        loads = _loads()
        if loads:
            loads[-1].checks += int(checks.namespace.get("___load_checks", 0) or 0)
        return load_holds(checks, *args, **kwargs)

    return wrapper


def _wrap_targets(module_name: str) -> None:
    """Put the timers on ``module_name``'s functions of :data:`_TARGETS` (once)."""
    module = sys.modules.get(module_name)
    if module is None:
        return
    for name, attr, phase in _TARGETS:
        fn = getattr(module, attr, None) if name == module_name else None
        if fn is not None and not getattr(fn, "__wrapped_by_tcb_profile__", False):
            setattr(module, attr, timed(phase, fn))
    if module_name == f"{PACKAGE}.bypass.guard_runtime":
        checks = module.GuardChecks
        if not getattr(checks.load_holds, "__wrapped_by_tcb_profile__", False):
            checks.load_holds = _counted(timed("guards", checks.load_holds))
    elif module_name == f"{PACKAGE}.bypass.loader" and not getattr(
            module.build_replay, "__wrapped_by_tcb_profile__", False):
        module.build_replay = profiled_load(module.build_replay)
        module.build_frame_variants = profiled_load(module.build_frame_variants, route=True)
    elif module_name == f"{PACKAGE}.bypass.frame_install" and not getattr(
            module.ReplayingCallback._tcb_replay, "__wrapped_by_tcb_profile__", False):
        module.ReplayingCallback._tcb_replay = _timed_route_replay(module.ReplayingCallback._tcb_replay)


def _outside_import(seconds: float) -> None:
    counter = _background if on_thread() else _outside
    counter[0] += seconds
    counter[1] += 1


class _TimedLoader:
    """A module loader of ours whose import is timed as the ``imports`` phase (outside a
    load: kept for the next line), from the finders' search (``found_at``) to the end of
    the module's body: finding, reading, unmarshalling, running; everything else is the
    real loader's."""

    def __init__(self, loader: Any, name: str, found_at: float) -> None:
        self._loader = loader
        self._name = name
        self._found_at = found_at

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        loads = _loads()
        if loads:
            loads[-1].modules += 1
            _exclusive(lambda: self._loader.exec_module(module), lambda seconds: loads[-1].add("imports", seconds),
                       self._found_at)
        else:
            _exclusive(lambda: self._loader.exec_module(module), _outside_import, self._found_at)
        _wrap_targets(self._name)


class _ImportTimer:
    """First on ``sys.meta_path``: finds our modules with the finders after it and
    hands their specs a :class:`_TimedLoader`."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not name.startswith(PACKAGE + "."):
            return None
        t0 = time.perf_counter()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _TimedLoader(spec.loader, name, t0)
                return spec
        return None


def install() -> None:
    """Time our imports and wrap the load's functions with timers (once per process).

    Nothing is imported here: a profiled warm start imports what an unprofiled one does,
    so the ``imports`` phase is what a user's start pays."""
    if _installed:
        return
    sys.meta_path.insert(0, _ImportTimer())
    for name in [n for n in sys.modules if n.startswith(PACKAGE + ".")]:
        _wrap_targets(name)
    globals()["_installed"] = True


_installed = False
