"""The ``torchair`` inner compiler: torchair's own AOTAutograd route, stored as the
Python source torchair generates (``get_code``) for the inference graph.

Cold: Dynamo graph -> torchair decompositions -> AOTAutograd (inference) ->
``torchair.get_compiler(config)(aot_graph, inputs).get_code(extend_config)``; the
source is exec'd and its ``kernel`` serves this process.  Warm: exec the stored
source in a fresh module and call ``kernel`` with Dynamo's flat inputs.

That shortcut is only valid when AOTAutograd adds nothing at runtime (no
prepended parameters, no effect tokens, no outputs aliasing intermediates, every
input mutation kept in the graph); other graphs are compiled but not cached.

Outputs that are views of inputs are cached: torchair's kernel rebuilds them
itself (``torch.as_strided(args[i], ...)``), as its own ``cache_compile`` relies on.

GE's own compile cache (``ge_cache=True``, max-autotune only) goes inside the
cache entry: the stored code names a placeholder directory, and the generated
``_update_ge_cache_dir`` hook re-points it at ``<entry>/files/ge_cache`` (created
first, as torchair creates its cache dir) before GE loads the graph, as torchair
does when it rebases a moved cache. A graph that is not cached never points GE
into the store: its GE cache goes to a private temporary directory. GE executes
what it finds there, so the directory is verified against its seal before GE is
pointed at it and sealed after the first run returns (``runtime_cache.py``).

Training graphs (:meth:`TorchairCompiler.compile_training`) follow torchair's
``npu_backend`` route (its partitioner, a GE graph for the forward and one for the
backward) and store both generated sources in one entry, run by
:mod:`.autograd_runtime`; aclgraph modes and ``ge_cache`` apply to inference graphs.

Key factors besides the config: the NPU deterministic level and hf32 flags
(torch_npu), ``AUTOFUSE_FLAGS``, and the user's GE converters by code
(``register_fx_node_ge_converter``): every one in the graph key, and the converters
an artifact used re-checked when it is loaded.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..logs import log, warn_once
from ..torchair_config import config_mode, config_snapshot, default_config_snapshot, is_aclgraph_mode
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


def _point_caches(
    module: types.ModuleType, files_dir: str | None, ge_cache: bool, ge_subdir: str = GE_CACHE_SUBDIR
) -> list[Any]:
    """Re-point the generated code's GE / static-kernel caches into ``files_dir``
    (our entry). GE executes what it finds there, so each directory is first verified
    against its seal (``runtime_cache.prepare``: a directory that does not match is set
    aside and rebuilt), or created, as torchair creates it: GE caches nothing into a
    directory that does not exist. A directory that cannot be used (read-only cache,
    another process writing it) falls back to a private temporary one: the call must
    not fail over it. Returns the entry's run-time caches, sealed after the first run."""
    hook = getattr(module, "_update_ge_cache_dir", None) if ge_cache else None
    static_hook = getattr(module, "_update_static_kernel_cache_dir", None)
    caches: list[Any] = []
    if hook is None and static_hook is None:
        return caches
    for subdir, update in ((ge_subdir, hook), (STATIC_KERNEL_SUBDIR, static_hook)):
        if update is None:
            continue
        cache = None
        if files_dir is not None:
            from .. import runtime_cache

            try:
                cache = runtime_cache.prepare(files_dir, subdir)
            except Exception as exc:  # noqa: BLE001 - never fail the call over GE's cache
                log.warning("npu_cached: cannot check the run-time cache %s in %s (%s); GE caches into a private "
                            "temporary directory", subdir, files_dir, exc)
        if cache is not None:
            caches.append(cache)
            update(cache.path)
            continue
        path = os.path.join(_private_dir(), subdir)
        os.makedirs(path, mode=0o700, exist_ok=True)
        update(path)
    return caches


def _first_run_slot(kernel: Callable[..., Any], caches: list[Any] | Callable[[], list[Any]]) -> list[Callable[..., Any]]:
    """A one-item list holding what to call: until ``kernel``'s first run returns (GE has
    written its run-time caches then), a wrapper that seals them afterwards; then ``kernel``
    itself, so the steady-state call costs one list index. ``caches``: the caches, or what
    points them (called once, at the first call before it runs: a cold process's GE loads
    the graph then, after the entry was published)."""
    slot = [kernel]
    if callable(caches) or caches:
        pointed: list[list[Any]] = [] if callable(caches) else [caches]

        def first_run(*args: Any) -> Any:
            if not pointed:  # once, even if the first run raises (this process then writes the caches)
                pointed.append(caches())  # type: ignore[operator]
            out = kernel(*args)
            slot[0] = kernel
            for cache in pointed[0]:
                cache.after_run()
            return out

        slot[0] = first_run
    return slot


