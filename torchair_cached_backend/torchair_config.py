"""Read a torchair ``CompilerConfig`` as plain data, without importing torchair.

Used for cache keys (every leaf option counts; custom passes by a digest of
their code) and for ``cache_compile``'s config/backend consistency check.
"""

from __future__ import annotations

from typing import Any

from .key import function_digest


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
    if callable(config) and not hasattr(config, "__dict__") or hasattr(config, "__code__"):
        return {"callable": function_digest(config)}
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
