"""A *program*: what the guard-bypass loader replays for one function.

One program per (function, its code, receiver type, inner compiler, compiler
options, versions). It holds:

* ``frames``: Dynamo's transformed bytecode of each compiled frame (root frames
  and resume frames after graph breaks), with Dynamo's numbered globals renamed
  to content-derived ``___tcb_*`` names, what each of those stands for (a
  cached graph by key, a module, builtins, a resume function, a value), the
  frame's guards (see ``guard_capture``) and the fingerprints of the user code
  it traced. Frame ids are content digests, so the same frame captured by two
  processes is one frame.
* ``variants``: root frames, each served when its guards hold (one per
  recompile: shapes, grad mode, attribute values, instances...).
* ``resumes``: per original resume function, its transformed variants and its
  original code, which runs eagerly when no variant's guards hold.

Programs grow by merging (``program_merge``, re-exported here; a warm load never
merges): a process that compiles a new variant adds it to what is on disk (under
the entry's lock); nothing another process recorded is lost. Beyond the ``max_variants`` option (default 16) the least recently added
variants go, but never one this process replayed or compiled (so a start that
serves more static buckets than the bound keeps them all: the cache settles).
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

from .. import key as keys
from ..environment import environment_factors
from ..store import Store

PROGRAMS = "programs"
#: bumped when the program layout changes; older programs are never replayed (3: guards
#: format 4, code fingerprints version 2)
PROGRAM_FORMAT = 3
#: the default bound (option ``max_variants``): beyond it the oldest variants not used by this process go
MAX_VARIANTS = 16
#: (cache dir, program key) -> root frame ids of variants this process replayed (never evicted by its merges)
_used: dict[tuple[str, str], set[str]] = {}


def note_used(program: tuple[str, str], root: str) -> None:
    """Called once per replayed variant, on its first call."""
    _used.setdefault(program, set()).add(root)


def used_roots(cache_dir: str, key: str) -> set[str]:
    return _used.get((cache_dir, key), set())


def function_identity(code: types.CodeType, module: str | None, receiver_type: str | None = None) -> dict[str, Any]:
    """What names the function across processes. A method's receiver type is part
    of it: a decorator's wrapper (one code object for many models) is one
    program per model class, not one shared by all."""
    return {
        "module": module,
        "qualname": getattr(code, "co_qualname", code.co_name),
        "name": code.co_name,
        "receiver_type": receiver_type,
    }


def target_identity(func: Any, bound: Any) -> dict[str, Any]:
    """The identity of what ``load(target)`` replays: its function and receiver. A plain
    function wrapped by a torch decorator (``@torch.no_grad()``: one wrapper code for all)
    is named by what it wraps too, so two such functions never share a program."""
    code = func.__code__
    identity = function_identity(code, func.__globals__.get("__name__"), type_path(bound))
    torch = sys.modules.get("torch")
    if bound is None and getattr(func, "__wrapped__", None) is not None and torch is not None:
        if code.co_filename.startswith(os.path.dirname(torch.__file__) + os.sep):
            identity["qualname"] += f"[{func.__module__}.{func.__qualname__}]"
    return identity


def type_path(obj: Any) -> str | None:
    if obj is None:
        return None
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}" + (":class" if isinstance(obj, type) else "")


def options_factors(options: Any) -> dict[str, Any]:
    """Compiler options that change what is compiled (so a ``load()`` without the
    ``custom_decompositions`` a program was built with never replays it)."""
    return {
        "config": _config_snapshot(options.config),
        "ge_cache": bool(options.ge_cache),
        "decompositions": keys.decomposition_factors(options.custom_decompositions),
    }


def _config_snapshot(config: Any) -> Any:
    """``torchair_config.normalized_config_snapshot``, imported only when there is a config."""
    if config is None:
        return None
    from ..torchair_config import normalized_config_snapshot

    return normalized_config_snapshot(config)


#: a program key's first hex digits name its function (module, qualname, receiver type) and inner
#: compiler alone: a miss finds the entries of an edited version of the function by their names, without
#: reading every other program's manifest (a warm start's misses were O(entries): 0.37 s each at 2000)
FUNCTION_PREFIX = 16


def _function_factors(identity: dict[str, Any], compiler: str) -> dict[str, Any]:
    """What names a program's function and inner compiler (the prefix's and the key's own factors)."""
    return {
        "format": [keys.FORMAT_VERSION, PROGRAM_FORMAT],
        "function": [identity["module"], identity["qualname"], identity.get("receiver_type")],
        "compiler": compiler,
    }


def function_prefix(identity: dict[str, Any], compiler: str) -> str:
    """The first :data:`FUNCTION_PREFIX` hex digits of every program key of this function and compiler."""
    return keys.digest(_function_factors(identity, compiler))[:FUNCTION_PREFIX]


def program_key(identity: dict[str, Any], root_fingerprint: str, compiler: str, options: Any) -> str:
    """Depends on the function, its own code, the receiver type, the inner compiler,
    its options and the versions; edits to *inlined* helpers are caught by the
    stored fingerprints and guards instead. Its first digits are :func:`function_prefix`."""
    return function_prefix(identity, compiler) + keys.digest(
        {
            **_function_factors(identity, compiler),
            "code": root_fingerprint,
            "options": options_factors(options),
            "environment": environment_factors(),
        }
    )[FUNCTION_PREFIX:]


def program_store(cache_dir: str) -> Store:
    return Store(cache_dir, PROGRAMS)


def __getattr__(name: str) -> Any:
    if name == "merge_programs":  # the write side (``program_merge``): a warm load never merges
        from .program_merge import merge_programs

        return merge_programs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