_private_dirs: list[str] = []


def _private_dir() -> str:
    """A temporary directory for the GE cache of a graph that is not stored (removed at exit)."""
    path = tempfile.mkdtemp(prefix="npu_cached_ge_")
    if not _private_dirs:
        atexit.register(lambda: [shutil.rmtree(p, ignore_errors=True) for p in _private_dirs])
    _private_dirs.append(path)
    return path


def _published_files_dir(files_dir: str | None) -> str | None:
    """``files_dir`` if its entry was published (it has a manifest), else None."""
    if files_dir is None:
        return None
    from ..store import MANIFEST

    return files_dir if os.path.isfile(os.path.join(os.path.dirname(files_dir), MANIFEST)) else None


def _hf32_flags() -> Any:
    """torch_npu's hf32 switches, which torchair hands GE as ``ge.exec.allow_hf32``."""
    npu_mod = sys.modules.get("torch_npu")
    if npu_mod is None:
        return None
    try:
        return [bool(npu_mod.npu.conv.allow_hf32), bool(npu_mod.npu.matmul.allow_hf32)]
    except Exception as exc:  # noqa: BLE001 - an old torch_npu without the switches
        return f"unknown ({type(exc).__name__})"


# ------------------------------------------------------------------ user GE converters
_BUILTIN = "torchair"
_converter_generation = [0]
_converter_scan: dict[str, Any] = {"generation": -1, "converters": {}}


def _converter_of(op: Any) -> Any:
    from torchair._ge_concrete_graph import fx2ge_converter as fx2ge

    found = fx2ge._CONVERTERS.get(op) if op in fx2ge._CONVERTERS else None
    return found if found is not None else getattr(op, "__dict__", {}).get("_ge_converter")


def _converter_digest(converter: Any) -> str:
    """``"torchair"`` for torchair's own converters (its version is in the key), else
    a digest of the user's converter: its code and bound values."""
    if converter is None:
        return _BUILTIN
    fn = getattr(converter, "__wrapped__", converter)
    module = getattr(fn, "__module__", None) or ""
    if module == "torchair" or module.startswith(("torchair.", "torch_npu.")):
        return _BUILTIN
    from ..fingerprint import callable_digest

    return callable_digest(fn)


def _watch_converter_registration() -> None:
    """Count registrations (``Converter.__call__``) so the scan below runs once per change."""
    from torchair._ge_concrete_graph import fx2ge_converter as fx2ge

    cls = fx2ge.Converter
    if getattr(cls.__call__, "_npu_cached_watch", False):
        return
    register = cls.__call__

    def counted(self: Any, converter: Any) -> Any:
        _converter_generation[0] += 1
        return register(self, converter)

    counted._npu_cached_watch = True  # type: ignore[attr-defined]
    cls.__call__ = counted


def user_converters() -> dict[str, str]:
    """``{op: digest}`` of every GE converter registered outside torchair.

    Scans the op overloads materialized so far (about 3000: ~15 ms), once per
    process and again only after a new registration."""
    try:
        _watch_converter_registration()
    except (ImportError, AttributeError) as exc:  # another torchair layout: scan every time
        log.debug("npu_cached: cannot watch GE converter registration: %r", exc)
        _converter_generation[0] += 1
    if _converter_scan["generation"] == _converter_generation[0]:
        return _converter_scan["converters"]
    import torch
    from torchair._ge_concrete_graph import fx2ge_converter as fx2ge

    found: dict[str, str] = {}
    candidates = list(fx2ge._CONVERTERS.items())
    for namespace in list(vars(torch.ops).values()):
        if not isinstance(namespace, torch._ops._OpNamespace):
            continue
        for packet in list(vars(namespace).values()):
            if type(packet) is not torch._ops.OpOverloadPacket:
                continue
            for overload in list(vars(packet).values()):
                converter = getattr(overload, "__dict__", {}).get("_ge_converter")
                if converter is not None:
                    candidates.append((overload, converter))
    for op, converter in candidates:
        digest = _converter_digest(converter)
        if digest != _BUILTIN:
            found[str(op)] = digest
    _converter_scan.update(generation=_converter_generation[0], converters=found)
    return found


