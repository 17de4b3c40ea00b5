"""Callees: what a replayed function calls that Dynamo compiled on its own (a graph
break inside a layer's forward or a helper), each replayed from its own program.

Imported only by programs that have callees; a callee with no usable program gets a
stand-in that compiles it (a counted fallback), never plain eager. Each load goes
through ``loader.build_replay`` by its module attribute (``TCB_PROFILE`` wraps it).
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable
from typing import Any

from ..logs import log
from ..options import BackendOptions
from . import loader
from .loader import CacheMiss
from .replay import ReplayedFunction


def install_callees(bound_self: Any, callees: list[dict[str, str]], options: BackendOptions, name: str) -> None:
    """Methods the function calls that Dynamo compiled on their own (a graph break
    inside a layer's forward or a helper): each gets its own replay, installed on the
    instance (``layer.forward``, ``self.helper``), so the replayed (or, for a frame
    Dynamo skipped, plain) caller calls the replay. A callee with no usable program
    gets a stand-in that compiles it (a counted fallback), never plain eager."""
    import torch

    for callee in callees:
        path, attr = callee.get("path", ""), callee.get("attr", "")
        try:
            owner = bound_self.get_submodule(path) if path else bound_self
        except (AttributeError, TypeError):
            log.info("npu_cached: %s: callee %s.%s is not there; not installed", name, path or "self", attr)
            continue
        func = None
        for klass in type(owner).__mro__:
            if attr in vars(klass):
                func = vars(klass)[attr]
                break
        if not isinstance(func, types.FunctionType):
            continue
        if attr in owner.__dict__ and not isinstance(owner.__dict__[attr], ReplayedFunction):
            log.info("npu_cached: %s: %s.%s is set on the instance; its cached program is not installed",
                     name, path or "self", attr)
            continue
        method = types.MethodType(func, owner)
        try:
            replay: Callable[..., Any] = loader.build_replay(method, options)
        except CacheMiss as miss:
            log.info("npu_cached: %s calls %s.%s: %s; compiling it instead", name, path or "self", attr, miss)
            from .loader_miss import _stand_in  # only a miss needs it

            replay = _stand_in(method, options, miss)
        if isinstance(owner, torch.nn.Module) or hasattr(owner, "__dict__"):
            owner.__dict__[attr] = replay


def global_callees(builder: Any, callees: list[dict[str, str]]) -> dict[str, str]:
    """Module-level functions the frames call by name that Dynamo compiled on their own
    (a graph break inside a helper): each gets its own replay under a name of ours,
    and the frames' code calls that name (the module's own global is left alone)."""
    renames: dict[str, str] = {}
    for callee in callees:
        name = callee.get("global")
        func = builder.scope.get(name) if name else None
        if not isinstance(func, types.FunctionType):
            continue
        ours = "___tcb_callee_" + hashlib.sha256(f"{func.__module__}.{func.__qualname__}".encode()).hexdigest()[:16]
        if not isinstance(builder.scope.get(ours), ReplayedFunction):
            try:
                replay: Callable[..., Any] = loader.build_replay(func, builder.options)
            except CacheMiss as miss:
                log.info("npu_cached: %s calls %s: %s; compiling it instead", builder.func.__qualname__, name, miss)
                from .loader_miss import _stand_in

                replay = _stand_in(func, builder.options, miss)
            builder.scope[ours] = replay
        renames[name] = ours
    return renames
