"""Registration of ``npu_cached`` with Dynamo, kept apart from compiling.

Two routes, both idempotent: the ``torch_dynamo_backends`` entry point (an
installed package needs no import at all), and :func:`register` on import when
Dynamo is already loaded. Importing this module never imports Dynamo, and
registering never imports the capture machinery (that waits for the name to be used).
"""

from __future__ import annotations

import sys
from typing import Any

BACKEND_NAME = "npu_cached"


def _npu_cached(gm: Any, example_inputs: list[Any], **kwargs: Any) -> Any:
    """Entry-point target; imports the backend machinery on first use only."""
    from .backend import npu_cached as backend

    return backend(gm, example_inputs, **kwargs)


_npu_cached.__name__ = _npu_cached.__qualname__ = BACKEND_NAME


def __getattr__(name: str) -> Any:
    """``npu_cached`` is resolved here, so loading the entry point (Dynamo does it at
    ``torch.compile(backend="npu_cached")``, before the first frame) installs the
    bytecode capture: a root frame with no graph of its own (a forward that starts
    with a ``print``) is transformed before any graph reaches the backend."""
    if name == BACKEND_NAME:
        from . import preload

        preload.caller_needs(preload.ROUTE_NEEDS)  # the thread may be importing the route: wait, not race
        from .bypass.capture_hook import ensure_installed

        ensure_installed()
        return _npu_cached
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Make ``backend="npu_cached"`` resolvable in this process.

    The name goes in as a lazy entry point (as the installed package's own): Dynamo
    loads it at ``torch.compile(backend="npu_cached")``, which resolves ``npu_cached``
    through :func:`__getattr__` above and so installs the bytecode capture before the
    first frame. Registering imports none of the capture machinery, so ``import
    torchair_cached_backend`` in a process that already imported Dynamo (every
    transformers process) keeps the warm path light.

    When the name was discovered through the entry point but not yet loaded,
    Dynamo will load it itself; registering as well would make Dynamo's own
    ``register_backend`` fail on a duplicate name, so we leave it alone.
    """
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry._COMPILER_FNS:
        return
    if registry._BACKENDS.get(BACKEND_NAME) is not None:  # an entry point Dynamo will load
        return
    registry._BACKENDS[BACKEND_NAME] = EntryPoint(
        name=BACKEND_NAME, value=f"{__name__}:{BACKEND_NAME}", group="torch_dynamo_backends"
    )


_DYNAMO_REGISTRY = "torch._dynamo.backends.registry"


def register_if_dynamo_loaded() -> None:
    """Called at package import: registers now when Dynamo is loaded, else right after
    Dynamo's backend registry is imported (:class:`_RegisterWhenImported`). Either way
    ``torch.compile(backend="npu_cached")`` finds the name without Dynamo's
    ``_lazy_import`` of every built-in backend (AOTAutograd, Inductor's code cache,
    networkx: ~0.3 s of a warm start)."""
    if _DYNAMO_REGISTRY in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterWhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenImported())


class _RegisterWhenImported:
    """A meta path finder that only watches Dynamo's backend registry module: it lets the
    normal finder load it, then registers ``npu_cached`` (and removes itself)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _DYNAMO_REGISTRY:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader:
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            register()
        except Exception:  # registering must never fail Dynamo's import; the entry point remains
            pass
        try:
            from . import preload

            preload.after_dynamo()  # the backend route's modules, in the background once Dynamo is in
        except Exception:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
