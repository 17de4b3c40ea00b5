"""The ``torchair`` inner compiler: torchair's own AOTAutograd route, stored as the
Python source torchair generates (``get_code``) for the inference graph.

Cold: Dynamo graph -> torchair decompositions -> AOTAutograd (inference) ->
``torchair.get_compiler(config)(aot_graph, inputs).get_code(extend_config)``; the
source is exec'd and its ``kernel`` serves this process.  Warm: exec the stored
source in a fresh module and call ``kernel`` with Dynamo's flat inputs.

That shortcut is only valid when AOTAutograd adds nothing at runtime (no
prepended parameters, no effect tokens, no outputs aliasing inputs, every input
mutation kept in the graph); other graphs are compiled but not cached.

GE's own compile cache (``ge_cache=True``, max-autotune only) goes inside the
cache entry: the stored code names a placeholder directory, and the generated
``_update_ge_cache_dir`` hook re-points it at ``<entry>/files/ge_cache`` before
the first run, as torchair does when it rebases a moved cache.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..logs import log, warn_once
from ..torchair_config import config_mode, config_snapshot, is_aclgraph_mode
from . import pycode
from .base import Artifact, CompileResult

if TYPE_CHECKING:
    import torch

    from ..options import BackendOptions

SOURCE = "torchair_graph.py"
GE_CACHE_SUBDIR = "ge_cache"
#: written into the stored code instead of a real path; replaced on load via the hook
GE_CACHE_PLACEHOLDER = "<npu_cached:ge_cache_dir>"
GE_CACHE_OPTION = "ge.graph_compiler_cache_dir"
STATIC_KERNEL_SUBDIR = "static_kernels"
STATIC_KERNEL_PLACEHOLDER = "<npu_cached:static_kernel_dir>"
STATIC_KERNEL_PREFIX = "_aclnn_static_shape_kernel."
FORMAT = "torchair-getcode-v1"


class _Uncacheable(Exception):
    pass


def _default_config(options: BackendOptions) -> Any:
    if options.config is not None:
        return options.config
    from torchair import CompilerConfig

    return CompilerConfig()


def _deterministic_level() -> Any:
    """torchair's NPU deterministic level: 0 without torch_npu loaded (as torchair)."""
    npu_mod = sys.modules.get("torch_npu")
    if npu_mod is None:
        return 0
    try:
        return int(npu_mod.npu._get_deterministic_level())
    except Exception as exc:  # an old torch_npu without the query
        return f"unknown ({type(exc).__name__})"


def _install_deterministic_guard() -> None:
    """As torchair's backends: recompile when the NPU deterministic level changes."""
    if "torch_npu" not in sys.modules:
        return
    try:
        from torch_npu.dynamo._deterministic_guard import install_npu_deterministic_level_guard
    except ImportError:
        warn_once("torchair-det-guard", "npu_cached: torch_npu has no install_npu_deterministic_level_guard; "
                  "skip installing the npu deterministic level guard")
        return
    try:
        install_npu_deterministic_level_guard()
    except Exception as exc:  # no tracing context (e.g. the guard-bypass loader)
        log.debug("npu_cached: deterministic level guard not installed: %r", exc)


def _uses_ge_cache(options: BackendOptions, config: Any) -> bool:
    if not options.ge_cache:
        return False
    if is_aclgraph_mode(config):
        warn_once(
            "torchair-ge_cache-aclgraph",
            "npu_cached: ge_cache=True has no effect in aclgraph mode %s; it applies to GE max-autotune only",
            config_mode(config),
        )
        return False
    return config_mode(config) == "max-autotune"


def _cann_version_for_kernels() -> str:
    try:
        import torch_npu

        return str(torch_npu.npu.utils.get_cann_version())
    except Exception:
        from ..environment import cann_version

        return cann_version() or ""


def _static_kernel_options(config: Any) -> dict[str, str]:
    """The static-kernel cache options torchair passes in aclgraph modes (its codegen
    uses them only when ``experimental_config.aclgraph._aclnn_static_shape_kernel``
    is on); the directory is a placeholder re-pointed into our entry at load."""
    import torch

    if not is_aclgraph_mode(config):
        return {}
    return {
        STATIC_KERNEL_PREFIX + "use_cache_compile": "1",
        STATIC_KERNEL_PREFIX + "cann_version": _cann_version_for_kernels(),
        STATIC_KERNEL_PREFIX + "compile_cache_dir": STATIC_KERNEL_PLACEHOLDER,
        STATIC_KERNEL_PREFIX + "deterministic": "1" if torch.are_deterministic_algorithms_enabled() else "0",
    }


def _point_caches(module: types.ModuleType, files_dir: str | None, ge_cache: bool) -> None:
    """Re-point the generated code's GE / static-kernel caches into our entry."""
    if files_dir is None:
        return
    hook = getattr(module, "_update_ge_cache_dir", None)
    if ge_cache and hook is not None:
        hook(os.path.join(files_dir, GE_CACHE_SUBDIR))
    static_hook = getattr(module, "_update_static_kernel_cache_dir", None)
    if static_hook is not None:
        static_hook(os.path.join(files_dir, STATIC_KERNEL_SUBDIR))


