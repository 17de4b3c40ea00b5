"""Inductor as an inner compiler whose artifacts load without Inductor.

PyTorch's own caches do not ship compiled CPU kernels, so a restart with an
empty ``TORCHINDUCTOR_CACHE_DIR`` recompiles C++. We instead store:

* ``wrapper.py`` - Inductor's generated Python wrapper, rewritten with ``ast`` so
  its kernels come from bundled ``.so`` files and its Inductor imports from
  :mod:`.inductor_runtime` (importing ``torch._inductor`` costs ~2 s);
* ``k_<digest>.so`` - every C++ kernel extension the wrapper calls, dlopened in
  place on load (never recompiled);
* ``constants.pt`` / ``aot_meta.pkl`` - graph constants (with ``freezing``, the
  frozen and folded parameters too: Inductor's own cache reads those from the live
  graph, which a warm start does not have), loaded as real tensors even inside
  Dynamo's fake mode, and, for graphs that need it, AOTAutograd's runtime metadata.

Kernels are built with ``-march=native`` (the CPU's ISA is a key factor) and
specialized for the thread count (per-thread buffers): a loaded graph always runs
with the thread count it was built for (:func:`inductor_runtime.pin_threads`), so
the thread count and the CPU count stay out of the key and an artifact serves
processes and machines of any size.

An artifact is *lean* when calling the wrapper's ``call`` directly is equivalent
to AOTAutograd's runtime (see :func:`_runtime_plan`) and every extern kernel is a
plain torch callable: loading it imports neither torch._inductor nor torch._dynamo.
Non-lean artifacts still load without compiling, via the real Inductor /
AOTAutograd helpers. Graphs we cannot reproduce faithfully (Triton kernels,
tensor subclasses, ...) get ``artifact=None`` and a reason.

Training graphs (:meth:`InductorCompiler.compile_training`) store the forward's and
the backward's wrappers (``fw.wrapper.py``, ``bw.wrapper.py``) beside their kernels in
one artifact, run by :mod:`.autograd_runtime`.

This module is what a warm load imports: the key factors and the loader. The cold
side (capturing, rewriting and packaging Inductor's output) lives in
:mod:`.inductor_capture`, imported only by a process that compiles.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import platform
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import inductor_runtime as rt
from . import pycode
from .inductor_env import codegen_env

if TYPE_CHECKING:
    from ..options import BackendOptions
    from .base import Artifact, CompileResult

#: bump when the artifact layout or the rewrite changes meaning
FORMAT_VERSION = 2
WRAPPER_FILE = "wrapper.py"
CONSTANTS_FILE = "constants.pt"
AOT_META_FILE = "aot_meta.pkl"

#: file-name prefixes of a training artifact's forward and backward wrappers
FW_PREFIX, BW_PREFIX = "fw.", "bw."
#: the cold side's public names, still importable from here (resolved on first use)
_CAPTURE_NAMES = frozenset({"Uncacheable", "reference_of", "rewrite_wrapper"})


def __getattr__(name: str) -> Any:
    if name in _CAPTURE_NAMES:
        from . import inductor_capture

        return getattr(inductor_capture, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class InductorCompiler:
    """Inner compiler ``inductor``: compile with Inductor, store a self-contained artifact."""

    name = "inductor"

    # ------------------------------------------------------------------ key
    def hash_factors(self, options: BackendOptions) -> dict[str, Any]:
        """What besides the graph changes the artifact; cheap and Inductor-free.

        Inductor config enters as the set of values the *user* overrode (only
        possible once it is imported) plus the ``TORCHINDUCTOR_*`` env vars that
        change generated code (:mod:`.inductor_env`: compile workers, cache dirs
        and logging leave the key), so a warm process that never imports
        Inductor computes the same factors as the cold one did with default
        config. Kernels are built with ``-march=native`` for the vector ISA
        Inductor picked, so the CPU's ISA flags count. The thread count and the
        CPU count do not: a loaded graph always runs with the thread count its
        kernels were built for (``meta["threads"]``, :func:`inductor_runtime.pin_threads`),
        so one artifact is correct under any thread count and on any CPU count.
        Grad mode, autocast, default dtype and deterministic algorithms are key
        factors of every compiler (``key.runtime_state_factors``).
        """
        decomps = options.custom_decompositions or {}
        return {
            "format": FORMAT_VERSION,
            "torch": torch.__version__,
            "python": list(sys.version_info[:2]),
            "machine": platform.machine(),
            "cpu_capability": _cpu_capability(),
            "cpu_isa": _cpu_isa_digest(),
            "fp32_matmul_precision": torch.get_float32_matmul_precision(),
            "inductor_config": _config_overrides("torch._inductor.config"),
            "functorch_config": _config_overrides("torch._functorch.config"),
            "inductor_env": codegen_env(),
            "custom_decompositions": sorted(str(k) for k in decomps),
        }

    # -------------------------------------------------------------- compile
    def compile(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
        options: BackendOptions,
    ) -> CompileResult:
        """Compile with ``compile_fx`` while capturing what the artifact needs
        (:func:`.inductor_capture.compile_inference`)."""
        from .inductor_capture import compile_inference

        return compile_inference(gm, example_inputs, options)

    def compile_training(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
        options: BackendOptions,
    ) -> CompileResult:
        """A graph that needs autograd: forward and backward wrappers in one artifact
        (:func:`.inductor_capture.compile_training`); the cold process runs what a warm
        one loads."""
        from .inductor_capture import compile_training

        return compile_training(gm, example_inputs, options, self.load)

    # ----------------------------------------------------------------- load
    def load(self, artifact: Artifact, options: BackendOptions) -> Callable[..., Any]:
        """Rebuild the graph callable from stored files; never compiles anything.

        Everything runs from ``artifact.files``, the bytes the store verified
        against their checksums: the wrapper's code, the constants and the AOT
        metadata are read from them in memory and each kernel is dlopened from a
        private copy of its bytes (never from the entry's directory, which may
        change after the check).
        """
        meta = artifact.meta
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"inductor artifact format {meta.get('format')!r}, expected {FORMAT_VERSION}")
        parts = meta.get("parts") if meta.get("training") is not None else None
        for prefix, part in parts.items() if parts is not None else (("", meta),):
            _check_named_files(part, artifact.files, prefix)
        if parts is None:
            return _load_from(artifact.files, meta)
        from .autograd_runtime import build

        forward = _load_from(artifact.files, parts[FW_PREFIX], FW_PREFIX)
        backward = _load_from(artifact.files, parts[BW_PREFIX], BW_PREFIX)
        return build(forward, backward, meta["training"], bool(meta.get("disable_amp")))


def _check_named_files(meta: dict[str, Any], files: dict[str, bytes], prefix: str = "") -> None:
    """Every file the metadata names (kernels to dlopen, the wrapper, constants, AOT metadata)
    must be one of the artifact's checksummed files: a name taken from a manifest never
    reaches dlopen, exec or unpickling unless its bytes were verified."""
    for name, (fname, _digest) in meta.get("kernels", {}).items():
        plain = isinstance(fname, str) and fname not in ("", ".", "..") and os.path.basename(fname) == fname
        if not plain or fname not in files:
            raise ValueError(f"inductor artifact names kernel {name!r} as {fname!r}, which is not one of its "
                             "checksummed files; refusing to load it")
    needed = [prefix + WRAPPER_FILE] + ([prefix + CONSTANTS_FILE] if meta.get("constants") else []) + (
        [AOT_META_FILE] if meta.get("aot_runtime") else [])
    for fname in needed:
        if fname not in files:
            raise ValueError(f"inductor artifact lacks its checksummed file {fname!r}; refusing to load it")


def _load_from(files: dict[str, bytes], meta: dict[str, Any], prefix: str = "") -> Callable[..., Any]:
    """The callable, built only from the verified bytes in ``files``; for one part of a
    training artifact (files named with ``prefix``, no ``runtime`` plan of its own) the
    wrapper's boxed ``call``."""
    wrapper_file = prefix + WRAPPER_FILE
    wrapper_name = f"<tcb inductor wrapper {hashlib.sha256(files[wrapper_file]).hexdigest()[:16]}>"
    code = pycode.load_code(files, wrapper_file, wrapper_name)
    namespace: dict[str, Any] = dict(rt.SHIMS)
    namespace["extern_kernels"] = rt.build_extern_namespace(meta["externs"], bool(meta["needs_inductor"]))
    namespace["_load_kernel"] = rt.kernel_loader(files, meta["kernels"])
    module = rt.exec_wrapper(code, namespace, wrapper_name)
    # the kernels are loaded (module level): drop the loader, which holds every file's
    # bytes (the constants' too), so they are not kept alive beside the loaded graph
    vars(module).pop("_load_kernel", None)
    if meta.get("constants"):
        # after exec: the wrapper declares each constant as ``name = None`` (Inductor
        # also sets them as module attributes once the module has run)
        from .stored_tensors import load_tensors

        vars(module).update(load_tensors(files[prefix + CONSTANTS_FILE]))
    missing = [name for name in meta.get("constant_names", ()) if not isinstance(vars(module).get(name), torch.Tensor)]
    if missing:
        raise ValueError(f"inductor artifact lacks constants {missing[:5]} its wrapper reads")
    call = rt.pin_threads(module.call, meta.get("threads"))
    runtime = meta.get("runtime")
    if runtime is None:  # a part of a training artifact: autograd_runtime wraps it
        return call
    if meta["aot_runtime"]:
        return rt.aot_runtime_wrap(call, files[AOT_META_FILE], bool(runtime.get("disable_amp")))
    return rt.lean_callable(call, runtime)

