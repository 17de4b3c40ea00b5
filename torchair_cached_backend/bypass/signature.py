"""Binding a call to a function's parameters: errors of a replayed call whose arguments the
function does not take, and the arguments that re-bind a frame's locals."""

from __future__ import annotations

import types
from typing import Any


class InputSignatureError(TypeError):
    """A call's arguments do not bind to the cached function's parameters (the same
    TypeError the original function would raise, naming the function)."""


def call_args(code: types.CodeType, local: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword arguments that re-bind a frame's locals to its parameters."""
    n = code.co_argcount
    pos = [local[name] for name in code.co_varnames[:n]]
    i = n + code.co_kwonlyargcount
    kwargs = {name: local[name] for name in code.co_varnames[n:i]}
    if code.co_flags & 0x04:
        pos.extend(local[code.co_varnames[i]])
        i += 1
    if code.co_flags & 0x08:
        kwargs.update(local[code.co_varnames[i]])
    return pos, kwargs
