"""``load()`` of a module whose calls do not run its class's ``forward`` as the plain hit does:
a ``DistributedDataParallel`` wrapper, or a module with a ``forward`` set on the instance.
Imported only by such a load (a plain hit never reads these bytes)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from ..logs import log
from ..options import BackendOptions
from .loader import CacheMiss, _replay_or_compile, instance_forward


def _load_instance_forward(module: Any, options: BackendOptions, fallback: bool) -> Any:
    """``load()`` of a module whose instance ``forward`` is what its calls run: that forward is
    replayed (a bound method or function: Dynamo compiled its frame), installed as the
    instance's ``forward``, and the module returned, so ``nn.Module.__call__`` runs its hooks
    around the replay as before. Any other callable (a partial) is not replayed: it is
    compiled by Dynamo, as ``torch.compile(module)`` does."""
    forward = instance_forward(module)
    if isinstance(forward, (types.MethodType, types.FunctionType)):
        module.__dict__["forward"] = _replay_or_compile(forward, options, fallback)
        return module
    miss = CacheMiss(f"{type(module).__qualname__}'s forward is a {type(forward).__qualname__} set on the instance, "
                     "which is not replayed")
    if not fallback:
        raise miss
    log.info("npu_cached: %s; compiling instead", miss)
    from .loader_miss import _stand_in

    return _stand_in(module, options, miss)


def _load_ddp(ddp: Any, options: BackendOptions, fallback: bool) -> Callable[..., Any]:
    """``load()`` of a ``DistributedDataParallel`` module: Dynamo compiles the wrapped
    module's forward (DDP's own forward runs as Python, its bucketing and gradient
    hooks included), so the wrapped module's forward is replayed, installed on the
    instance, and DDP itself is returned to be called as usual."""
    inner = ddp.module
    method = types.MethodType(type(inner).forward, inner)
    inner.__dict__["forward"] = _replay_or_compile(method, options, fallback)
    return ddp