def _graph_converters(graph: Any) -> dict[str, str]:
    """``{op: digest}`` for every op of the AOT graph GE converted: what a load re-checks."""
    import torch

    ops = {n.target for n in graph.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}
    return {str(op): _converter_digest(_converter_of(op)) for op in sorted(ops, key=str)}


def _stale_converters(recorded: dict[str, str]) -> list[str]:
    """Ops whose GE converter differs from the one the artifact was built with."""
    import torch

    changed = []
    for name, digest in recorded.items():
        namespace, packet, overload = (name.split(".", 2) + ["default"])[:3]
        try:
            op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
        except (AttributeError, RuntimeError):
            changed.append(f"{name} (op no longer exists)")
            continue
        current = _converter_digest(_converter_of(op))
        if current != digest:
            changed.append(f"{name}: {_converter_name(digest)} -> {_converter_name(current)}")
    return changed


def _converter_name(digest: str) -> str:
    return "torchair's converter" if digest == _BUILTIN else f"user converter {digest[:12]}"


def _first_call_points_caches(
    module: types.ModuleType, files_dir: str | None, ge_cache: bool, ge_subdir: str = GE_CACHE_SUBDIR
) -> Callable[..., Any]:
    """The cold process's kernel: its caches are pointed (and created) at the first run -
    into the entry if it was published by then, else into a private temporary directory -
    and sealed when that run returns (:func:`_first_run_slot`)."""
    slot = _first_run_slot(module.kernel, lambda: _point_caches(module, _published_files_dir(files_dir), ge_cache,
                                                                 ge_subdir))

    def call(*args: Any) -> Any:
        return slot[0](*args)

    return call


#: file-name prefixes of a training artifact's forward and backward code
FW_PREFIX, BW_PREFIX = "fw.", "bw."


def _ge_subdir(phase: str) -> str:
    """Where one part of a training graph keeps its GE cache, inside the entry's files."""
    return (FW_PREFIX if phase == "forward" else BW_PREFIX) + GE_CACHE_SUBDIR


def _count(graph: Any, op: str) -> int:
    return sum(1 for n in graph.graph.nodes if n.op == op)


def _num_outputs(graph: Any) -> int:
    out = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    value = out.args[0]
    return len(value) if isinstance(value, (list, tuple)) else 1


def _boxed(kernel: Callable[..., Any]) -> Callable[[list[Any]], Any]:
    def boxed(args: list[Any]) -> Any:
        return kernel(*args)

    return boxed


def _boxed_slot(slot: list[Callable[..., Any]]) -> Callable[[list[Any]], Any]:
    def boxed(args: list[Any]) -> Any:
        return slot[0](*args)

    return boxed


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
    kinds = sorted({o.output_type.name for o in meta.output_info} - {"non_alias", *_INPUT_ALIASES})
    if kinds:
        raise _Uncacheable(f"outputs alias intermediates ({', '.join(kinds)}) and need AOT runtime wrappers")
    if meta.num_mutated_inp_runtime_indices:
        raise _Uncacheable("input mutations applied outside the graph need AOT runtime wrappers")
    return {
        "num_inputs": dynamo_inputs,
        "num_outputs": len(meta.output_info),
        "input_aliases": [i for i, o in enumerate(meta.output_info) if o.output_type.name in _INPUT_ALIASES],
        "keep_input_mutations": bool(meta.keep_input_mutations),
        "mutated_inputs_in_graph": [int(i) for i in getattr(meta, "mutated_graph_handled_indices_seen_by_autograd", [])],
    }


#: AOTAutograd output kinds that are (views of) graph inputs
_INPUT_ALIASES = ("alias_of_input", "is_input")


def _check_input_aliases(src: str, indices: list[int]) -> None:
    """torchair's kernel must rebuild each output that aliases an input from that input
    (``fx_outputs[i] = torch.as_strided(args[j], ...)``), so calling it directly, as
    torchair's cache does, returns the same views AOTAutograd's wrapper would."""
    for i in indices:
        prefix = f"fx_outputs[{i}] = "
        line = next((ln.strip() for ln in src.splitlines() if ln.strip().startswith(prefix)), "")
        rhs = line[len(prefix):]
        if not rhs.startswith(("torch.as_strided(args[", "torch.view_as_real(args[", "torch.view_as_complex(args[", "args[")):
            raise _Uncacheable(f"output {i} aliases an input but torchair's kernel does not rebuild it as a view")


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



