"""State a replayed frame depends on that no guard of Dynamo's names portably.

* ``origin``: what an object reached by its import path is. Dynamo guards a library
  function (``torch.nn.functional.silu``, ``torch.relu``) by its id; we find it again by
  its path, which also finds a replacement assigned there (a monkeypatch) - so the
  object's own type, name and code location are compared too.
* ``user_dispatch_mode``: a ``TorchDispatchMode`` is active. Dynamo does not compile
  under one (the frame runs eagerly, through the mode); a compiled graph (Inductor's
  kernels) would bypass it.
* ``process_group_state`` / ``device_mesh_state``: a process group or DeviceMesh the frame read
  (``dist.get_rank(group)``, ``group.size()``, ``mesh.get_local_rank("tp")``); Dynamo bakes
  ranks and sizes into the graph and guards only the object's type.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch

_ORIGINS: dict[int, tuple[Any, tuple[Any, ...]]] = {}


def origin(obj: Any) -> tuple[Any, ...]:
    """(type, ``__module__``, ``__qualname__``, where its code is defined) of ``obj``,
    memoized per object (checked on every call under ``guards="call"``)."""
    hit = _ORIGINS.get(id(obj))
    if hit is not None and hit[0] is obj:
        return hit[1]
    t = type(obj)
    try:
        code = getattr(obj, "__code__", None)
        where = None
        if isinstance(code, types.CodeType):
            where = (code.co_qualname, os.path.basename(code.co_filename), code.co_firstlineno)
        module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", getattr(obj, "__name__", None))
    except Exception:  # an object whose attributes cannot be read: compared by its type alone
        module = name = where = None
    found = (f"{t.__module__}.{t.__qualname__}", module if isinstance(module, str) else None,
             name if isinstance(name, str) else None, where)
    _ORIGINS[id(obj)] = (obj, found)
    return found


def origins_changed(objects: tuple[Any, ...], expected: tuple[Any, ...], names: tuple[str, ...]) -> list[str]:
    """The names of ``objects`` whose :func:`origin` is not the one expected."""
    return [name for obj, want, name in zip(objects, expected, names, strict=True) if origin(obj) != want]


def once(check: Any) -> bool:
    """``check()`` evaluated once per check namespace (a loaded frame's checks, whose
    constants never change after decoding): a generated ``lambda`` over those constants.
    The result is kept in that namespace (it lives as long as the checks do)."""
    namespace = check.__globals__
    memo = namespace.get("___once_memo")
    if memo is None:
        memo = namespace["___once_memo"] = {}
    code = check.__code__
    hit = memo.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    result = bool(check())
    memo[id(code)] = (code, result)
    return result


def user_dispatch_mode() -> bool:
    """Whether a TorchDispatchMode Dynamo would not compile under is active (its own test:
    infra modes and modes that ignore compile internals do not count)."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    from torch.utils._python_dispatch import any_torch_dispatch_mode_on_stack

    return bool(any_torch_dispatch_mode_on_stack())


def is_process_group(value: Any) -> bool:
    dist = torch.distributed
    return dist.is_available() and isinstance(value, dist.ProcessGroup)


def process_group_state(group: Any) -> tuple[Any, ...]:
    """What Dynamo folds in of a process group: its rank and size, plus the global ranks it
    spans, its backend, name and description (a functional collective names the group)."""
    if not is_process_group(group):
        return ("not a process group", type(group).__qualname__)
    dist = torch.distributed
    try:
        ranks = tuple(dist.get_process_group_ranks(group))
    except Exception:  # not registered in this process's world
        ranks = None
    try:
        backend = group._get_backend_name()
    except Exception:
        backend = None
    return (group.rank(), group.size(), ranks, backend, group.group_name, group.group_desc)


def is_device_mesh(value: Any) -> bool:
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    mesh_type = getattr(mesh_module, "DeviceMesh", None)
    return mesh_type is not None and isinstance(value, mesh_type)


def device_mesh_state(mesh: Any) -> tuple[Any, ...]:
    """What Dynamo folds in of a DeviceMesh (``get_local_rank``, ``size``, ``get_coordinate``
    and its submeshes are evaluated while tracing): the ranks it lays out and their shape,
    its device type and dim names, this rank's coordinate, and each dim's process group.
    (Dynamo's own guard function also compares the creating thread's id, which means
    nothing in another process.)"""
    if not is_device_mesh(mesh):
        return ("not a device mesh", type(mesh).__qualname__)
    ranks = mesh.mesh
    coordinate = mesh.get_coordinate()
    groups = tuple(process_group_state(mesh.get_group(i)) for i in range(ranks.dim()))
    return (tuple(ranks.flatten().tolist()), tuple(ranks.shape), mesh.device_type, mesh.mesh_dim_names,
            None if coordinate is None else tuple(coordinate), groups)


HELPERS: dict[str, Any] = {
    "___origin": origin,
    "___origins_changed": origins_changed,
    "___once": once,
    "___dispatch_len": torch._C._len_torch_dispatch_stack,
    "___user_dispatch_mode": user_dispatch_mode,
    "___pg_state": process_group_state,
    "___mesh_state": device_mesh_state,
}
