"""torchair_cached_backend: ``torch.compile`` that starts fast, on Ascend NPUs and elsewhere.

* ``torch.compile(model, backend="npu_cached", options={...})`` caches compiled graphs on disk;
* :func:`load` warm-starts a function from that cache without Dynamo (no tracing, no guards);
* :func:`cache_compile` is a drop-in for ``torchair.inference.cache_compile``.

Importing this package is cheap: Dynamo, Inductor and torchair load on first use.
"""

from __future__ import annotations

import os as _os
from typing import Any

from .registry import BACKEND_NAME, register, register_if_dynamo_loaded
from .stats import CacheStats, reset_stats, stats  # here, first: a later first import would set ``stats`` to the module

__version__ = "0.1.0"

#: public names imported on first use (the package's import is registration and stats only)
_LAZY = {
    "BackendOptions": ("options", "BackendOptions"),
    "OptionError": ("options", "OptionError"),
    "parse_options": ("options", "parse_options"),
    "npu_cached": ("backend", "npu_cached"),
    "make_backend": ("backend", "make_backend"),
    "cache_compile": ("drop_in", "cache_compile"),
    "load": ("bypass.loader", "load"),
    "readable_cache": ("readable", "readable_cache"),
    "CacheSecurityError": ("fs_security", "CacheSecurityError"),
    "InputSignatureError": ("bypass.signature", "InputSignatureError"),
    "patch_torchair": ("torchair_patch", "patch_torchair"),
    "unpatch_torchair": ("torchair_patch", "unpatch_torchair"),
    "prebuild": ("prebuilding", "prebuild"),
    "CacheMiss": ("bypass.loader", "CacheMiss"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        needs = _preload.FIRST_USE_NEEDS.get(name)
        if needs:  # the thread may be importing the warm path right now: wait for it rather than race it
            _preload.caller_needs(needs)
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKEND_NAME",
    "CacheStats",
    "register",
    "reset_stats",
    "stats",
    *_LAZY,
]

register_if_dynamo_loaded()

if _os.environ.get("TCB_PROFILE", "").strip() not in ("", "0"):  # where a warm start spends its time
    from . import profiling as _profiling

    _profiling.install()

from . import preload as _preload  # noqa: E402  (last: the package is whole before the thread imports from it)

_preload.start()  # the warm path's modules, imported in the background while the caller builds its model
