"""Callees: what a replayed function calls that Dynamo compiled on its own (a graph
break inside a layer's forward or a helper), each replayed from its own program.

Imported only by programs that have callees; a callee with no usable program gets a
stand-in that compiles it (a counted fallback), never plain eager. Each load goes
through ``loader.build_replay`` by its module attribute (``TCB_PROFILE`` wraps it).
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable
from typing import Any

from ..logs import log, warn_once
from ..options import BackendOptions
from ..stats import record_fallback
from . import loader
from .loader import CacheMiss
from .replay import ReplayedFunction
from .shared_load import SharedLoad


class CellCallee:
    """Stands in a decorator wrapper's cell (``func`` of transformers' ``can_return_tuple``)
    for the function it wraps, in the replayed wrapper only: called with the replay's
    receiver, the wrapped method's own replay (built at that first call, see
    :class:`LazyCallee`); anything else, the function itself. The wrapper's checks keep
    reading the real cell."""

    __slots__ = ("fn", "receiver", "replay", "build")

    def __init__(self, fn: types.FunctionType, receiver: Any) -> None:
        self.fn = fn
        self.receiver = receiver
        self.replay: Callable[..., Any] | None = None
        self.build: Callable[[], Callable[..., Any]] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and args[0] is self.receiver:
            replay = self.replay
            if replay is None and self.build is not None:
                build, self.build = self.build, None
                replay = self.replay = build()
            if replay is not None:
                return replay(*args[1:], **kwargs)
        return self.fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # ``func.__name__`` and the like, as the function's
        if name in CellCallee.__slots__:  # not set yet (a copy made without __init__): no recursion
            raise AttributeError(name)
        return getattr(self.fn, name)


class LazyCallee:
    """A callee's replay, built at its first call: its load-time guards are then evaluated
    where Dynamo evaluated them at cold, at the method's own frame entry, after the caller
    ran what comes before the call (a wrapper setting module state, as ``kernels``'
    ``use_kernelized_func`` does, is seen as the traced method saw it). Replaces itself on the
    instance once built."""

    __slots__ = ("owner", "attr", "target", "options", "caller", "called", "replay", "shared")

    def __init__(self, owner: Any, attr: str, target: Any, options: BackendOptions, caller: str, called: str,
                 shared: SharedLoad | None = None) -> None:
        self.owner, self.attr, self.target = owner, attr, target
        self.options, self.caller, self.called = options, caller, called
        self.replay: Callable[..., Any] | None = None
        self.shared = shared  # with the other layers' callees of the same program

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        replay = self.replay
        if replay is None:
            shared, self.shared = self.shared, None
            replay = self.replay = _replay_or_stand_in(self.target, self.options, self.caller, self.called, shared)
            if self.owner.__dict__.get(self.attr) is self:
                self.owner.__dict__[self.attr] = replay
        return replay(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # ``forward.__name__``, ``__wrapped__``: the method's
        if name in LazyCallee.__slots__:
            raise AttributeError(name)
        return getattr(self.target, name)


def cell_callees(func: types.FunctionType, bound_self: Any,
                 callees: list[dict[str, Any]]) -> tuple[dict[str, Any], list[CellCallee]]:
    """Stand-ins for the cells of ``func`` (a decorator's wrapper) leading to a method Dynamo
    compiled on its own (a graph break inside the decorated forward): free variable -> the
    value the replayed wrapper's cell holds instead: a :class:`CellCallee`, or a copy of an
    inner wrapper whose own cell holds it (the copies share everything else); and the
    :class:`CellCallee` stand-ins, whose replays :func:`install_cell_callees` builds."""
    out: dict[str, Any] = {}
    stand_ins: list[CellCallee] = []
    for callee in callees:
        path = callee.get("cell")
        if not path or callee.get("path") or not isinstance(path, list) or path[0] in out:
            continue
        value = _swapped(func, [str(p) for p in path], bound_self, stand_ins)
        if value is not None:
            out[path[0]] = value
    return out, stand_ins


def install_cell_callees(stand_ins: list[CellCallee], bound_self: Any, options: BackendOptions, name: str,
                         shared: SharedLoad | None = None) -> None:
    """The replay of each method a decorator's cell leads to (else a stand-in that compiles
    it), built at its first call; ``shared`` with the same method's of the other layers."""
    for stand_in in stand_ins:
        stand_in.build = functools.partial(_replay_or_stand_in, types.MethodType(stand_in.fn, bound_self), options,
                                           name, stand_in.fn.__qualname__, shared)


