"""Errors of a replayed call whose arguments the function does not take."""

from __future__ import annotations


class InputSignatureError(TypeError):
    """A call's arguments do not bind to the cached function's parameters (the same
    TypeError the original function would raise, naming the function)."""