@functools.cache
def _cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # pragma: no cover - very old/odd builds
        return "unknown"


@functools.cache
def _cpu_isa_digest() -> str:
    """Digest of the CPU's feature flags (``/proc/cpuinfo``): kernels are compiled
    with ``-march=native`` and Inductor's vector ISA, so another CPU model may not run them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):  # x86 / arm
                    return hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor() or "unknown"


def _config_overrides(module_name: str) -> str:
    """Digest of the config values set in-process in ``module_name`` (an Inductor /
    functorch config module); ``"default"`` when none are or it is not imported.
    Callables (custom passes) count by their code and bound values, never by id."""
    cfg = sys.modules.get(module_name)
    if cfg is None:
        return "default"
    from ..fingerprint import describe_value

    try:
        entries = cfg._config  # type: ignore[attr-defined]
        unset = importlib.import_module("torch.utils._config_module")._UNSET_SENTINEL
        overrides = {}
        for key in sorted(entries):
            entry = entries[key]
            value = entry.user_override.get()
            if value is unset or value is entry.default or _same(value, entry.default):
                continue
            overrides[key] = describe_value(value)
    except Exception:  # private API moved: fall back to the full portable config
        overrides = {k: describe_value(v) for k, v in sorted(cfg.save_config_portable().items())}
    if not overrides:
        return "default"
    return hashlib.sha256(json.dumps(overrides, sort_keys=True, default=str).encode()).hexdigest()


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. tensors: not equal for our purpose
        return False
