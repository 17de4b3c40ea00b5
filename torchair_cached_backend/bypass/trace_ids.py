"""Process-specific numbers a captured trace must not fold: ``id()`` and identity ``hash()``.

Dynamo evaluates ``id(obj)`` of an object it can find again (``self``, a submodule, a
global) at trace time: it guards the object's identity and folds the number into the
graph or the transformed bytecode. A replay in another process finds the same object
(its identity check holds: the same global, the same receiver), but the number is the
cold process's: ``self.lin(x) + id(self) % 1000`` replayed the cold process's number,
silently wrong. ``hash()`` of an object hashed by identity (``object.__hash__``: plain
instances, functions, classes, modules) is the same number shifted, also under a fixed
``PYTHONHASHSEED`` (a string's hash, seeded per process, is the capture's to check: a frame
folding one replays only under the same fixed seed).

While Dynamo traces for an ``npu_cached`` backend (between :func:`enter` and :func:`leave`,
called by our frame callbacks), such a value is Dynamo's own compile-time-only id (``FakeIdVariable``):
equal ids compare and key dicts as before (``kernels``' ``use_kernelized_func`` routes its
wrappers through a dict keyed by ``id(fn)``, all inside one trace), while anything else
done with it (arithmetic, a graph input, a value the transformed bytecode must rebuild)
is a graph break, so the call runs as Python in each process with its own number. On a
torch without ``FakeIdVariable`` every such call is a graph break. Other backends'
traces are untouched.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

_state = threading.local()
_installed = False
_lock = threading.Lock()
_MESSAGE = ("npu_cached: {what} of an object is a number that differs in every process; a cached "
            "program must not hold it (the call runs as Python)")


def enter() -> None:
    """Dynamo's tracing from here to :func:`leave` is for an ``npu_cached`` backend (nests)."""
    if not _installed:
        install()
    _state.depth = getattr(_state, "depth", 0) + 1


def leave() -> None:
    _state.depth -= 1


def active() -> bool:
    return getattr(_state, "depth", 0) > 0


def install() -> None:
    """Wrap Dynamo's ``id()`` and ``hash()`` once per process (inert outside :func:`enter`/:func:`leave`)."""
    with _lock:
        if not _installed:
            from . import trace_mutations  # the other trace-time wrap: what the frame changes in place

            trace_mutations.install()
            _wrap_builtins()


def _wrap_builtins() -> None:
    global _installed
    from torch._dynamo.variables.builtin import BuiltinVariable

    for name, what in (("call_id", "id()"), ("call_hash", "hash()")):
        original = getattr(BuiltinVariable, name, None)
        if original is not None and not getattr(original, "_tcb_trace_ids", False):
            setattr(BuiltinVariable, name, _portable(original, what))
    # Dynamo keeps a handler per (builtin, argument types) holding the method it found: one made
    # by an earlier trace (another backend's) would call the unwrapped method
    cache = getattr(BuiltinVariable, "call_function_handler_cache", None)
    if isinstance(cache, dict):
        for key in [k for k in list(cache) if isinstance(k, tuple) and k and k[0] in (id, hash)]:
            cache.pop(key, None)
    _installed = True


def _portable(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, tx, *args, **kwargs)
        if not active() or len(args) != 1 or not _folded(result, args[0], what):
            return result
        fake = _fake_id(result.value, what)
        if fake is None:
            from torch._dynamo.exc import Unsupported

            raise Unsupported(_MESSAGE.format(what=what))
        return fake

    call._tcb_trace_ids = True  # type: ignore[attr-defined]
    return call


def _folded(result: Any, arg: Any, what: str) -> bool:
    """Whether ``result`` is a constant number that differs between processes: every ``id()``
    (also of ``None``: an address), a ``hash()`` by identity (anything but numbers and strings)."""
    from torch._dynamo.variables.constant import ConstantVariable

    if type(result) is not ConstantVariable or type(result.value) is not int:
        return False  # already compile-time-only, or not a number
    if what == "id()":
        return True
    try:
        return not (arg.is_python_constant() and _value_hashed(arg.as_python_constant()))
    except Exception:  # noqa: BLE001  (a tracker that cannot say: process-specific, to be safe)
        return True


#: what hashes by value: numbers alike in every process; strings and bytes by ``PYTHONHASHSEED``,
#: which the capture checks (a frame folding one replays only under the same fixed seed).
#: ``None`` hashes by address before Python 3.12
_VALUE_HASHED = (int, float, bool, complex, str, bytes)


def _value_hashed(value: Any) -> bool:
    """Numbers and strings, and tuples (``torch.Size``) and frozensets of them."""
    if type(value) in _VALUE_HASHED:
        return True
    return isinstance(value, (tuple, frozenset)) and all(_value_hashed(v) for v in value)


def _fake_id(value: int, what: str) -> Any:
    try:
        from torch._dynamo.variables.constant import FakeIdVariable, FakeValueKind
    except ImportError:
        return None
    kind = FakeValueKind.ID if what == "id()" else FakeValueKind.HASH
    return FakeIdVariable(value, kind=kind)
