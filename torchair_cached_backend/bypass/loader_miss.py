"""What a warm load needs only when it misses: why, and what serves the call instead.

``_why_missing`` explains a program miss (and sets aside a stale program of an
edited function); ``_compiling_stand_in`` is what ``load()`` returns (and installs for
a callee) with nothing to replay: every call compiled by Dynamo, caching as it goes.
A hit never imports this module.
"""

from __future__ import annotations

import os
import time
import types
from collections.abc import Callable
from typing import Any

from .. import code_codec
from ..options import BackendOptions
from ..stats import record_fallback
from .loader import CacheMiss, _reason_kind, _torch_compile_fallback, resolve_target
from .program import FUNCTION_PREFIX, PROGRAM_FORMAT
from .replay import ReplayedFunction


def _why_missing(
    store: Any, identity: dict[str, Any], key: str, code: types.CodeType, compiler: str, cache_dir: str, name: str
) -> str:
    """Explain a program miss: an entry for an *edited* version of the function is
    stale (removed here, so it is never replayed), else nothing was cached. Only the
    entries whose keys begin with this function's prefix are read (``program.function_prefix``)."""
    fingerprint = code_codec.code_fingerprint(code)
    edited, older = [], []
    for other in _keys_with_prefix(store, key[:FUNCTION_PREFIX]):
        if other == key:
            continue
        try:
            manifest = store.read_manifest(other) or {}
        except Exception:
            continue
        program = manifest.get("program") or {}
        function = program.get("function") or {}
        same = (function.get("module"), function.get("qualname"), function.get("receiver_type")) == (
            identity["module"], identity["qualname"], identity.get("receiver_type"))
        if not same or program.get("compiler") != compiler:
            continue
        if program.get("format") != PROGRAM_FORMAT:  # another version's (its own key): never read, left
            older.append(other)
        elif program.get("fingerprint") not in (None, fingerprint):
            edited.append(other)
    for other in edited:
        try:
            store.remove(other)
        except Exception:  # only tidying: the key differs, so the entry can never be replayed anyway
            pass
    if edited:
        return f"cached program for {name} is stale ({name} was edited since it was cached); rebuilding"
    if older:
        return f"cached program for {name} has another format (written by another version); rebuilding"
    return f"no cached program for {name} (compiler {compiler}) in {cache_dir}"


#: a store's directory -> (its stat identity, its keys by function prefix): one listing serves every
#: miss of the process while the directory is unchanged. A warm backend route misses once for each
#: frame under a replay that Dynamo compiled nothing in (transformers' config ``__getattribute__``),
#: and listing 10 000 entries takes ~7 ms
_listings: dict[str, tuple[tuple[int, int, int], dict[str, list[str]]]] = {}
#: a listing taken this soon after the directory's last change is not kept: an entry added or
#: removed within the same timestamp tick would leave the identity unchanged (git's "racy" rule)
_RACY_S = 2.0


def _keys_with_prefix(store: Any, prefix: str) -> list[str]:
    """The keys of ``store`` that begin with ``prefix``, from the process's listing of its
    directory when the directory's (device, inode, mtime) is still the listed one."""
    try:
        st = os.stat(store.dir)
    except OSError:  # absent (nothing stored yet) or a fault: store.keys() says which
        return [k for k in store.keys() if k.startswith(prefix)]
    identity = (st.st_dev, st.st_ino, st.st_mtime_ns)
    hit = _listings.get(store.dir)
    if hit is not None and hit[0] == identity:
        return hit[1].get(prefix, [])
    listed_at = time.time()
    by_prefix: dict[str, list[str]] = {}
    for k in store.keys():
        by_prefix.setdefault(k[:FUNCTION_PREFIX], []).append(k)
    if listed_at - st.st_mtime_ns / 1e9 > _RACY_S:
        _listings[store.dir] = (identity, by_prefix)
    return by_prefix.get(prefix, [])


def _compiling_stand_in(target: Any, options: BackendOptions, why: str) -> Callable[..., Any]:
    """What ``load()`` returns on a miss: a replay without variants, so every call is
    compiled by Dynamo (caching as it goes) and module hooks run as for a replay
    (also once it is installed as ``model.forward``; an ``OptimizedModule`` assigned
    there would become a submodule, never called)."""
    import torch

    func, bound_self = resolve_target(target)
    module = target if isinstance(target, torch.nn.Module) else None
    name = getattr(func, "__qualname__", None) or func.__name__
    return ReplayedFunction([], bound_self, name, _torch_compile_fallback(target, options), module,
                            original=func, miss=why)


def _stand_in(target: Any, options: BackendOptions, miss: CacheMiss) -> ReplayedFunction:
    """A miss served by compiling (``loader_miss``): counted, every call compiled by Dynamo."""
    record_fallback(_reason_kind(str(miss)))
    return _compiling_stand_in(target, options, str(miss))