def _swapped(fn: types.FunctionType, path: list[str], bound_self: Any, stand_ins: list[CellCallee]) -> Any:
    freevars = fn.__code__.co_freevars
    if path[0] not in freevars or not fn.__closure__:
        return None
    try:
        value = fn.__closure__[freevars.index(path[0])].cell_contents
    except ValueError:  # an empty cell
        return None
    if type(value) is not types.FunctionType:
        return None
    if len(path) == 1:
        stand_in = CellCallee(value, bound_self)
        stand_ins.append(stand_in)
        return stand_in
    inner = _swapped(value, path[1:], bound_self, stand_ins)
    return None if inner is None else with_cells(value, {path[1]: inner})


def swapped_closure(fn: types.FunctionType, cells: dict[str, Any]) -> tuple[Any, ...] | None:
    """``fn``'s closure with the cells named in ``cells`` holding those values instead (new cells)."""
    if not cells or not fn.__closure__:
        return fn.__closure__
    return tuple(types.CellType(cells[n]) if n in cells else c
                 for n, c in zip(fn.__code__.co_freevars, fn.__closure__, strict=True))


def with_cells(fn: types.FunctionType, cells: dict[str, Any]) -> types.FunctionType:
    """A copy of ``fn`` with :func:`swapped_closure` (everything else shared)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, swapped_closure(fn, cells))
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    copy.__qualname__ = fn.__qualname__
    return copy


def install_callees(bound_self: Any, callees: list[dict[str, str]], options: BackendOptions, name: str,
                    shared: SharedLoad | None = None) -> None:
    """Methods the function calls that Dynamo compiled on their own (a graph break
    inside a layer's forward or a helper): each gets its own replay, installed on the
    instance (``layer.forward``, ``self.helper``), so the replayed (or, for a frame
    Dynamo skipped, plain) caller calls the replay, built at its first call. A callee with
    no usable program gets a stand-in that compiles it (a counted fallback), never plain eager.

    A callee (``layers.0``) is installed on the other children of its parent of its class
    too (``layers.1``...): at cold Dynamo compiled the first one's method and ran the
    others' from its own cache (no recompile, so nothing recorded them); each gets its own
    replay, checked for it at its first call. The loads of one callee share what they can
    (``shared_load``), with the same callee's of the caller's siblings when the caller's
    load was ``shared`` with them."""
    done: set[tuple[str, str]] = set()
    for callee in callees:
        if callee.get("unreached"):
            _unreached(name, str(callee["unreached"]))
            continue
        path, attr = callee.get("path", ""), callee.get("attr", "")
        if callee.get("cell") and not path:  # the replayed wrapper's own cell: ``install_cell_callees``
            continue
        # the layers load one program: read, decoded and checked once
        group = SharedLoad() if shared is None else shared.child(f"{path}.{attr}")
        for each in (path, *(_siblings(bound_self, path) if path else ())):
            if (each, attr) not in done:
                done.add((each, attr))
                _install_callee(bound_self, each, callee, options, name, group)


def _unreached(caller: str, called: str) -> None:
    """A function compiled on its own that ``caller`` reaches through a value ``load()`` cannot
    replace: it runs as Python, counted once per load (the backend route replays it)."""
    record_fallback(UNREACHED)
    warn_once(f"unreached:{caller}:{called}", "npu_cached: %s calls %s, which Dynamo compiled as a frame of its own, "
              "through a value load() cannot replace (a registry, a local variable, an object that is no "
              "submodule): it runs as Python (counted in stats().fallbacks); torch.compile(model, "
              "backend='npu_cached') replays it", caller, called)


#: the fallback reason of :func:`_unreached`
UNREACHED = "a function compiled on its own runs as Python (load() cannot reach it)"


def _siblings(bound_self: Any, path: str) -> list[str]:
    """Paths of the other children of ``path``'s parent module of its class (the other
    layers of a ``ModuleList``, ``encoder.block2`` beside ``encoder.block1``)."""
    parent, _, last = path.rpartition(".")
    try:
        container = bound_self.get_submodule(parent) if parent else bound_self
        recorded = container.get_submodule(last)
        children = list(container.named_children())
    except (AttributeError, TypeError):
        return []
    prefix = f"{parent}." if parent else ""
    return [prefix + child for child, module in children if child != last and type(module) is type(recorded)]


def _install_callee(bound_self: Any, path: str, callee: dict[str, Any], options: BackendOptions, name: str,
                    shared: SharedLoad | None = None) -> None:
    import torch

    attr = callee.get("attr", "")
    try:
        owner = bound_self.get_submodule(path) if path else bound_self
    except (AttributeError, TypeError):
        log.info("npu_cached: %s: callee %s.%s is not there; not installed", name, path or "self", attr)
        return
    func = None
    for klass in type(owner).__mro__:
        if attr in vars(klass):
            func = vars(klass)[attr]
            break
    if not isinstance(func, types.FunctionType):
        return
    if not (isinstance(owner, torch.nn.Module) or hasattr(owner, "__dict__")):
        return
    if attr in owner.__dict__ and not _ours(owner.__dict__[attr]):
        log.info("npu_cached: %s: %s.%s is set on the instance; its cached program is not installed",
                 name, path or "self", attr)
        return
    cells = callee.get("cell")
    if cells:  # a submodule's decorated method: its wrapper, run as Python, leads to the replay
        stand_ins: list[CellCallee] = []
        value = _swapped(func, [str(c) for c in cells], owner, stand_ins) if isinstance(cells, list) else None
        if value is None:
            log.info("npu_cached: %s: %s.%s no longer wraps what it wrapped; its cached program is not installed",
                     name, path, attr)
            return
        install_cell_callees(stand_ins, owner, options, name, shared)
        copy = with_cells(func, {cells[0]: value})
        copy.__dict__[_CELL_COPY] = True
        owner.__dict__[attr] = types.MethodType(copy, owner)
        return
    owner.__dict__[attr] = LazyCallee(owner, attr, types.MethodType(func, owner), options, name,
                                      f"{path or 'self'}.{attr}", shared)


#: marks our copy of a decorator's wrapper whose cell leads to a replay (installed on a submodule)
_CELL_COPY = "_tcb_cell_replay"


def _ours(value: Any) -> bool:
    """An instance attribute a previous load installed (a replay, or a wrapper leading to one)."""
    return isinstance(value, (ReplayedFunction, LazyCallee)) or (
        isinstance(value, types.MethodType) and bool(getattr(value.__func__, "__dict__", {}).get(_CELL_COPY)))


def _replay_or_stand_in(target: Any, options: BackendOptions, caller: str, called: str,
                        shared: SharedLoad | None = None) -> Callable[..., Any]:
    """The replay of ``target`` (a callee of ``caller``), or on a miss a stand-in that compiles it."""
    try:
        return loader.build_replay(target, options, shared=shared)
    except CacheMiss as miss:
        log.info("npu_cached: %s calls %s: %s; compiling it instead", caller, called, miss)
        failure = miss
    except Exception as exc:  # built at the callee's first call, inside the user's: never fail it
        log.warning("npu_cached: %s calls %s: its replay could not be built (%s: %s); compiling it instead",
                    caller, called, type(exc).__name__, exc)
        failure = CacheMiss(f"the replay of {called} could not be built ({type(exc).__name__})")
    from .loader_miss import _stand_in  # only a miss needs it

    return _stand_in(target, options, failure)


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
            builder.scope[ours] = _replay_or_stand_in(func, builder.options, builder.func.__qualname__, name)
        renames[name] = ours
    return renames
