"""Parsing and validation of ``torch.compile(..., options={...})`` for ``npu_cached``."""

from __future__ import annotations

import os
from typing import Any

COMPILERS = ("auto", "torchair", "inductor", "eager")
#: what a warm start checks: "load" (default), "call" (every check on every call), "none" (torchair's behaviour)
GUARD_MODES = ("load", "call", "none")
DEFAULT_CACHE_DIR = ".torchair_cache"
CACHE_HOME_ENV = "TORCHAIR_CACHE_HOME"
REMOTE_ENV = "TORCHAIR_CACHE_REMOTE"


class OptionError(ValueError):
    """A bad ``options`` key or value; the message names the fix."""


class BackendOptions:
    """Validated options of one ``npu_cached`` backend instance.

    ``cache_dir`` is always absolute once parsed, so a later ``chdir`` does not
    move the cache. (A plain class, not a dataclass: it is imported on the warm
    path, where a dataclass's generated methods cost ~0.5 ms.)
    """

    __slots__ = (
        "cache_dir", "compiler", "config", "ge_cache", "custom_decompositions", "global_rank",
        "tp_rank", "pp_rank", "check_inputs", "dynamic", "reject_rng", "guards", "max_size", "graph_dir",
        "remote", "base_dir",
        "lock_timeout",
    )

    def __init__(
        self,
        cache_dir: str,
        compiler: str = "auto",
        config: Any = None,  # torchair CompilerConfig or None
        ge_cache: bool = False,
        custom_decompositions: dict[Any, Any] | None = None,
        global_rank: int | None = None,
        tp_rank: int | None = None,
        pp_rank: int | None = None,
        check_inputs: bool = True,
        dynamic: bool | None = None,
        reject_rng: bool = False,
        guards: str = "load",
        max_size: int | None = None,
        graph_dir: str | None = None,
        remote: str | None = None,
        base_dir: str | None = None,
        lock_timeout: float | None = None,
    ) -> None:
        self.cache_dir = cache_dir
        self.compiler = compiler
        self.config = config
        self.ge_cache = ge_cache
        self.custom_decompositions = custom_decompositions
        self.global_rank = global_rank
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.check_inputs = check_inputs
        self.dynamic = dynamic
        self.reject_rng = reject_rng
        self.guards = guards
        self.max_size = max_size
        self.graph_dir = graph_dir
        #: a redis:// / rediss:// URL: the remote tier (``remote.py``), default $TORCHAIR_CACHE_REMOTE
        self.remote = remote
        #: a read-only base cache (baked into an image) under the local one (``layers.py``)
        self.base_dir = base_dir
        self.lock_timeout = lock_timeout

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self) -> str:
        return "BackendOptions(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BackendOptions) and self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaces

    def resolved_compiler(self) -> str:
        """The inner compiler actually used (``auto`` resolved)."""
        if self.compiler != "auto":
            return self.compiler
        from .environment import npu_available

        return "torchair" if npu_available() else "inductor"


def default_cache_dir() -> str:
    """``$TORCHAIR_CACHE_HOME``, else ``./.torchair_cache`` (absolute)."""
    return os.path.abspath(os.environ.get(CACHE_HOME_ENV) or DEFAULT_CACHE_DIR)


