"""A replayed call that does not replay: what ``ReplayedFunction`` does (rarely) when no
variant fits the call (compile it with Dynamo, saying why), when global module hooks are
registered (run the function eagerly) or when the arguments do not bind (the caller's
error). Kept out of ``replay``, which a warm start imports and runs on every call."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..logs import log
from ..stats import record_fallback
from .signature import InputSignatureError

if TYPE_CHECKING:
    from .guard_runtime import GuardChecks
    from .replay import ReplayedFunction

_MISSING = object()


def binds(replay: ReplayedFunction, checks: GuardChecks, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """False when the arguments bind to the function's parameters (the TypeError was a guard's
    that does not apply); else the caller's error, raised as the function would."""
    try:
        checks.bind(*replay._prefix, *args, **kwargs)
    except TypeError as exc:
        raise InputSignatureError(f"{replay.__qualname__}(): {exc}") from None
    return False


def call_eagerly_for_global_hooks(replay: ReplayedFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Global module hooks (``register_module_forward_hook``) run around every
    submodule call in eager; the replayed graphs inlined the submodules without
    them. Never replay then: run the original function (a counted fallback)."""
    if not replay._eager_counted:
        replay._eager_counted = True
        record_fallback("global module hooks registered (run eagerly)")
        log.warning("npu_cached: %s: global module hooks are registered (register_module_forward_hook, "
                    "register_module_full_backward_hook...); they run around every submodule, which the cached "
                    "graphs inlined without them: it runs eagerly while they are registered", replay.__qualname__)
    module = replay._module
    if module is not None and module.__dict__.get("forward") is not replay:
        instance = module.__dict__
        previous = instance.pop("forward", _MISSING)  # our own dispatch lambda, when called from the hooks path
        try:
            return module(*args, **kwargs)
        finally:
            if previous is not _MISSING:
                instance["forward"] = previous
    if replay._original is None:
        return replay._dispatch(args, kwargs)
    return replay._original(*replay._prefix, *args, **kwargs)


def compile_fallback(replay: ReplayedFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """The function compiled with Dynamo (the cache gains the call's variant); counted and
    logged with why no variant fits, unless ``load()`` already counted a miss."""
    if replay._miss is None:
        reasons = _why_no_variant(replay, args, kwargs)
        record_fallback("no cached variant matches the call")
        log.warning(
            "npu_cached: %s: no cached variant fits this call (%s); compiling it with Dynamo (the cache "
            "gains this variant)", replay.__qualname__, "; ".join(reasons[:3]) or "no variant",
        )
    return replay._fallback_factory()


def _why_no_variant(replay: ReplayedFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    reasons = []
    for variant in replay._variants:
        if variant.checks is not None:
            full = variant.check is variant.checks.full
            failed = variant.checks.call_failures((*replay._prefix, *args), kwargs, full)
            reasons.append(failed[0] if failed else "a guard failed")
    return reasons
