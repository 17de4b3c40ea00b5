"""Resume groups: how a replay stands in for Dynamo's resume functions after a graph break.

Each function takes the ``loader._ReplayBuilder`` building the program (``builder``):
the group's transformed variants with their checks, the original continuation, and
how a call no variant fits is compiled. Imported only by programs with graph breaks.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from ..logs import log
from .loader import _Rejected
from .replay import always
from .replay_resume import ResumeDispatch, ResumeFactory, ResumeRouter, as_python, note_compiled_resume


def build_resume(builder: Any, origin: str, global_name: str = "") -> Any:
    """The stand-in for resume function ``origin``: its usable variants (newest first), the
    original continuation, and the compile of a call none fits; routed by receiver if need be."""
    group = builder.program.get("resumes", {}).get(origin)
    if group is None:
        raise _Rejected(f"resume function {origin} is missing from the program")
    eager = builder._code(group["code"])
    variants: list[tuple[Callable[..., bool], types.CodeType]] = []
    for fid in group.get("frames", []):
        frame = builder.frames.get(fid)
        try:
            if frame is None:
                raise _Rejected("frame missing")
            builder._frame_usable(frame)
            checks = builder._checks(frame, resume=True)
            for name, value in builder._globals(frame).items():
                builder.scope[name] = value
        except _Rejected as exc:
            log.info("npu_cached: a cached variant after a graph break (%s) is not used: %s", group["name"], exc)
            continue
        code = builder._code(frame["code"])
        variants.append((always if checks is None else builder._per_call(checks), code))
    variants.reverse()  # newest first
    if group.get("python") and not group.get("frames"):  # Dynamo compiled nothing in it at cold
        compile_: Callable[[Any], Callable[..., Any]] = as_python(group["name"])
    else:
        compile_ = _resume_compiler(builder, group, origin)
    if group.get("factory"):
        dispatch: Any = ResumeFactory(variants, eager, builder.scope, group["name"], compile_)
    else:
        dispatch = ResumeDispatch(variants, eager, builder.scope, group["name"], compile_)
    return _routed(builder, group, eager, dispatch, global_name)


def _receiver_ref(builder: Any, fids: list[str]) -> str | None:
    for fid in fids:
        receiver = ((builder.frames.get(fid) or {}).get("guards") or {}).get("receiver")
        if receiver:
            return receiver
    return None


def _resume_compiler(builder: Any, group: dict[str, Any], origin: str) -> Callable[[Any], Callable[..., Any]]:
    """How a continuation no cached variant fits is served: compiled by Dynamo with
    this program's options, its frame joining this program's resume group (so the
    next start replays it)."""
    options, key, program, files = builder.options, builder.key, builder.program, builder.files
    roots = [v["root"] for v in program.get("variants", [])]
    receiver = _receiver_ref(builder, roots + list(group.get("frames", [])))

    def compile_(fn: Any) -> Callable[..., Any]:
        import torch

        from ..backend import make_backend
        from .capture import adopt_resume

        note_compiled_resume(group["name"])
        backend = make_backend(**{k: v for k, v in options.as_dict().items() if v is not None})
        adopt_resume(options.cache_dir, key, program, group, origin, fn.__code__, files[group["code"]], receiver,
                     options.max_variants)
        return torch.compile(fn, backend=backend, dynamic=options.dynamic)

    return compile_


def _routed(builder: Any, group: dict[str, Any], eager: types.CodeType, dispatch: Any, global_name: str) -> Any:
    """The resume global is one name in the module's globals: when its variants check
    this receiver, route by receiver, so every instance's replay keeps its own. Under
    ``guards="call"`` they check everything per call against the receiver passed (none is
    fixed): one dispatch serves every instance (the backend route installs one replayed
    code for all the layers of a model, whose continuations then call this one global)."""
    if builder.options.guards == "call":
        return dispatch
    receiver = None
    for fid in group.get("frames", []):
        receiver = ((builder.frames.get(fid) or {}).get("guards") or {}).get("receiver") or receiver
    if builder.bound_self is None or receiver is None or not receiver.endswith("']"):
        return dispatch
    name = receiver.split("'")[1]
    if name not in eager.co_varnames[: eager.co_argcount]:
        return dispatch
    index = eager.co_varnames.index(name)
    router = builder.scope.get(global_name)
    if not (isinstance(router, ResumeRouter) and router.index == index and router.eager == eager):
        router = ResumeRouter(index, bool(group.get("factory")), eager, builder.scope, group["name"])
    try:
        router.add(builder.bound_self, dispatch)
    except TypeError:  # a receiver without weak references: one dispatch, as before
        return dispatch
    return router
