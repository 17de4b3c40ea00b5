"""Process state Dynamo folds into a graph as constants, without a guard of its own.

``dist.get_rank()``, ``dist.get_world_size()``, ``dist.is_initialized()``,
``os.environ.get("X")`` / ``os.getenv("X")``, ``hash(str)`` and the
``torch.backends.cuda.matmul`` flags (``allow_tf32``...) are evaluated
while tracing and their values baked into the graph; Dynamo installs no guard
for them (in-process they cannot change under a compiled frame). A warm start in
another process can differ in all of them, so capture scans the code the frame
traced for these reads and records checks on the values (``guard_capture``), or
refuses the frame when no portable check exists (``hash`` of a string, which is
randomized per process unless ``PYTHONHASHSEED`` fixes it).
"""

from __future__ import annotations

import dis
import os
import re
import types
from dataclasses import dataclass, field

#: torch.distributed functions whose result is the process group's state
DIST_FUNCTIONS = frozenset({
    "get_rank", "get_world_size", "is_initialized", "get_global_rank", "get_node_local_rank",
    "get_process_group_ranks", "get_group_rank", "get_backend", "is_available",
})
#: of those, the names specific enough to look for in bytecode (``is_available`` is also CUDA's...)
_DIST_NAMES = DIST_FUNCTIONS - {"is_available", "get_backend"}
_ENV_NAMES = frozenset({"environ", "getenv", "environb", "getenvb"})
#: ``torch.backends.cuda.matmul`` flags: properties of a module object, read through C calls Dynamo
#: folds without a guard (``torch.backends.cudnn``'s are plain module attributes, which it guards)
MATMUL_FLAGS = frozenset({
    "allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction",
    "allow_fp16_accumulation", "fp32_precision",
})
#: modules whose attributes are process-wide switches (``torch.backends.mkldnn.enabled``,
#: ``torch.backends.mha``'s fast path, ``torch.utils.deterministic.fill_uninitialized_memory``): a user
#: flips them around a call (``with torch.backends.mkldnn.flags(enabled=False):``) and Dynamo guards them
#: on every call, so a guard on one is a per-call check (``guard_capture``)
SWITCH_MODULES = ("torch.backends.", "torch.utils.deterministic")


def is_switch_module(value: object) -> bool:
    """Whether ``value`` is one of :data:`SWITCH_MODULES` (or a module below ``torch.backends``)."""
    name = getattr(value, "__name__", None) if isinstance(value, types.ModuleType) else None
    return isinstance(name, str) and (name.startswith(SWITCH_MODULES[0]) or name == SWITCH_MODULES[1])


_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM", "LOAD_DEREF"})
_ENV_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


@dataclass
class StateReads:
    """What a frame's traced code reads of the process state."""

    dist: bool = False
    env: set[str] = field(default_factory=set)
    hash_str: bool = False
    #: the environment is read, under no name found as a constant of the traced code
    env_unnamed: bool = False
    #: ``torch.backends.cuda.matmul`` flags the traced code may read (by attribute name)
    matmul: set[str] = field(default_factory=set)


def _walk(code: types.CodeType, seen: set[int]) -> list[types.CodeType]:
    out = []
    stack = [code]
    while stack:
        c = stack.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        out.append(c)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return out


def process_state_reads(codes: list[types.CodeType], values: list[object]) -> StateReads:
    """What the frame read: ``values`` are the objects Dynamo guarded (every function it
    called is among them: ``hash``, ``os.getenv``, ``dist.get_rank``...); ``codes`` are
    scanned (with the code nested in them) for the names of environment variables and
    for torch.distributed calls."""
    import builtins

    import torch

    reads = StateReads()
    dist_fns = {id(getattr(torch.distributed, n, None)) for n in DIST_FUNCTIONS} - {id(None)}
    env_objects = {id(os.environ), id(os.getenv), id(getattr(os, "environb", None)), id(getattr(os, "getenvb", None))}
    env_used = False
    for value in values:
        if value is builtins.hash:
            reads.hash_str = True
        elif id(value) in dist_fns:
            reads.dist = True
        elif id(value) in env_objects:
            env_used = True
    seen: set[int] = set()
    for root in codes:
        for code in _walk(root, seen):
            attrs = {ins.argval for ins in dis.get_instructions(code) if ins.opname in _LOADS and isinstance(ins.argval, str)}
            if attrs & _DIST_NAMES:
                reads.dist = True
            if "matmul" in attrs:  # ``torch.backends.cuda.matmul.<flag>``: the flags it names, to be safe
                reads.matmul.update(attrs & MATMUL_FLAGS)
            if attrs & _ENV_NAMES:
                reads.env.update(c for c in code.co_consts if isinstance(c, str) and _ENV_VAR.fullmatch(c))
    reads.env_unnamed = env_used and not reads.env
    return reads


def fixed_hash_seed() -> str | None:
    """PYTHONHASHSEED when it fixes ``hash(str)`` across processes (an integer), else None."""
    seed = os.environ.get("PYTHONHASHSEED")
    return seed if seed is not None and seed.isdigit() else None
