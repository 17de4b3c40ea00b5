"""The graph-level cache key: every factor that can change a compiled result.

Factors are kept as a readable dict (stored beside each entry so a miss can be
explained factor by factor); the key is the sha256 of their canonical JSON.
Three groups, all top-level keys of ``factors``:

* :func:`context_factors` - the compiler, its options and everything it reads
  from the process (versions, thread count, ISA, configs, custom passes...):
  recomputed by the bypass loader at every warm load to verify each graph;
* :func:`runtime_state_factors` - global state a call can change (grad mode,
  autocast, default dtype, deterministic algorithms): checked per call;
* the graph itself (every subgraph included) and its inputs.

This module holds what a warm load re-checks (the context, the digest, the
graph's call targets); what only a compile computes (the graph's and its inputs'
factors, :func:`compute_key`) is in ``key_graph`` and re-exported here on first use.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from .environment import environment_factors

if TYPE_CHECKING:
    from .compilers.base import InnerCompiler
    from .options import BackendOptions

#: bump when the on-disk layout or artifact meaning changes
FORMAT_VERSION = 2


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def digest(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def stale_call_targets(recorded: dict[str, dict[str, Any]] | None) -> list[str]:
    """The recorded call targets (:func:`call_target_factors`) that compute something
    else in this process (empty: all the same)."""
    stale = []
    for name, item in (recorded or {}).items():
        now: str | None = None
        try:
            if item.get("kind") == "function":
                import importlib

                obj: Any = importlib.import_module(item["module"])
                for part in str(item["qualname"]).split("."):
                    obj = getattr(obj, part)
                from .key_graph import function_description

                now = digest(function_description(obj))
            elif item.get("kind") == "tensor_method":
                now = digest(tensor_method_description(item["method"]))
            elif item.get("kind") == "op":
                import torch

                ns, opname = item["op"].split("::", 1)
                op = getattr(getattr(getattr(torch.ops, ns), opname), item.get("overload") or "default")
                from .key_graph import _decomposition_digest

                now = _decomposition_digest(op, item.get("args", []), item.get("kwargs", {}))
        except Exception as exc:  # noqa: BLE001 - it is gone: as stale as an edit
            stale.append(f"{name} can no longer be found ({type(exc).__name__}: {exc})")
            continue
        if now != item.get("digest"):
            stale.append(f"{name} (called by the graph) was edited")
    return stale


def storage_groups(tensors: Any) -> tuple[int, ...]:
    """Which of ``tensors`` share memory (views of one tensor): for each, the index of the first one
    with its storage. A graph is compiled for the sharing of its inputs (AOTAutograd reads a view
    the graph changes through its base only when it sees the base shared)."""
    first: dict[Any, int] = {}
    out = []
    for i, t in enumerate(tensors):
        try:
            key: Any = (t.device, t.untyped_storage().data_ptr())
        except Exception:  # noqa: BLE001  (no storage of its own: a subclass, a sparse tensor) by identity
            key = id(t)
        out.append(first.setdefault(key, i))
    return tuple(out)


def tensor_method_description(name: str) -> str:
    """What ``tensor.<name>(...)`` resolves to on torch.Tensor, which a graph's ``call_method`` node
    names only: a built-in or a library's function by its name (the library's version is in every
    key), a user's function set on torch.Tensor by what it computes (the compiled graph holds what it
    did when traced; Dynamo neither inlines nor guards it)."""
    import inspect
    import types

    import torch

    raw = inspect.getattr_static(torch.Tensor, name, None)
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if isinstance(fn, types.FunctionType):
        from .bypass.sources import is_library_file

        if fn.__code__.co_filename.startswith("<") or not is_library_file(fn.__code__.co_filename):
            from .key_graph import function_description

            return "function:" + digest(function_description(fn))
    return (f"{type(raw).__module__}.{type(raw).__qualname__}:"
            f"{getattr(raw, '__module__', None)}.{getattr(raw, '__qualname__', None)}")


def decomposition_factors(decomps: dict[Any, Any] | None) -> dict[str, str] | None:
    """Each custom decomposition by its code and bound values (partials, closures)."""
    if not decomps:
        return None
    from .fingerprint import callable_digest

    return {str(op): callable_digest(fn) for op, fn in sorted(decomps.items(), key=lambda kv: str(kv[0]))}


def context_factors(compiler: InnerCompiler, options: BackendOptions) -> dict[str, Any]:
    """Every key factor that depends on neither the graph nor per-call state.

    ``compute_key`` puts exactly these at the top level of ``factors``, so a
    loader verifies a stored graph with
    ``all(manifest["factors"][k] == v for k, v in context_factors(...).items())``.
    Cheap after the first call in a process (what cannot change is memoized by
    the parts below); never imports Dynamo or Inductor, never compiles.
    """
    from .bypass.program import _config_snapshot

    return {
        "format": FORMAT_VERSION,
        "compiler": compiler.name,
        "compiler_factors": compiler.hash_factors(options),
        "config": _config_snapshot(options.config),
        "ge_cache": bool(options.ge_cache),
        "decompositions": decomposition_factors(options.custom_decompositions),
        "environment": environment_factors(),
    }


def explain_difference(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable list of factor paths that differ between two factor dicts."""
    diffs: list[str] = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        path = f"{prefix}{name}"
        if isinstance(a, dict) and isinstance(b, dict):
            diffs.extend(explain_difference(a, b, path + "."))
        elif a != b:
            diffs.append(f"{path}: {a!r} -> {b!r}")
    return diffs


#: computed by a compile only (``key_graph``): imported on first use, never by a warm load
_COMPILE_SIDE = frozenset({
    "compute_key", "graph_factors", "input_factors", "call_target_factors", "function_description",
    "tensor_meta", "tensor_digest", "module_tensor_factors", "training_factors", "TRAINING_FORMAT",
    "runtime_state_factors", "autocast_state", "deterministic_state",
})


def __getattr__(name: str) -> Any:
    if name in _COMPILE_SIDE:
        from . import key_graph

        return getattr(key_graph, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
