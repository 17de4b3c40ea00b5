"""What a traced frame changes in place, kept past Dynamo's cleanup for the capture.

Dynamo forgets the existing objects a frame changes (``SideEffects.clear``, in the tracer's
cleanup) before the bytecode hook runs; only attribute stores survive there. A container the
frame changes in place (``self.log.append(1)``, a global dict it sets an item of) was then
invisible to the capture, which filed the guard on its length or contents as a load-time one:
a warm ``load()`` replayed the first call's variant at every later call, silently wrong. While
an ``npu_cached`` trace runs (``trace_ids.active``), the sources of those objects are kept on
the tracker (:data:`ATTR`) before it is cleared; other backends' traces are untouched.
"""

from __future__ import annotations

import functools
from typing import Any

from . import trace_ids

#: the tracker's attribute: source names of existing objects the frame changed, or :data:`UNKNOWN`
ATTR = "_npu_cached_modified"
#: what is kept when the tracker could not be read (the capture then caches nothing of the frame)
UNKNOWN = ("<unknown>",)


def install() -> None:
    """Wrap ``SideEffects.clear`` once per process (inert outside an ``npu_cached`` trace)."""
    from torch._dynamo.side_effects import SideEffects

    original = SideEffects.clear
    if getattr(original, "_tcb_trace_mutations", False):
        return

    @functools.wraps(original)
    def clear(self: Any) -> None:
        if trace_ids.active():
            try:
                found = modified_sources(self)
            except Exception:  # noqa: BLE001  (unreadable: the capture must not guess)
                found = UNKNOWN
            setattr(self, ATTR, getattr(self, ATTR, ()) + found)
        original(self)

    clear._tcb_trace_mutations = True  # type: ignore[attr-defined]
    SideEffects.clear = clear


def modified_sources(side_effects: Any) -> tuple[str, ...]:
    """Source names of the existing objects (lists, dicts, sets...) ``side_effects`` saw changed."""
    out = []
    for var in list(side_effects.id_to_variable.values()):
        if type(getattr(var, "mutation_type", None)).__name__ != "ValueMutationExisting":
            continue
        if not side_effects.is_modified(var):
            continue
        name = source_name(var)
        if name is None:  # an existing object the frame changed but no guard can name: unknown
            return UNKNOWN
        out.append(name)
    return tuple(out)


def source_name(var: Any) -> str | None:
    """The name of ``var``'s source (``L['self'].log``), None when it has none."""
    try:
        name = getattr(getattr(var, "source", None), "name", None)
        if callable(name):
            name = name()
    except Exception:  # noqa: BLE001
        return None
    return name if isinstance(name, str) else None
