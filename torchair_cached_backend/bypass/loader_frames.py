"""The backend route's use of the loader (``frame_install``): a frame's variants as
:func:`~.loader.build_replay` builds them, for Dynamo's frame cache to serve. ``tcb.load``
never imports this module."""

from __future__ import annotations

import time
import types
from typing import Any

from ..options import BackendOptions
from ..stats import record
from .loader import CacheMiss, _cached_program, _Rejected, _ReplayBuilder
from .replay import Variant


def build_frame_variants(
    func: types.FunctionType, bound_self: Any, options: BackendOptions
) -> tuple[list[Variant], dict[str, Any], dict[str, str]]:
    """For the backend route (``frame_install``): the variants :func:`build_replay` serves for
    ``func`` bound to ``bound_self`` (same key, same checks), without a ``ReplayedFunction``,
    fallback or callee installation (Dynamo's frame cache serves those); plus the program and
    the kind of every global its frames read. An empty list with ``program["eager_root"]``: the
    frame runs as Python. Raises :class:`CacheMiss` saying why."""
    t0 = time.perf_counter()
    key, files, program, name = _cached_program(func, bound_self, options)
    builder = _ReplayBuilder(files, program, options, func, bound_self, key)
    variants, rejected = [], []
    for variant in reversed(program.get("variants", [])):
        if (builder.frames.get(variant.get("root")) or {}).get("wrapper"):
            rejected.append("it was compiled through a wrapper frame")
            continue
        try:
            variants.append(builder.variant(variant))
        except _Rejected as exc:
            rejected.append(str(exc))
    if not variants and not (program.get("eager_root") and not rejected):
        raise CacheMiss(f"cached program for {name} does not fit: {' | '.join(dict.fromkeys(rejected)) or 'no variant'}")
    kinds = {g: d.get("kind", "") for f in builder.frames.values() for g, d in f.get("globals", {}).items()}
    kinds.update({ours: "callee" for ours in builder.renames.values()})
    record(bypass_loads=1, load_seconds=time.perf_counter() - t0)
    return variants, program, kinds
