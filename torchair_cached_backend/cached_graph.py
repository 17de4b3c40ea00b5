"""The callable Dynamo installs for one graph served by ``npu_cached``.

Its own module so the backend (which makes them) and the bypass capture (which
recognizes them in a frame's globals) both depend on it, not on each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .options import BackendOptions


class CachedGraph:
    """The callable Dynamo installs as ``__compiled_fn_*``; carries its cache key
    so the bypass capture can find which stored graph a frame calls."""

    __slots__ = ("fn", "key", "compiler", "cached", "reason", "options", "input_dims", "__weakref__")

    def __init__(self, fn: Callable[..., Any], key: str, compiler: str, cached: bool, reason: str | None = None) -> None:
        self.fn = fn
        self.key = key
        self.compiler = compiler
        self.cached = cached
        self.reason = reason  # why it is not cached (the capture says so when it refuses the frame)
        self.options: BackendOptions | None = None
        #: frame-local name -> dims (int static, None symbolic), for the bypass input check
        self.input_dims: dict[str, list[int | None]] = {}

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)
