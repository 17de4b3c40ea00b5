"""Read a torchair ``CompilerConfig`` as plain data, without importing torchair.

Used for cache keys (every leaf option counts; custom passes by a digest of
their code and bound values: a ``functools.partial`` or a callable object is
described by what it calls *and* what it carries) and for ``cache_compile``'s
config/backend consistency check.
"""

from __future__ import annotations

from typing import Any

from .fingerprint import describe_callable


def config_snapshot(config: Any, _depth: int = 0) -> Any:
    """Every leaf option of a CompilerConfig-like tree, as JSON-able data."""
    if config is None or isinstance(config, (bool, int, float, str)):
        return config
    if _depth > 8:
        return repr(config)
    if isinstance(config, (list, tuple)):
        return [config_snapshot(v, _depth + 1) for v in config]
    if isinstance(config, dict):
        return {str(k): config_snapshot(v, _depth + 1) for k, v in sorted(config.items(), key=lambda kv: str(kv[0]))}
    if callable(config) and not _is_option_node(config):
        return {"callable": describe_callable(config)}
    value = getattr(config, "value", None)
    if hasattr(config, "value") and not hasattr(config, "_fixed_attrs") and not callable(value):
        return config_snapshot(value, _depth + 1)
    attrs = getattr(config, "__dict__", None)
    if attrs is None:
        return repr(config)
    return {
        k: config_snapshot(v, _depth + 1)
        for k, v in sorted(attrs.items())
        if not k.startswith("__") and k not in ("_fixed_attrs",)
    }


def _is_option_node(obj: Any) -> bool:
    """A torchair config object or option value (walked), not a user callable (digested)."""
    return hasattr(obj, "_fixed_attrs") or (hasattr(obj, "value") and hasattr(obj, "_value"))


_default_snapshots: dict[type, Any] = {}


def normalized_config_snapshot(config: Any) -> Any:
    """:func:`config_snapshot`, with ``None`` for a config equal to its class's default:
    ``config=None`` and ``config=CompilerConfig()`` mean the same to torchair, so they
    give one key and one ``model_info`` directory."""
    if config is None:
        return None
    snap = config_snapshot(config)
    return None if snap == default_config_snapshot(type(config)) else snap


_NO_DEFAULT = object()


def default_config_snapshot(cls: type) -> Any:
    """The snapshot of ``cls()`` (memoized: a default config never changes in a process)."""
    if cls not in _default_snapshots:
        try:
            _default_snapshots[cls] = config_snapshot(cls())
        except Exception:  # noqa: BLE001 - no default constructor: nothing to compare with
            _default_snapshots[cls] = _NO_DEFAULT
    return _default_snapshots[cls]


def config_mode(config: Any) -> str:
    """The graph mode: ``max-autotune`` (GE) or ``reduce-overhead``/``npugraph_ex`` (aclgraph)."""
    if config is None:
        return "max-autotune"
    mode = getattr(config, "mode", None)
    mode = getattr(mode, "value", mode)
    return str(mode) if mode else "max-autotune"


def is_aclgraph_mode(config: Any) -> bool:
    return config_mode(config) in ("reduce-overhead", "npugraph_ex")


def backend_config(backend: Any) -> Any:
    """The CompilerConfig inside a backend: torchair's ``get_npu_backend()``
    partial, or one of ours (``make_backend``); None if it carries none."""
    keywords = getattr(backend, "keywords", None)
    if isinstance(keywords, dict) and "compiler_config" in keywords:
        return keywords["compiler_config"]
    options = getattr(backend, "options", None)
    if options is not None and hasattr(options, "config"):
        return options.config
    return getattr(backend, "compiler_config", None)


def backend_decompositions(backend: Any) -> dict[Any, Any] | None:
    keywords = getattr(backend, "keywords", None)
    if isinstance(keywords, dict):
        return keywords.get("decompositions") or None
    options = getattr(backend, "options", None)
    return getattr(options, "custom_decompositions", None)
