"""``TCB_PROFILE=1``: where a warm start spends its time, one stderr line per load.

Off (the default) this module is never imported and nothing on the warm path is
wrapped: zero cost. On, :func:`install` (called at package import) wraps the few
functions a load goes through with timers; each ``load()``/``cache_compile`` load
prints, after the replay's first call::

    tcb profile: load LlamaForCausalLM.forward: 6.10 ms = read 0.10 + verify 0.19 + decode 1.40
    + checks 0.50 + guards 1.52 (619 checks) + graphs 0.30 + other 2.09 | first call 2.90 ms (check 0.02, run 2.88)

Phases are exclusive (an inner phase's time is not counted in the outer one), so they
add up to the load's total: ``read`` the entry files, ``verify`` their sha256,
``decode`` manifests, bytecode and guard constants, ``checks`` build the guard
functions, ``guards`` evaluate load-time guards (with how many checks the generated
functions hold: a check repeated per layer is one check in a loop), ``graphs`` load the compiled graphs
(the compiler's own part), ``callees`` nested loads of methods replayed on their own,
``other`` the rest. A replay never called reports at exit.
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

ENV = "TCB_PROFILE"
PHASES = ("read", "verify", "decode", "checks", "guards", "graphs", "callees")

_local = threading.local()
_pending: list[_Load] = []


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

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def line(self) -> str:
        ms = 1e3
        parts = [f"{p} {self.phases.get(p, 0.0) * ms:.2f}" for p in PHASES if p in self.phases or p != "callees"]
        if self.checks:
            parts[PHASES.index("guards")] += f" ({self.checks} checks)"
        other = self.total - sum(self.phases.values())
        parts.append(f"other {max(other, 0.0) * ms:.2f}")
        text = f"tcb profile: load {self.name}: {self.total * ms:.2f} ms = " + " + ".join(parts)
        if self.outcome:
            text += f" ({self.outcome})"
        if self.first_run is not None:
            check = self.first_check or 0.0
            text += (f" | first call {(check + self.first_run) * ms:.2f} ms "
                     f"(check {check * ms:.2f}, run {self.first_run * ms:.2f})")
        elif not self.outcome:
            text += " | first call - (not replayed)"
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


def timed(phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` timed as ``phase`` of the innermost load (exclusive of inner phases)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        loads = _loads()
        if not loads:
            return fn(*args, **kwargs)
        timers = _timers()
        timers.append(0.0)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - t0
            inner = timers.pop()
            if timers:
                timers[-1] += elapsed
            loads[-1].add(phase, elapsed - inner)

    wrapper.__wrapped_by_tcb_profile__ = True  # type: ignore[attr-defined]
    return wrapper


def profiled_load(build: Callable[..., Any]) -> Callable[..., Any]:
    """``build_replay`` as a profiled load: its own line, nested loads counted as ``callees``."""

    @functools.wraps(build)
    def wrapper(target: Any, *args: Any, **kwargs: Any) -> Any:
        load = _Load(_name(target))
        loads, timers = _loads(), _timers()
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


@atexit.register
def _report_pending() -> None:
    for load in _pending:
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


def _counted(load_failures: Callable[..., Any]) -> Callable[..., Any]:
    """``GuardChecks.load_failures`` adding its function's check count to the load's line."""

    @functools.wraps(load_failures)
    def wrapper(checks: Any, *args: Any, **kwargs: Any) -> Any:
        loads = _loads()
        if loads:
            loads[-1].checks += int(checks.namespace.get("___load_checks", 0) or 0)
        return load_failures(checks, *args, **kwargs)

    return wrapper


def install() -> None:
    """Wrap the load's functions with timers (once per process)."""
    import importlib

    if _installed:
        return
    for module_name, attr, phase in _TARGETS:
        module = importlib.import_module(module_name)
        fn = getattr(module, attr, None)
        if fn is not None and not getattr(fn, "__wrapped_by_tcb_profile__", False):
            setattr(module, attr, timed(phase, fn))
    from .bypass import guard_runtime, loader

    guard_runtime.GuardChecks.load_failures = _counted(timed("guards", guard_runtime.GuardChecks.load_failures))
    loader.build_replay = profiled_load(loader.build_replay)
    globals()["_installed"] = True


_installed = False
