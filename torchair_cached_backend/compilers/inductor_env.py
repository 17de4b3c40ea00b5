"""Which ``TORCHINDUCTOR_*`` environment variables change the code Inductor generates.

A key that holds every ``TORCHINDUCTOR_*`` variable never hits across machines
whose launch scripts differ only in compile workers, cache dirs or logging. The
split is read from Inductor's own config metadata, without importing Inductor
(the warm path must not pay for it): ``torch/_inductor/config.py`` and
``torch/_functorch/config.py`` are parsed with :mod:`ast` to find which config
entry each variable feeds (``os.environ.get("TORCHINDUCTOR_X")`` in an entry's
default, directly or through a helper function, or ``Config(env_name_...)``),
and the entries those modules themselves declare irrelevant to cached results
(``_cache_config_ignore_prefix``, ``_save_config_ignore``) leave the key.

Variables read outside the config modules are keyed unless listed in
:data:`NOT_CODEGEN_ELSEWHERE` with the reason. ``TORCHINDUCTOR_VEC_ISA_OK`` stays
keyed on purpose: it decides which vector ISA the kernels are built for (``0``
disables vectorization, ``1`` skips the probe that can reject an ISA). Parsing
happens only in a process where a ``TORCHINDUCTOR_*`` variable outside those two
tables is set (once; ~0.1 s on a busy 2-core machine, paid by such a warm start); the
parser is :mod:`.inductor_env_parse`, which a warm start without such a variable never imports.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

PREFIX = "TORCHINDUCTOR_"
#: config modules (relative to torch's package dir) whose entries TORCHINDUCTOR_* variables feed
CONFIG_FILES = ("_inductor/config.py", "_functorch/config.py")
#: config entries about caches of compiled results, not about what is compiled (functorch
#: declares no ignore prefix list; these mirror Inductor's "cache related options" entries)
NOT_CODEGEN_CONFIG = (
    "enable_autograd_cache", "enable_remote_autograd_cache", "autograd_cache_normalize_inputs",
    # compile workers' logging and lock/worker timeouts: how compiling runs, not what it emits
    "torchinductor_worker_logpath", "worker_suppress_logging", "file_lock_timeout", "quiesce_async_compile_pool",
)
#: variables read outside the config modules that change no generated code (where they are read)
NOT_CODEGEN_ELSEWHERE: dict[str, str] = {
    "TORCHINDUCTOR_CACHE_DIR": "where Inductor keeps its own caches (runtime/cache_dir_utils.py)",
    "TORCHINDUCTOR_CACHE_DUMP_FILE_PATH": "a debug dump of cache events",
    "TORCHINDUCTOR_DUMP_MEMOIZER_CACHE": "a debug dump of the memoizer",
    "TORCHINDUCTOR_ENABLE_CACHING_MODULE": "caching of compiled results",
    "TORCHINDUCTOR_REDIS_HOST": "Inductor's remote cache server",
    "TORCHINDUCTOR_REDIS_PORT": "Inductor's remote cache server",
    "TORCHINDUCTOR_REDIS_URL": "Inductor's remote cache server",
    "TORCHINDUCTOR_MM_LOGGING_FILE": "logging",
    "TORCHINDUCTOR_CONV_LOGGING_FILE": "logging",
    "TORCHINDUCTOR_FLEX_ATTENTION_LOGGING_FILE": "logging",
    "TORCHINDUCTOR_AUTOTUNE_POOL_INACTIVITY_TIMEOUT": "autotune worker lifetime",
    "TORCHINDUCTOR_COMPILE_WORKER_WAIT_TIMEOUT": "compile worker timeout",
}



@functools.cache
def _classification() -> tuple[dict[str, set[str]], tuple[str, ...], frozenset[str]]:
    """What every config module says, merged (memoized: parsed once per process)."""
    import torch

    from .inductor_env_parse import parse_config_source

    root = os.path.dirname(torch.__file__)
    feeds: dict[str, set[str]] = {}
    prefixes: list[str] = []
    ignored: set[str] = set(NOT_CODEGEN_CONFIG)
    for rel in CONFIG_FILES:
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                found, pre, ign = parse_config_source(f.read())
        except (OSError, SyntaxError, ValueError):
            continue  # unreadable: its variables stay keyed
        for env, entries in found.items():
            feeds.setdefault(env, set()).update(entries)
        prefixes += pre
        ignored.update(ign)
    return feeds, tuple(prefixes), frozenset(ignored)


def _entry_ignored(entry: str, prefixes: tuple[str, ...], ignored: frozenset[str]) -> bool:
    return entry in ignored or any(entry.startswith(p) for p in prefixes)


#: variables keyed whatever the config modules say, decided without parsing them (the parse costs
#: ~0.1 s on a busy 2-core machine; benchmarks and launch scripts commonly set these)
CODEGEN_ALWAYS: dict[str, str] = {
    "TORCHINDUCTOR_VEC_ISA_OK": "which vector ISA the kernels are built for (codecache/cpu_vec_isa.py)",
}


def affects_codegen(name: str) -> bool:
    """Whether ``TORCHINDUCTOR_<...>`` variable ``name`` may change generated code (unknown: yes)."""
    if name in NOT_CODEGEN_ELSEWHERE:
        return False
    if name in CODEGEN_ALWAYS:
        return True
    feeds, prefixes, ignored = _classification()
    entries = feeds.get(name)
    if not entries:
        return True
    return not all(_entry_ignored(e, prefixes, ignored) for e in entries)


def codegen_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``TORCHINDUCTOR_*`` variables of ``environ`` (default: this process) that may
    change the generated code: a key factor. Free when none is set."""
    env = os.environ if environ is None else environ
    names = sorted(k for k in env if k.startswith(PREFIX))
    return {k: env[k] for k in names if affects_codegen(k)}


def ignored_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``TORCHINDUCTOR_*`` variables set that leave the key (for ``explain``)."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith(PREFIX) and not affects_codegen(k)}


def __getattr__(name: str) -> Any:
    if name == "parse_config_source":  # the parser, in a module of its own (off the warm path)
        from .inductor_env_parse import parse_config_source

        return parse_config_source
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