def _check_rank(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OptionError(f"npu_cached option {name!r} must be a non-negative int or None, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptionError(f"npu_cached option {name!r} must be True or False, got {value!r}")
    return value


def _check_config(value: Any) -> Any:
    if value is None:
        return None
    cls = type(value)
    if cls.__name__ != "CompilerConfig":
        raise OptionError(
            "npu_cached option 'config' must be a torchair CompilerConfig "
            f"(torchair.CompilerConfig()), got {cls.__module__}.{cls.__qualname__}"
        )
    return value


def _check_decompositions(value: Any) -> dict[Any, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(callable(v) for v in value.values()):
        raise OptionError(
            "npu_cached option 'custom_decompositions' must be a dict {OpOverload: callable}, "
            "e.g. torch._decomp.get_decompositions([torch.ops.aten.add.default])"
        )
    return value


def _check_guards(value: Any) -> str:
    if value not in GUARD_MODES:
        raise OptionError(
            f"npu_cached option 'guards' must be one of {GUARD_MODES}, got {value!r}: 'load' checks what Dynamo "
            "specialized on when a warm start loads (and per call what can change between calls), 'call' checks "
            "everything on every call, 'none' checks nothing (torchair's behaviour)"
        )
    return value


_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
               "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as ``"500MB"`` / ``"2G"`` (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        number = text.rstrip("KMGTIB")
        unit = text[len(number):]
        try:
            amount = float(number)
        except ValueError:
            amount = -1.0
        if unit in _SIZE_UNITS and amount >= 0:
            return int(amount * _SIZE_UNITS[unit])
    raise OptionError(f"a size must be a non-negative number of bytes or a string like '500MB' / '2GB', got {value!r}")


def _check_max_size(value: Any) -> int | None:
    return None if value is None else parse_size(value)


def _check_graph_dir(value: Any) -> str | None:
    """Where graph entries live (default: ``cache_dir``); cache_compile shares one per model across ranks."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise OptionError(f"npu_cached option 'graph_dir' must be a non-empty path or None, got {value!r}")
    return os.path.abspath(os.fspath(value))


def _check_remote(value: Any) -> str | None:
    """A redis:// or rediss:// URL (checked now, connected on first use)."""
    if value is None:
        return None
    from .remote import RemoteConfigError, parse_url

    try:
        parse_url(value)
    except RemoteConfigError as exc:
        raise OptionError(f"npu_cached option 'remote': {exc}") from None
    return value


def _check_base_dir(value: Any) -> str | None:
    """A read-only base cache dir (e.g. baked into an image): read, never written."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise OptionError(f"npu_cached option 'base_dir' must be a non-empty path or None, got {value!r}")
    return os.path.abspath(os.fspath(value))


def _check_lock_timeout(value: Any) -> float | None:
    """Seconds a process waits for another one compiling the same graph (None:
    ``$TORCHAIR_CACHE_LOCK_TIMEOUT``, else 600); then it compiles without the lock."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise OptionError(f"npu_cached option 'lock_timeout' must be seconds >= 0 (e.g. 600) or None, got {value!r}")
    return float(value)


_VALIDATORS = {
    "cache_dir": None,
    "compiler": None,
    "config": _check_config,
    "ge_cache": lambda v: _check_bool("ge_cache", v),
    "custom_decompositions": _check_decompositions,
    "global_rank": lambda v: _check_rank("global_rank", v),
    "tp_rank": lambda v: _check_rank("tp_rank", v),
    "pp_rank": lambda v: _check_rank("pp_rank", v),
    "check_inputs": lambda v: _check_bool("check_inputs", v),
    "dynamic": lambda v: v if v is None else _check_bool("dynamic", v),
    "reject_rng": lambda v: _check_bool("reject_rng", v),
    "guards": _check_guards,
    "max_size": _check_max_size,
    "graph_dir": _check_graph_dir,
    "remote": _check_remote,
    "base_dir": _check_base_dir,
    "lock_timeout": _check_lock_timeout,
}
VALID_KEYS = tuple(_VALIDATORS)


def parse_options(options: dict[str, Any] | None = None, **extra: Any) -> BackendOptions:
    """Validate a user ``options`` dict; unknown keys and bad values raise
    :class:`OptionError` listing what is valid."""
    merged = dict(options or {})
    merged.update(extra)
    unknown = sorted(set(merged) - set(VALID_KEYS))
    if unknown:
        raise OptionError(
            f"unknown npu_cached option(s) {unknown}; valid options are: {', '.join(VALID_KEYS)}"
        )
    cache_dir = merged.pop("cache_dir", None)
    if cache_dir is None:
        cache_dir = default_cache_dir()
    elif not isinstance(cache_dir, (str, os.PathLike)) or not os.fspath(cache_dir):
        raise OptionError(f"npu_cached option 'cache_dir' must be a non-empty path, got {cache_dir!r}")
    compiler = merged.pop("compiler", "auto")
    if compiler not in COMPILERS:
        raise OptionError(f"npu_cached option 'compiler' must be one of {COMPILERS}, got {compiler!r}")
    if "remote" not in merged and os.environ.get(REMOTE_ENV):
        merged["remote"] = os.environ[REMOTE_ENV]
    checked = {k: _VALIDATORS[k](v) for k, v in merged.items()}
    opts = BackendOptions(cache_dir=os.path.abspath(os.fspath(cache_dir)), compiler=compiler, **checked)
    if opts.ge_cache and compiler in ("inductor", "eager"):
        raise OptionError(
            f"npu_cached option 'ge_cache=True' needs the torchair compiler (GE max-autotune), "
            f"not compiler={compiler!r}; drop ge_cache or use compiler='torchair'/'auto'"
        )
    if opts.remote is not None or opts.base_dir is not None:
        from .layers import configure_from_options

        configure_from_options(opts)
    return opts
