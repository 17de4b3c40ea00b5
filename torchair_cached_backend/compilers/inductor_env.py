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
tables is set (once; ~0.1 s on a busy 2-core machine, paid by such a warm start).
"""

from __future__ import annotations

import ast
import functools
import os
from collections.abc import Iterable, Mapping

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


def _env_names(node: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith(PREFIX)
    }


def _called_names(node: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def _string_list(node: ast.AST | None) -> list[str]:
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def parse_config_source(source: str) -> tuple[dict[str, set[str]], list[str], list[str]]:
    """``({env var: config entries it feeds}, ignore prefixes, ignored entries)`` of one config module."""
    tree = ast.parse(source)
    helpers: dict[str, set[str]] = {}  # module-level function -> env vars it reads (with what it calls)
    calls: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            helpers[node.name] = _env_names(node)
            calls[node.name] = _called_names(node)
    for _ in range(3):  # helpers calling helpers
        for name, called in calls.items():
            for other in called & set(helpers):
                helpers[name] |= helpers[other]
    feeds: dict[str, set[str]] = {}
    ignore_prefix: list[str] = []
    ignored: list[str] = []

    def visit(body: Iterable[ast.stmt], prefix: str) -> None:
        nonlocal ignore_prefix, ignored
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
                continue
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target, value = node.targets[0].id, node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                target, value = node.target.id, node.value
            else:
                continue
            if not prefix and target == "_cache_config_ignore_prefix":
                ignore_prefix = _string_list(value)
            elif not prefix and target == "_save_config_ignore":
                ignored = _string_list(value)
            envs = _env_names(value)
            for called in _called_names(value) & set(helpers):
                envs |= helpers[called]
            for env in envs:
                feeds.setdefault(env, set()).add(prefix + target)

    visit(tree.body, "")
    return feeds, ignore_prefix, ignored


@functools.cache
def _classification() -> tuple[dict[str, set[str]], tuple[str, ...], frozenset[str]]:
    """What every config module says, merged (memoized: parsed once per process)."""
    import torch

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
