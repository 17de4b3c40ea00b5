"""Prebuild: fill a cache for a list of example inputs in one go (image builds, fleets).

Call it with the inputs a server will see (e.g. one per batch-size bucket), then
``torchair-cache pack`` the cache dir: every node that unpacks the bundle starts
warm, and none compiles at start.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .logs import log
from .progress import Progress
from .stats import stats


class PrebuildReport:
    """What one prebuild did: calls made, graphs compiled / already cached, faults,
    seconds, and whether a warm start replays the target (``replayable``)."""

    __slots__ = ("cache_dir", "calls", "compiled", "hits", "uncached", "storage_faults", "seconds", "replayable", "why_not")

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir = cache_dir
        self.calls = 0
        self.compiled = 0
        self.hits = 0
        self.uncached = 0
        self.storage_faults = 0
        self.seconds = 0.0
        self.replayable: bool | None = None  # None: not checked (a cache_compile target checks itself)
        self.why_not = ""

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self) -> str:
        return "PrebuildReport(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"


def _call_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One item of ``inputs_list``: a tuple/list of arguments, a dict of keyword
    arguments, or a single argument."""
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def prebuild(
    target: Any,
    inputs_list: Sequence[Any],
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    progress: bool | None = None,
    **options: Any,
) -> PrebuildReport:
    """Compile and cache ``target`` (nn.Module, function, bound method, or what
    :func:`cache_compile` returned) for every item of ``inputs_list``, under
    ``torch.no_grad()``.

    Each item is one call's arguments: a tuple/list (positional), a dict
    (keywords) or a single value. ``options`` are ``npu_cached`` options
    (``compiler``, ``dynamic``...); pass ``dynamic=False`` to cache one static
    graph per input shape. Reports progress ("input i of n, elapsed"; a bar on a
    terminal, or when ``progress=True``) and returns a :class:`PrebuildReport`.
    """
    import torch

    if not inputs_list:
        raise ValueError("prebuild needs at least one example input in inputs_list")
    cache_compiled = hasattr(target, "cache_path") and hasattr(target, "_first_call_target")
    if cache_compiled:
        if cache_dir is not None or options:
            raise ValueError("prebuild: a cache_compile function carries its own cache_dir and options; pass neither")
        fn: Callable[..., Any] = target
        root = target.cache_path
    else:
        from .backend import make_backend
        from .options import parse_options

        opts = parse_options(dict(options, cache_dir=None if cache_dir is None else os.fspath(cache_dir)))
        root = opts.cache_dir
        fn = torch.compile(target, backend=make_backend(**dict(options, cache_dir=root)), dynamic=opts.dynamic)
    report = PrebuildReport(root)
    before = stats()
    bar = Progress(len(inputs_list), "prebuild: input", bar=progress)
    try:
        with torch.no_grad():
            for inputs in inputs_list:
                args, kwargs = _call_args(inputs)
                fn(*args, **kwargs)
                report.calls += 1
                now = stats()
                bar.step(f"{now.misses - before.misses} graph(s) compiled, {now.hits - before.hits} cached")
    finally:
        bar.close()
    after = stats()
    report.compiled = after.misses - before.misses
    report.hits = after.hits - before.hits
    report.uncached = after.uncached - before.uncached
    report.storage_faults = after.storage_faults - before.storage_faults
    report.seconds = bar.elapsed
    if not cache_compiled:
        report.replayable, report.why_not = _replayable(target, root, options)
    log.info("npu_cached prebuild: %s", report)
    return report


def _replayable(target: Any, cache_dir: str, options: dict[str, Any]) -> tuple[bool, str]:
    """Whether a warm start of ``target`` replays from ``cache_dir`` (no Dynamo)."""
    from .bypass.loader import CacheMiss, build_replay
    from .options import parse_options

    try:
        build_replay(target, parse_options(dict(options, cache_dir=cache_dir)))
    except CacheMiss as miss:
        return False, str(miss)
    except TypeError as exc:  # e.g. a callable object the loader cannot rebind
        return False, str(exc)
    return True, ""


# ---------------------------------------------------------------------------
# CLI form: torchair-cache prebuild SPEC CACHE_DIR
# ---------------------------------------------------------------------------


def load_spec(spec: str) -> tuple[Any, Sequence[Any]]:
    """``module:attr`` or ``path/to/file.py:attr``; ``attr`` is a callable returning
    ``(target, inputs_list)`` (or that pair itself)."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"prebuild spec {spec!r} must be MODULE:CALLABLE or FILE.py:CALLABLE")
    if where.endswith(".py") or os.sep in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ValueError(f"prebuild spec {spec!r}: no file {path}")
        name = os.path.splitext(os.path.basename(path))[0]
        sys.path.insert(0, os.path.dirname(path))  # the model's own imports, and a stable module name
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
    else:
        module = importlib.import_module(where)
    try:
        made = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"prebuild spec {spec!r}: {module.__name__} has no {attr!r}") from None
    made = made() if callable(made) and not _is_pair(made) else made
    if isinstance(made, dict):
        made = (made.get("target"), made.get("inputs"))
    if not _is_pair(made):
        raise ValueError(f"prebuild spec {spec!r} must give (target, inputs_list), got {type(made).__name__}")
    return made[0], made[1]


def _is_pair(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (list, tuple))