def _prepare(nfc: types.ModuleType, gm: Any, config: Any, options: BackendOptions) -> Any:
    """What torchair's ``npu_backend`` does before AOTAutograd, for both routes: the
    deterministic guard, its config check, the send/recv pass, and its decomposition
    merge (its npu defaults, the user's on top, then its patches), which it returns."""
    _install_deterministic_guard()
    try:
        from torchair.configs.compiler_config import _check_config_support

        _check_config_support(config)
    except ImportError:
        pass
    decompositions = nfc._get_merged_decompositions(config, dict(options.custom_decompositions or {}))
    if hasattr(nfc, "_process_send_recv"):
        nfc._process_send_recv(gm, config)
    return decompositions

class TorchairCompiler:
    """Inner compiler ``torchair``: GE (max-autotune) or aclgraph codegen via torchair."""

    name = "torchair"

    # ------------------------------------------------------------------ key
    def hash_factors(self, options: BackendOptions) -> dict[str, Any]:
        """torchair's config (every leaf; ``None`` as a default ``CompilerConfig()``) and the
        process state torchair hands GE: the NPU deterministic level, hf32, autofuse flags,
        the static-kernel options. (``ge.deterministic`` comes from deterministic algorithms,
        a key factor of every compiler: ``key.runtime_state_factors``.)"""
        from ..environment import torch_npu_version, torchair_version

        config = options.config  # None and CompilerConfig() mean the same (mode, static kernels)
        if config is None:
            from torchair import CompilerConfig

            snapshot = default_config_snapshot(CompilerConfig)
        else:
            snapshot = config_snapshot(config)
        return {
            "format": FORMAT,
            "torchair": torchair_version(),
            "torch_npu": torch_npu_version(),
            "mode": config_mode(config),
            "config": snapshot,
            "npu_deterministic_level": _deterministic_level(),
            "hf32": _hf32_flags(),
            "autofuse_flags": os.environ.get("AUTOFUSE_FLAGS", ""),
            "static_kernel_options": {
                k: v for k, v in _static_kernel_options(config).items() if not k.endswith("compile_cache_dir")
            },
            "ge_cache": bool(options.ge_cache),
        }

    def registry_factors(self, options: BackendOptions) -> dict[str, Any]:
        """The user's GE converters (by code): a graph-key factor too costly to scan at
        every warm load; :meth:`load` re-checks the converters its artifact used instead."""
        return {"ge_converters": user_converters()}

    # -------------------------------------------------------------- compile
    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any], options: BackendOptions) -> CompileResult:
        import torchair
        from torchair import npu_fx_compiler as nfc

        config = _default_config(options)
        use_ge_cache = _uses_ge_cache(options, config)
        extend_config = {GE_CACHE_OPTION: GE_CACHE_PLACEHOLDER} if use_ge_cache else {}
        extend_config.update(_static_kernel_options(config))
        cold_files_dir = self._cold_files_dir(gm, example_inputs, options) if extend_config else None

        decompositions = _prepare(nfc, gm, config, options)

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
                _check_input_aliases(src, state["aot"]["input_aliases"])
                state["converters"] = {} if is_aclgraph_mode(config) else _graph_converters(graph)
            except _Uncacheable as exc:
                state["reason"] = str(exc)
            state["src"] = src
            # a graph that is not stored never points GE into the store
            files_dir = None if "reason" in state else cold_files_dir

            def build_kernel() -> Callable[..., Any]:
                module = _exec_source({SOURCE: src.encode()}, SOURCE)
                if not extend_config:
                    return module.kernel
                return _first_call_points_caches(module, files_dir, use_ge_cache)

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
            "converters": state["converters"],
        }
        files = {SOURCE: state["src"].encode()}
        pycode.precompile(files, SOURCE, f"<npu_cached torchair graph {SOURCE}>")
        return CompileResult(fn, Artifact(files=files, meta=meta))

    #: the partitioner torchair's npu_backend uses for training graphs (a key factor)
    partitioner = "default_partition (torchair npu_backend)"

    def compile_training(
        self, gm: torch.fx.GraphModule, example_inputs: list[Any], options: BackendOptions
    ) -> CompileResult:
        """torchair's training route (``npu_backend``: its decompositions, AOTAutograd with its
        partitioner, one GE graph for the forward and one for the backward), each stored as
        the code torchair generates, with the plan :mod:`.autograd_runtime` runs them with.
        With ``ge_cache`` (GE max-autotune) each part's GE cache lives in the entry
        (``fw.ge_cache`` / ``bw.ge_cache``). aclgraph modes apply to inference graphs only:
        such training graphs are compiled uncached, with the reason."""
        import torch
        import torchair
        from torch._functorch import config as functorch_config
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._guards import TracingContext
        from torchair import npu_fx_compiler as nfc

        from .autograd_runtime import TrainingUnsupported, describe

        config = _default_config(options)
        blocker = None
        if is_aclgraph_mode(config):
            blocker = f"torchair {config_mode(config)} (aclgraph) training graphs are not cached"
        if blocker is not None:  # torchair's own training route serves it, as torchair would
            backend = torchair.get_npu_backend(compiler_config=config,
                                               custom_decompositions=dict(options.custom_decompositions or {}))
            return CompileResult(backend(gm, example_inputs), None, blocker)
        use_ge_cache = _uses_ge_cache(options, config)
        extend_config = {GE_CACHE_OPTION: GE_CACHE_PLACEHOLDER} if use_ge_cache else {}
        cold_files_dir = self._cold_files_dir(gm, example_inputs, options, training=True) if use_ge_cache else None
        decompositions = _prepare(nfc, gm, config, options)
        parts: dict[str, Any] = {}

        def stage(phase: str) -> Callable[..., Any]:
            def codegen(graph: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
                compiled = torchair.get_compiler(config)(graph, inputs)
                try:  # e.g. RNG inputs (dropout): torchair generates no code for them
                    src = compiled.get_code(dict(extend_config))
                except Exception as exc:  # noqa: BLE001 - then torchair's own runtime serves it, uncached
                    parts["reason"] = f"torchair cannot generate code for the {phase} graph: {type(exc).__name__}: {exc}"
                    return compiled
                if not isinstance(src, str):
                    parts["reason"] = f"torchair codegen returned {type(src).__name__} for the {phase} graph"
                    return compiled
                if use_ge_cache and "def _update_ge_cache_dir(" not in src:
                    parts["reason"] = f"torchair's {phase} code has no GE cache hook for ge_cache"
                parts[phase] = (graph, src)
                if phase == "forward":
                    parts["meta"] = getattr(TracingContext.try_get(), "fw_metadata", None)
                module = _exec_source({SOURCE: src.encode()}, SOURCE)
                kernel = module.kernel
                if use_ge_cache:  # GE loads at the first run, after the entry is published: its cache
                    # goes into the entry then (a private dir when the graph is not stored)
                    kernel = _first_call_points_caches(module, cold_files_dir, True, _ge_subdir(phase))
                parts[phase + "_kernel"] = kernel
                return kernel

            compiler: Callable[..., Any] = codegen
            if phase == "forward":
                if hasattr(nfc, "_wrap_compiler"):
                    compiler = nfc._wrap_compiler(compiler, config, len(example_inputs), phase)
                if hasattr(nfc, "_get_inputs_custom_attr") and hasattr(nfc, "_set_inputs_custom_attr_to_compiler"):
                    compiler = nfc._set_inputs_custom_attr_to_compiler(compiler, nfc._get_inputs_custom_attr(example_inputs))
            if hasattr(nfc, "wrap_compiler_phase"):
                compiler = nfc.wrap_compiler_phase(compiler, phase)
            return compiler

        partition = nfc._get_partition_fn(config) if hasattr(nfc, "_get_partition_fn") else None
        kwargs: dict[str, Any] = {"partition_fn": partition} if partition is not None else {}
        # GE does not reuse donated buffers: without them backward(retain_graph=True) works
        with functorch_config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True,
                                    donated_buffer=False):
            fn = aot_module_simplified(
                gm, example_inputs, fw_compiler=stage("forward"), bw_compiler=stage("backward"),
                keep_inference_input_mutations=bool(config.experimental_config.keep_inference_input_mutations),
                decompositions=decompositions, **kwargs,
            )
        try:
            if "reason" in parts:
                raise TrainingUnsupported(parts["reason"])
            if "forward" not in parts or "backward" not in parts:
                raise TrainingUnsupported("AOTAutograd did not produce a forward and a backward graph")
            (fw, fw_src), (bw, bw_src) = parts["forward"], parts["backward"]
            plan = describe(parts["meta"], len(example_inputs), _count(fw, "placeholder"), _num_outputs(fw),
                            _count(bw, "placeholder"))
        except TrainingUnsupported as exc:
            return CompileResult(fn, None, str(exc))
        files: dict[str, bytes] = {}
        for prefix, src in ((FW_PREFIX, fw_src), (BW_PREFIX, bw_src)):
            files[prefix + SOURCE] = src.encode()
            pycode.precompile(files, prefix + SOURCE, f"<npu_cached torchair graph {prefix}{SOURCE}>")
        meta = {
            "format": FORMAT,
            "mode": config_mode(config),
            "training": plan,
            "disable_amp": bool(torch._C._is_any_autocast_enabled()),
            "ge_cache": use_ge_cache,
            "converters": {**_graph_converters(fw), **_graph_converters(bw)},
        }
        artifact = Artifact(files=files, meta=meta)
        if not use_ge_cache:
            return CompileResult(self._load_training(artifact), artifact)
        from .autograd_runtime import build  # the cold kernels: they point GE into the entry once it is stored

        return CompileResult(build(_boxed(parts["forward_kernel"]), _boxed(parts["backward_kernel"]), plan,
                                   bool(meta["disable_amp"])), artifact)

    def _load_training(self, artifact: Artifact) -> Callable[..., Any]:
        from .autograd_runtime import build
        from .stored_tensors import real_tensors

        with real_tensors():  # module-level code must see real tensors, even inside Dynamo's backend call
            fw, bw = (_exec_source({name[len(prefix):]: blob for name, blob in artifact.files.items()
                                    if name.startswith(prefix)}, SOURCE) for prefix in (FW_PREFIX, BW_PREFIX))
        if artifact.meta.get("ge_cache"):
            for phase, module in (("forward", fw), ("backward", bw)):
                if getattr(module, "_update_ge_cache_dir", None) is None:
                    raise ValueError(f"stored GE {phase} code has no _update_ge_cache_dir hook for its ge_cache dir")
                if artifact.root is None:
                    raise ValueError("artifact has no root directory to hold the GE cache")
        slots = {"forward": [fw.kernel], "backward": [bw.kernel]}
        if artifact.meta.get("ge_cache"):
            for phase, module in (("forward", fw), ("backward", bw)):
                slots[phase] = _first_run_slot(module.kernel, _point_caches(module, artifact.root, True, _ge_subdir(phase)))
        return build(_boxed_slot(slots["forward"]), _boxed_slot(slots["backward"]), artifact.meta["training"],
                     bool(artifact.meta.get("disable_amp")))

    @staticmethod
    def _cold_files_dir(gm: Any, example_inputs: list[Any], options: BackendOptions, training: bool = False) -> str:
        """Where the entry being compiled will live, so GE's (or the static kernels')
        first run already writes its cache there (the backend publishes the entry
        before the first run)."""
        import torch

        from .. import key as keys
        from ..backend import graph_store

        try:
            key, _ = keys.compute_key(gm, example_inputs, TorchairCompiler(), options, torch.is_grad_enabled(),
                                      training=training)
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
        stale = _stale_converters(meta.get("converters", {}))
        if stale:
            raise ValueError("GE converters changed since this graph was built: " + "; ".join(stale[:5]))
        _install_deterministic_guard()
        if meta.get("training") is not None:
            return self._load_training(artifact)
        from .stored_tensors import real_tensors

        with real_tensors():  # inside Dynamo's backend call: module-level code must see real tensors
            module = _exec_source(artifact.files, SOURCE)
        if meta.get("ge_cache"):
            if getattr(module, "_update_ge_cache_dir", None) is None:
                raise ValueError("stored GE code has no _update_ge_cache_dir hook for its ge_cache dir")
            if artifact.root is None:
                raise ValueError("artifact has no root directory to hold the GE cache")
        slot = _first_run_slot(module.kernel, _point_caches(module, artifact.root, bool(meta.get("ge_cache"))))
        expected = int(meta["aot"]["num_inputs"])

        def torchair_graph(*args: Any) -> Any:
            if len(args) != expected:
                raise TypeError(f"npu_cached torchair graph takes {expected} inputs, got {len(args)}")
            return slot[0](*args)

        torchair_graph.kernel = module.kernel  # type: ignore[attr-defined]
        torchair_graph.module = module  # type: ignore[attr-defined]
        return torchair_graph