def _exec_source(files: dict[str, bytes], name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(pycode.load_code(files, name, f"<npu_cached torchair graph {name}>"), module.__dict__)  # noqa: S102
    return module


def _check_no_aot_runtime(graph: Any, example_inputs: list[Any], dynamo_inputs: int) -> dict[str, Any]:
    """The facts that make ``kernel(*dynamo_args)`` equal AOTAutograd's inference call."""
    from torch._guards import TracingContext

    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != dynamo_inputs:
        raise _Uncacheable(
            f"AOTAutograd graph takes {len(placeholders)} inputs but Dynamo passes {dynamo_inputs} "
            "(lifted parameters/buffers or deduplicated inputs need AOT runtime wrappers)"
        )
    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    if meta is None:
        raise _Uncacheable("no AOTAutograd metadata in the tracing context")
    if meta.tokens:
        raise _Uncacheable("graph uses effect tokens (side-effectful ops)")
    if any(not isinstance(m, int) and type(m).__name__ != "PlainTensorMeta" for m in meta.subclass_inp_meta):
        raise _Uncacheable("graph has tensor-subclass inputs")
    if meta.num_intermediate_bases:
        raise _Uncacheable("outputs alias graph intermediates")
    kinds = sorted({o.output_type.name for o in meta.output_info} - {"non_alias"})
    if kinds:
        raise _Uncacheable(f"outputs alias inputs/intermediates ({', '.join(kinds)}) and need AOT runtime wrappers")
    if meta.num_mutated_inp_runtime_indices:
        raise _Uncacheable("input mutations applied outside the graph need AOT runtime wrappers")
    return {
        "num_inputs": dynamo_inputs,
        "num_outputs": len(meta.output_info),
        "keep_input_mutations": bool(meta.keep_input_mutations),
        "mutated_inputs_in_graph": [int(i) for i in getattr(meta, "mutated_graph_handled_indices_seen_by_autograd", [])],
    }


def _aot_inference(
    gm: Any, example_inputs: list[Any], config: Any, decompositions: dict[Any, Any],
    base_compiler: Callable[..., Any], bw_compiler: Callable[..., Any],
) -> Callable[..., Any]:
    """torchair's cache-mode AOTAutograd route (``_compile_graph_with_aot(is_cache=True)``),
    assembled from its helpers: stream/event rewrite (aclgraph), the forward compiler
    wrapped for static-input and custom input attributes and debug phases."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import default_partition
    from torchair import npu_fx_compiler as nfc

    if is_aclgraph_mode(config) and hasattr(nfc, "replace_stream_event_pass"):
        try:
            gm = nfc.replace_stream_event_pass(gm)
        except AttributeError as exc:  # a torch_npu without streams/events: nothing to rewrite
            if any("stream" in str(n.target).lower() or "event" in str(n.target).lower()
                   for n in gm.graph.nodes if n.op in ("call_function", "call_method")):
                raise
            log.debug("npu_cached: skip torchair stream/event rewrite: %r", exc)
    compiler = base_compiler
    if hasattr(nfc, "_wrap_compiler"):
        compiler = nfc._wrap_compiler(compiler, config, len(example_inputs), "forward")
    if hasattr(nfc, "_get_inputs_custom_attr") and hasattr(nfc, "_set_inputs_custom_attr_to_compiler"):
        compiler = nfc._set_inputs_custom_attr_to_compiler(compiler, nfc._get_inputs_custom_attr(example_inputs))
    if hasattr(nfc, "wrap_compiler_phase"):
        compiler = nfc.wrap_compiler_phase(compiler, "forward")
    return aot_module_simplified(
        gm,
        example_inputs,
        fw_compiler=compiler,
        bw_compiler=bw_compiler,
        inference_compiler=None,
        partition_fn=default_partition,
        keep_inference_input_mutations=True,
        decompositions=decompositions,
    )


class TorchairCompiler:
    """Inner compiler ``torchair``: GE (max-autotune) or aclgraph codegen via torchair."""

    name = "torchair"

    # ------------------------------------------------------------------ key
    def hash_factors(self, options: BackendOptions) -> dict[str, Any]:
        from ..environment import torch_npu_version, torchair_version

        config = _default_config(options)
        return {
            "format": FORMAT,
            "torchair": torchair_version(),
            "torch_npu": torch_npu_version(),
            "mode": config_mode(config),
            "config": config_snapshot(config),
            "npu_deterministic_level": _deterministic_level(),
            "static_kernel_options": {
                k: v for k, v in _static_kernel_options(config).items() if not k.endswith("compile_cache_dir")
            },
            "ge_cache": bool(options.ge_cache),
        }

    # -------------------------------------------------------------- compile
    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any], options: BackendOptions) -> CompileResult:
        import torchair
        from torchair import npu_fx_compiler as nfc

        config = _default_config(options)
        use_ge_cache = _uses_ge_cache(options, config)
        extend_config = {GE_CACHE_OPTION: GE_CACHE_PLACEHOLDER} if use_ge_cache else {}
        extend_config.update(_static_kernel_options(config))
        cold_files_dir = self._cold_files_dir(gm, example_inputs, options) if extend_config else None

        _install_deterministic_guard()
        try:
            from torchair.configs.compiler_config import _check_config_support

            _check_config_support(config)
        except ImportError:
            pass
        # torchair's decomposition merge: its npu defaults, the user's on top, then its patches
        decompositions = nfc._get_merged_decompositions(config, dict(options.custom_decompositions or {}))
        if hasattr(nfc, "_process_send_recv"):
            nfc._process_send_recv(gm, config)

        dynamo_inputs = len(example_inputs)
        state: dict[str, Any] = {}

        def codegen_compiler(graph: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
            compiled = torchair.get_compiler(config)(graph, inputs)
            src = compiled.get_code(extend_config)  # raises on RNG inputs: let it surface
            if not isinstance(src, str):
                state["reason"] = f"torchair codegen returned {type(src).__name__}, not Python source"
                return compiled
            try:
                state["aot"] = _check_no_aot_runtime(graph, inputs, dynamo_inputs)
            except _Uncacheable as exc:
                state["reason"] = str(exc)
            state["src"] = src

            def build_kernel() -> Callable[..., Any]:
                module = _exec_source({SOURCE: src.encode()}, SOURCE)
                _point_caches(module, cold_files_dir, use_ge_cache)
                return module.kernel

            if not is_aclgraph_mode(config):
                return build_kernel()
            # aclgraph: as torchair's compiled graph, build the kernel at the first call
            kernel: list[Callable[..., Any]] = []

            def lazy_kernel(*args: Any) -> Any:
                if not kernel:
                    kernel.append(build_kernel())
                return kernel[0](*args)

            return lazy_kernel

        def bw_compiler(graph: Any, inputs: Any) -> Any:
            raise RuntimeError("npu_cached torchair: backward compilation is not supported (inference only)")

        fn = _aot_inference(gm, example_inputs, config, decompositions, codegen_compiler, bw_compiler)
        if "src" not in state:
            return CompileResult(fn, None, state.get("reason", "torchair produced no inference code"))
        if "reason" in state:
            return CompileResult(fn, None, state["reason"])
        meta = {
            "format": FORMAT,
            "mode": config_mode(config),
            "aot": state["aot"],
            "ge_cache": use_ge_cache,
            "ge_cache_placeholder": GE_CACHE_PLACEHOLDER if use_ge_cache else None,
            "has_ge_cache_hook": "def _update_ge_cache_dir(" in state["src"],
        }
        files = {SOURCE: state["src"].encode()}
        pycode.precompile(files, SOURCE, f"<npu_cached torchair graph {SOURCE}>")
        return CompileResult(fn, Artifact(files=files, meta=meta))

    @staticmethod
    def _cold_files_dir(gm: Any, example_inputs: list[Any], options: BackendOptions) -> str:
        """Where the entry being compiled will live, so GE's (or the static kernels')
        first run already writes its cache there (the backend publishes the entry
        before the first run)."""
        import torch

        from .. import key as keys
        from ..backend import graph_store

        try:
            key, _ = keys.compute_key(gm, example_inputs, TorchairCompiler(), options, torch.is_grad_enabled())
            return os.path.join(graph_store(options).entry_path(key), "files")
        except Exception as exc:  # never fail a compile over where GE puts its cache
            log.debug("npu_cached: cannot compute the entry path for the GE cache: %r", exc)
            import tempfile

            return tempfile.mkdtemp(prefix="npu_cached_ge_cache_")

    # ----------------------------------------------------------------- load
    def load(self, artifact: Artifact, options: BackendOptions) -> Callable[..., Any]:
        meta = artifact.meta
        if meta.get("format") != FORMAT:
            raise ValueError(f"artifact format {meta.get('format')!r} is not {FORMAT!r}")
        _install_deterministic_guard()
        module = _exec_source(artifact.files, SOURCE)
        if meta.get("ge_cache"):
            if getattr(module, "_update_ge_cache_dir", None) is None:
                raise ValueError("stored GE code has no _update_ge_cache_dir hook for its ge_cache dir")
            if artifact.root is None:
                raise ValueError("artifact has no root directory to hold the GE cache")
        _point_caches(module, artifact.root, bool(meta.get("ge_cache")))
        kernel = module.kernel
        expected = int(meta["aot"]["num_inputs"])

        def torchair_graph(*args: Any) -> Any:
            if len(args) != expected:
                raise TypeError(f"npu_cached torchair graph takes {expected} inputs, got {len(args)}")
            return kernel(*args)

        torchair_graph.kernel = kernel  # type: ignore[attr-defined]
        torchair_graph.module = module  # type: ignore[attr-defined]
        return torchair_graph
