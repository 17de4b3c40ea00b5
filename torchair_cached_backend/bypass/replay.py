"""What a replayed function is at run time: variant dispatch and the graph-break stand-ins.

``ReplayedFunction`` calls the first variant whose per-call guards hold (else
compiles the call with Dynamo, once, lazily); ``ResumeDispatch`` /
``ResumeFactory`` / ``ResumeRouter`` (``replay_resume``, imported by programs with
graph breaks only; re-exported here) stand in for Dynamo's resume functions after a
graph break (else run the original continuation eagerly). Everything here runs on
every call, so it is kept short; building these objects is ``loader``'s job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..logs import log
from ..stats import record_fallback
from .guard_runtime import GuardChecks
from .program import note_used
from .signature import InputSignatureError

_MISSING = object()


class Variant:
    """One replayable root frame: its function and the check that selects it.
    ``used`` is (program, root frame id) until its first call, which notes it as
    used by this process (so this process's merges never evict it), then None."""

    __slots__ = ("check", "fn", "checks", "used")

    def __init__(self, check: Callable[..., bool], fn: Callable[..., Any], checks: GuardChecks | None,
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
        """A TypeError from a check is either a guard that does not apply (False) or
        arguments the function does not take (the caller's error, raised as such)."""
        if variant.checks is None:
            return False
        try:
            variant.checks.bind(*self._prefix, *args, **kwargs)
        except TypeError as exc:
            raise InputSignatureError(f"{self.__qualname__}(): {exc}") from None
        return False

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
        """Global module hooks (``register_module_forward_hook``) run around every
        submodule call in eager; the replayed graphs inlined the submodules without
        them. Never replay then: run the original function (a counted fallback)."""
        if not self._eager_counted:
            self._eager_counted = True
            record_fallback("global module hooks registered (run eagerly)")
            log.warning("npu_cached: %s: global module hooks are registered (register_module_forward_hook, "
                        "register_module_full_backward_hook...); they run around every submodule, which the cached "
                        "graphs inlined without them: it runs eagerly while they are registered", self.__qualname__)
        module = self._module
        if module is not None and module.__dict__.get("forward") is not self:
            instance = module.__dict__
            previous = instance.pop("forward", _MISSING)  # our own dispatch lambda, when called from the hooks path
            try:
                return module(*args, **kwargs)
            finally:
                if previous is not _MISSING:
                    instance["forward"] = previous
        if self._original is None:
            return self._dispatch(args, kwargs)
        return self._original(*self._prefix, *args, **kwargs)

    def _fall_back(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._compiled is None:
            if self._miss is None:  # (a miss was counted and logged by load())
                reasons = self._why_no_variant(args, kwargs)
                record_fallback("no cached variant matches the call")
                log.warning(
                    "npu_cached: %s: no cached variant fits this call (%s); compiling it with Dynamo (the cache "
                    "gains this variant)", self.__qualname__, "; ".join(reasons[:3]) or "no variant",
                )
            self._compiled = self._fallback_factory()
        return self._compiled(*args, **kwargs)

    def _why_no_variant(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
        reasons = []
        for variant in self._variants:
            if variant.checks is not None:
                full = variant.check is variant.checks.full
                failed = variant.checks.call_failures((*self._prefix, *args), kwargs, full)
                reasons.append(failed[0] if failed else "a guard failed")
        return reasons


#: the graph-break stand-ins (``replay_resume``): imported with the first program that has a graph break
_RESUME = frozenset({"ResumeDispatch", "ResumeFactory", "ResumeRouter"})


def __getattr__(name: str) -> Any:
    if name in _RESUME:
        from . import replay_resume

        return getattr(replay_resume, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
