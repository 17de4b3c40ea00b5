"""``torch.compile(mode=...)`` for ``npu_cached``: Inductor's modes mapped onto the inner compiler.

Its own module because the backend route reads a backend's options (``capture_hook``)
on every warm start, and that must not import the compile side (``backend``).
"""

from __future__ import annotations

from .logs import log, warn_once
from .options import BackendOptions, OptionError, parse_options

#: ``torch.compile(mode=...)`` values (Inductor's): accepted by ``npu_cached`` as a serious backend does
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def apply_mode(options: BackendOptions, mode: str | None) -> BackendOptions:
    """Map ``torch.compile``'s ``mode`` onto the inner compiler: ``"reduce-overhead"`` is graph
    capture, which torchair has (aclgraph: its ``CompilerConfig.mode = "reduce-overhead"``, unless
    a ``config`` is given, which wins); elsewhere, and for the other modes, the graph is compiled
    as by default, with one log line. (transformers' ``CompileConfig`` passes "reduce-overhead".)"""
    if mode not in COMPILE_MODES:
        raise OptionError(f"npu_cached: unknown torch.compile(mode={mode!r}); valid modes are "
                          f"{', '.join(repr(m) for m in COMPILE_MODES[1:])} (or None)")
    if mode in (None, "default"):
        return options
    compiler = options.resolved_compiler()
    if mode == "reduce-overhead" and compiler == "torchair":
        if options.config is not None:
            warn_once(f"mode:{mode}:config", "npu_cached: torch.compile(mode=%r) with options={'config': ...}: "
                      "the given torchair config (mode %s) is used", mode, getattr(options.config, "mode", "?"))
            return options
        from torchair import CompilerConfig

        config = CompilerConfig()
        config.mode = "reduce-overhead"
        log.info("npu_cached: torch.compile(mode='reduce-overhead') -> torchair aclgraph (graph capture)")
        return parse_options(dict(options.as_dict(), config=config))
    warn_once(f"mode:{mode}:{compiler}", "npu_cached: torch.compile(mode=%r) has no counterpart in the %s inner "
              "compiler here; graphs are compiled as with the default mode", mode, compiler)
    return options
