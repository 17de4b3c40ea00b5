"""What a replayed function is at run time: variant dispatch and the graph-break stand-ins.

``ReplayedFunction`` calls the first variant whose per-call guards hold (else
compiles the call with Dynamo, once, lazily: ``replay_fallback``, with the other calls
that do not replay); ``ResumeDispatch`` /
``ResumeFactory`` / ``ResumeRouter`` (``replay_resume``, imported by programs with
graph breaks only; re-exported here) stand in for Dynamo's resume functions after a
graph break (else run the original continuation eagerly). Everything here runs on
every call, so it is kept short; building these objects is ``loader``'s job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .guard_runtime import GuardChecks
from .program import note_used

_MISSING = object()


class Variant:
    """One replayable root frame: its function and the check that selects it (None on the
    backend route for the full check of ``checks``, not decoded yet). ``used`` is (program,
    root frame id) until its first call, which notes it as used by this process (so this
    process's merges never evict it), then None."""

    __slots__ = ("check", "fn", "checks", "used")

    def __init__(self, check: Callable[..., bool] | None, fn: Callable[..., Any], checks: GuardChecks | None,
                 used: tuple[tuple[str, str], str] | None = None) -> None:
        self.check = check
        self.fn = fn
        self.checks = checks
        self.used = used

    def note_used(self) -> None:
        used, self.used = self.used, None
        if used is not None:
            note_used(*used)


def always(*args: Any, **kwargs: Any) -> bool:
    return True


def global_module_hooks() -> tuple[dict[Any, Any], ...]:
    """nn.Module's global hook dicts (forward and backward; torch mutates them in place). They
    run around every submodule, which the cached graphs inlined, and torch.compile breaks the
    graph at every module call while one is registered: a replay requires them all empty."""
    from torch.nn.modules import module as nn_module

    return (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks,
            nn_module._global_backward_pre_hooks, nn_module._global_backward_hooks)


class ReplayedFunction:
    """A function replayed from cache: each call goes to the first variant whose
    guards hold for it, else to Dynamo (lazily compiled, caching as it goes)."""

    def __init__(
        self,
        variants: list[Variant],
        bound_self: Any,
        qualname: str,
        fallback: Callable[[], Callable[..., Any]],
        module: Any = None,
        original: Callable[..., Any] | None = None,
        miss: str | None = None,
    ) -> None:
        self._variants = variants
        self._self = bound_self
        self._prefix = () if bound_self is None else (bound_self,)
        self._fallback_factory = fallback
        self._compiled: Callable[..., Any] | None = None
        self._module = module
        self._original = original  # the function itself (run eagerly when global module hooks are set)
        self._miss = miss  # nothing replayable (already counted by load()): every call compiles
        self._eager_counted = False
        self._hooks: tuple[dict[Any, Any], ...] = ()
        if module is not None:  # the module's own hooks, run by nn.Module.__call__ (backward ones too)
            self._hooks = (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
                           module._backward_hooks)
        self._global_hooks = global_module_hooks()
        self._first = variants[0] if len(variants) == 1 else None
        self.__qualname__ = self.__name__ = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        global_hooks = self._global_hooks
        if global_hooks[0] or global_hooks[1] or global_hooks[2] or global_hooks[3]:
            return self._call_eagerly_for_global_hooks(args, kwargs)
        hooks = self._hooks
        if hooks and (hooks[0] or hooks[1] or hooks[2] or hooks[3]) and self._module.__dict__.get("forward") is not self:
            return self._call_with_hooks(args, kwargs)
        first = self._first
        if first is not None:  # one variant: the common case, kept short
            prefix = self._prefix
            try:
                ok = first.check(*prefix, *args, **kwargs)
            except Exception:
                ok = None
            if ok:
                if first.used is not None:
                    first.note_used()
                return first.fn(*prefix, *args, **kwargs)
        return self._dispatch(args, kwargs)

    def _dispatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        prefix = self._prefix
        for variant in self._variants:
            try:
                ok = variant.check(*prefix, *args, **kwargs)
            except TypeError:
                ok = self._binds(variant, args, kwargs)
            except Exception:  # a guard read something that is not there: not this variant
                ok = False
            if ok:
                if variant.used is not None:
                    variant.note_used()
                return variant.fn(*prefix, *args, **kwargs)
        return self._fall_back(args, kwargs)

    def _binds(self, variant: Variant, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """A TypeError from a check: a guard that does not apply (False), or arguments the
        function does not take (``replay_fallback`` raises the caller's error)."""
        if variant.checks is None:
            return False
        from .replay_fallback import binds

        return binds(self, variant.checks, args, kwargs)

    def _call_with_hooks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Module hooks run around ``forward`` in ``nn.Module.__call__``: run them
        there, with this replay as the forward (an instance ``forward`` the user set
        is put back afterwards). When this replay *is* the module's instance
        ``forward`` (``model.forward = tcb.load(model, ...)``), ``__call__`` already
        runs the hooks: they are not run again (see ``__call__``)."""
        module = self._module
        instance = module.__dict__
        previous = instance.get("forward", _MISSING)
        instance["forward"] = lambda *a, **k: self._dispatch(a, k)
        try:
            return module(*args, **kwargs)
        finally:
            if previous is _MISSING:
                instance.pop("forward", None)
            else:
                instance["forward"] = previous

    def _call_eagerly_for_global_hooks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from .replay_fallback import call_eagerly_for_global_hooks

        return call_eagerly_for_global_hooks(self, args, kwargs)

    def _fall_back(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        compiled = self._compiled
        if compiled is None:
            from .replay_fallback import compile_fallback

            compiled = self._compiled = compile_fallback(self, args, kwargs)
        return compiled(*args, **kwargs)


#: the graph-break stand-ins (``replay_resume``): imported with the first program that has a graph break
_RESUME = frozenset({"ResumeDispatch", "ResumeFactory", "ResumeRouter"})


def __getattr__(name: str) -> Any:
    if name in _RESUME:
        from . import replay_resume

        return getattr(replay_resume, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
