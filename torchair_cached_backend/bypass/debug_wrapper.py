"""``torch.compile(backend="npu_cached")`` without importing Dynamo's minifier up front.

Dynamo wraps every backend in ``WrapBackendDebug`` (``torch._dynamo.repro.after_dynamo``)
inside ``torch.compile`` itself. Importing that module pulls in Dynamo's testing and
debugging backends and AOTAutograd: ~0.27 s, most of a warm backend-route start, for a
wrapper that only acts when a graph is compiled. A warm start that replays its
cached program compiles no graph, so for our backend the wrapper is built on the
first graph instead (:class:`DeferredBackendDebug`): with ``TORCHDYNAMO_REPRO_AFTER``
set the minifier behaves exactly as before, and every other backend gets Dynamo's own
``get_compiler_fn``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..registry import BACKEND_NAME

_installed = False


class DeferredBackendDebug:
    """What ``WrapBackendDebug`` exposes before its first call (the names Dynamo reads:
    ``_torchdynamo_orig_backend``, ``__name__``, ``get_compiler_config``, ``__wrapped__``);
    the real wrapper is made, and called, on the first graph."""

    def __init__(self, backend: Callable[..., Any], compiler_name: str | None) -> None:
        functools.wraps(backend)(self)
        self._torchdynamo_orig_backend = backend
        self._compiler_name = compiler_name
        if hasattr(backend, "__name__"):
            self.__name__ = backend.__name__
        if hasattr(backend, "compiler_name"):
            self.__name__ = backend.compiler_name
        if hasattr(backend, "get_compiler_config"):
            self.get_compiler_config = backend.get_compiler_config
        self._real: Any = None

    def __call__(self, gm: Any, example_inputs: list[Any], **kwargs: Any) -> Any:
        if self._real is None:
            from torch._dynamo.repro.after_dynamo import WrapBackendDebug

            self._real = WrapBackendDebug(self._torchdynamo_orig_backend, self._compiler_name)
        return self._real(gm, example_inputs, **kwargs)


def _is_ours(compiler_fn: Any) -> bool:
    """``"npu_cached"``, torch.compile's wrapper of it, or a backend ``make_backend`` made."""
    if compiler_fn == BACKEND_NAME:
        return True
    if isinstance(compiler_fn, str) or compiler_fn is None:
        return False
    if getattr(compiler_fn, "compiler_name", None) == BACKEND_NAME:
        return True
    module = getattr(compiler_fn, "__module__", None) or ""
    return module.split(".")[0] == __name__.split(".")[0]


def install() -> None:
    """Route ``get_compiler_fn`` of our backend through :class:`DeferredBackendDebug`
    (idempotent). Installed with the replay route, i.e. when ``torch.compile`` looks the
    name up, which it does before it wraps the backend."""
    global _installed
    if _installed:
        return
    from torch._dynamo import eval_frame

    original = eval_frame.get_compiler_fn

    def get_compiler_fn(compiler_fn: Any) -> Any:
        if not _is_ours(compiler_fn):
            return original(compiler_fn)
        from torch._dynamo.backends.registry import lookup_backend

        name = compiler_fn if isinstance(compiler_fn, str) else getattr(compiler_fn, "compiler_name", None)
        return DeferredBackendDebug(lookup_backend(compiler_fn), name)

    get_compiler_fn.__wrapped__ = original  # type: ignore[attr-defined]
    eval_frame.get_compiler_fn = get_compiler_fn
    _installed = True
