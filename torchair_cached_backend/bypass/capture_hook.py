"""The bytecode hook that feeds capture, installed without importing capture.

``torch.compile(backend="npu_cached")`` installs the hook before the first frame (a
cold start must see every frame Dynamo transforms). Capture itself (guard capture,
guard code generation, split graphs) is imported when Dynamo first transforms a
frame, which a warm start whose frames replay never does.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from typing import Any

from ..logs import log

_installed = False
_lock = threading.Lock()


def ensure_installed() -> None:
    """Install the bytecode hook and the replay route once per process; turn off
    Dynamo's runtime overhead recording so transformed code does not call into torch._dynamo."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        import torch._dynamo
        from torch._dynamo.convert_frame import register_bytecode_hook

        if hasattr(torch._dynamo.config, "record_runtime_overhead"):
            torch._dynamo.config.record_runtime_overhead = False
        register_bytecode_hook(_on_bytecode)
        from .frame_install import install_route

        install_route()  # warm frames of npu_cached backends replay from the cache
        _installed = True


def _on_bytecode(code: types.CodeType, out_code: types.CodeType) -> None:
    try:
        from .capture import on_bytecode
    except Exception as exc:  # never break Dynamo: the program is just not saved
        log.warning("npu_cached: bytecode capture unavailable for %s: %s: %s", code.co_name, type(exc).__name__, exc)
        return None
    return on_bytecode(code, out_code)


def backend_chain(compiler_fn: Any) -> Iterator[Any]:
    """``compiler_fn`` and the callables it wraps (Dynamo's debug wrapper, ``torch.compile``'s
    kwargs wrapper, ``make_backend``'s closure), outermost first, at most 8 levels."""
    fn, seen = compiler_fn, 0
    while fn is not None and seen < 8:
        yield fn
        fn = getattr(fn, "compiler_fn", None) or getattr(fn, "__wrapped__", None)
        seen += 1


def backend_options(compiler_fn: Any) -> Any:
    """The parsed options of the ``npu_cached`` backend behind Dynamo's compiler_fn, else None."""
    from ..compile_mode import apply_mode
    from ..options import parse_options
    from ..registry import BACKEND_NAME

    kwargs: dict[str, Any] = {}
    for fn in backend_chain(compiler_fn):
        bound = getattr(fn, "options", None)
        if bound is not None and type(bound).__name__ == "BackendOptions":
            return bound
        if isinstance(getattr(fn, "kwargs", None), dict):
            kwargs = {**fn.kwargs, **kwargs}
        if getattr(fn, "__name__", None) == BACKEND_NAME and getattr(fn, "__module__", "").startswith(
                "torchair_cached_backend"):
            try:
                return apply_mode(parse_options(kwargs.get("options")), kwargs.get("mode"))
            except Exception:
                return None
    return None
