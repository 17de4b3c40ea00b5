"""Opt-in: route torchair's ``cache_compile`` / ``readable_cache`` to this package.

A codebase written against ``torchair.inference.cache_compile`` gets the safe cache (checksummed
entries, staleness checks, warm start without Dynamo) without edits::

    import torchair_cached_backend as tcb
    tcb.patch_torchair()            # before the model is built
    model = Model()                 # its torchair.inference.cache_compile(...) is now ours

    with tcb.patch_torchair():      # or for a block only
        model = Model()

    tcb.unpatch_torchair()          # torchair's own functions again

Nothing happens at import: patching is always an explicit call, and it is reversible. Functions
built while patched stay ours after unpatching (they hold their own cache).

What is replaced, in the ``torchair.inference`` module: the public ``cache_compile`` and
``readable_cache``, and the private ``_cache_compile`` / ``_readable_cache`` they delegate to,
so a caller that bound the public function before patching (``from torchair.inference import
cache_compile``) is routed too. torchair's implementation module is left alone.

Routed ``cache_compile`` calls compile with torchair (``compiler="torchair"``), as torchair's own
function does; pass ``compiler=...`` to :func:`patch_torchair` to change that default (a call's
own ``compiler=`` keyword still wins). The routed ``readable_cache`` describes our cache entries
(``cached.cache_path``) and hands a path it does not recognise, such as an existing torchair
``compiled_module`` file, to torchair's original.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from typing import Any

from .logs import log

#: names replaced in ``torchair.inference``: public name -> private delegate
_NAMES = {"cache_compile": "_cache_compile", "readable_cache": "_readable_cache"}

_lock = threading.Lock()
_active: TorchairPatch | None = None


class TorchairPatch:
    """The handle :func:`patch_torchair` returns: ``unpatch()``, or use it as a context manager.

    Only the handle that installed the patch removes it: a nested ``patch_torchair()`` while one
    is active returns a handle whose exit leaves the outer patch in place."""

    def __init__(self, module: Any, originals: dict[str, Any], replacements: dict[str, Any], owner: bool) -> None:
        self.module = module
        self.originals = originals
        self.replacements = replacements
        self.owner = owner

    @property
    def active(self) -> bool:
        """Whether the patch this handle installed (or, nested, found) is still in place."""
        return _active is not None and _active.originals is self.originals

    def unpatch(self) -> None:
        """Restore torchair's functions (a no-op for a nested handle, or if already restored)."""
        if self.owner:
            _restore(self)

    def __enter__(self) -> TorchairPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unpatch()

    def __repr__(self) -> str:
        state = "active" if self.active else "inactive"
        return f"<TorchairPatch {state}: {sorted(self.replacements)} of {self.module.__name__}>"


def _torchair_inference() -> Any:
    try:
        return importlib.import_module("torchair.inference")
    except Exception as exc:  # torchair raises more than ImportError when CANN is absent
        raise ImportError(
            "patch_torchair() routes torchair.inference.cache_compile to torchair_cached_backend, but torchair "
            f"cannot be imported here ({type(exc).__name__}: {exc}). Install torch_npu (it ships torchair), or "
            "call torchair_cached_backend.cache_compile directly."
        ) from exc


def _routed_cache_compile(default_compiler: str) -> Callable[..., Any]:
    from .drop_in import cache_compile

    @functools.wraps(cache_compile)
    def routed(func: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
        kwargs.setdefault("compiler", default_compiler)
        return cache_compile(func, **kwargs)

    routed.__tcb_routed__ = True  # type: ignore[attr-defined]
    return routed


def _routed_readable_cache(original: Callable[..., Any] | None) -> Callable[..., Any]:
    from .readable import readable_cache

    @functools.wraps(readable_cache)
    def routed(cache_bin: str, print_output: bool = True, file: str | None = None) -> Any:
        try:
            return readable_cache(cache_bin, print_output=print_output, file=file)
        except FileNotFoundError:
            if original is None:
                raise
            # not one of ours: a torchair cache file (compiled_module) keeps working
            return original(cache_bin, print_output=print_output, file=file)

    routed.__tcb_routed__ = True  # type: ignore[attr-defined]
    return routed


def patch_torchair(*, compiler: str = "torchair") -> TorchairPatch:
    """Route ``torchair.inference.cache_compile`` and ``readable_cache`` to this package's.

    ``compiler`` is the inner compiler routed calls use unless they pass their own
    (``"torchair"`` as torchair does; ``"auto"``, ``"inductor"`` or ``"eager"`` also work).
    Returns a :class:`TorchairPatch`; undo with ``handle.unpatch()``, :func:`unpatch_torchair`,
    or use it in a ``with`` block. Raises ImportError (naming the cause) if torchair cannot be
    imported."""
    global _active
    from .options import parse_options

    parse_options({"compiler": compiler})  # a bad name fails here, not at the first routed call
    with _lock:
        if _active is not None:
            return TorchairPatch(_active.module, _active.originals, _active.replacements, owner=False)
        module = _torchair_inference()
        originals: dict[str, Any] = {}
        replacements: dict[str, Any] = {}
        routed = {
            "cache_compile": _routed_cache_compile(compiler),
            # the fallback must be torchair's implementation, not its public wrapper (which calls the patched delegate)
            "readable_cache": _routed_readable_cache(
                getattr(module, "_readable_cache", None) or getattr(module, "readable_cache", None)
            ),
        }
        for public, private in _NAMES.items():
            for name in (public, private):
                if hasattr(module, name):
                    originals[name] = getattr(module, name)
                    replacements[name] = routed[public]
        missing = [name for name in _NAMES if name not in originals]
        if missing:
            raise ImportError(
                f"torchair.inference ({getattr(module, '__file__', '?')}) has no {missing}: this torchair is not "
                "supported by patch_torchair(); call torchair_cached_backend.cache_compile directly"
            )
        for name, value in replacements.items():
            setattr(module, name, value)
        _active = TorchairPatch(module, originals, replacements, owner=True)
        log.info("patch_torchair: torchair.inference %s now route to torchair_cached_backend", sorted(replacements))
        return _active


def _restore(handle: TorchairPatch) -> None:
    global _active
    with _lock:
        if _active is not handle:
            return
        for name, original in handle.originals.items():
            current = getattr(handle.module, name, None)
            if current is handle.replacements[name]:
                setattr(handle.module, name, original)
            else:  # someone patched over us: leave theirs in place
                log.warning("unpatch_torchair: torchair.inference.%s was replaced by someone else; left as is", name)
        _active = None
        log.info("unpatch_torchair: torchair.inference functions restored")


def unpatch_torchair() -> None:
    """Restore torchair's own ``cache_compile`` / ``readable_cache`` (a no-op if not patched)."""
    handle = _active
    if handle is not None:
        _restore(handle)
