"""Stand-ins for the few ``torch._dynamo`` runtime helpers replayed bytecode calls.

Transformed code calls trivial helpers from ``torch._dynamo.utils`` (sizes and
strides of dynamic inputs, runtime-overhead timers, object rebuilding); importing
Dynamo for them would cost a second at start.
"""

from __future__ import annotations

import importlib
from typing import Any


class _LightDynamoUtils:
    """Stands in for ``torch._dynamo.utils`` in replayed bytecode.

    Transformed code calls a few trivial helpers from it (sizes and strides of
    dynamic inputs, runtime-overhead timers); importing Dynamo for them would
    cost a second at start. Anything else is delegated to the real module.
    """

    __name__ = "torch._dynamo.utils"

    @staticmethod
    def call_size(x: Any, i: int) -> int:
        return x.size(i)

    @staticmethod
    def call_stride(x: Any, i: int) -> int:
        return x.stride(i)

    @staticmethod
    def call_storage_offset(x: Any) -> int:
        return x.storage_offset()

    @staticmethod
    def record_pregraph_bytecode_enter() -> None:
        return None

    # Rebuilding user objects the graph returns (dataclasses, plain classes) goes
    # through these: write straight into the instance ``__dict__``, bypassing
    # ``__setattr__`` (frozen dataclasses) exactly as a fresh ``__init__`` would.
    @staticmethod
    def object_setattr_ignore_descriptor(obj: Any, name: str, value: Any) -> None:
        _instance_dict(obj)[name] = value

    @staticmethod
    def object_delattr_ignore_descriptor(obj: Any, name: str) -> None:
        del _instance_dict(obj)[name]

    object_new = staticmethod(object.__new__)
    dict_getitem = staticmethod(dict.__getitem__)
    list_getitem = staticmethod(list.__getitem__)

    @staticmethod
    def record_pregraph_bytecode_exit(cm: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("torch._dynamo.utils"), name)


def _instance_dict(obj: Any) -> dict[str, Any]:
    import threading

    try:
        return object.__getattribute__(obj, "__dict__")
    except AttributeError:
        if isinstance(obj, threading.local):  # its per-thread dict is not visible to object's getattr
            return threading.local.__getattribute__(obj, "__dict__")
        raise


def module_for(name: str) -> Any:
    import sys

    if name == "torch._dynamo.utils" and name not in sys.modules:
        return _LightDynamoUtils()
    return importlib.import_module(name)
