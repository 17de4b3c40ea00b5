"""A *program*: what the guard-bypass loader replays for one function.

It holds Dynamo's transformed bytecode for the function (one variant per
recompile) and for its resume functions, what each Dynamo-installed global
stands for (a cached graph by key, a module, builtins, a resume function), the
input signature of each variant, and the staleness facts (traced sources,
parameter/buffer shapes). Graph artifacts themselves live in the graph store.
"""

from __future__ import annotations

import types
from typing import Any

from .. import key as keys
from ..environment import environment_factors
from ..store import Store

PROGRAMS = "programs"


def function_identity(code: types.CodeType, module: str | None) -> dict[str, Any]:
    return {"module": module, "qualname": getattr(code, "co_qualname", code.co_name), "name": code.co_name}


def program_key(identity: dict[str, Any], root_fingerprint: str, compiler: str) -> str:
    """Depends on the function, its own code, the inner compiler and the versions;
    edits to *inlined* helpers are caught by the stored fingerprints instead."""
    return keys.digest(
        {
            "format": keys.FORMAT_VERSION,
            "function": [identity["module"], identity["qualname"]],
            "code": root_fingerprint,
            "compiler": compiler,
            "environment": environment_factors(),
        }
    )


def program_store(cache_dir: str) -> Store:
    return Store(cache_dir, PROGRAMS)
