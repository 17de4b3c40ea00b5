"""Just enough runtime to execute a stored Inductor CPU wrapper in a fresh process.

A warm start must not pay for ``import torch._inductor`` (~2 s) nor compile any
C++: the rewritten wrapper (see ``inductor.py``) gets its kernels from the bundled
``.so`` files via :func:`load_kernel` and its few Inductor helpers from here.
Nothing in this module imports ``torch._inductor`` or ``torch._dynamo``, except
the explicit fallback paths (:func:`real_extern_kernels`, :func:`aot_runtime_wrap`)
used only by artifacts whose metadata says they need them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.machinery
import importlib.util
import itertools
import os
import shutil
import tempfile
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

#: env var the generated kernel modules read in ``PyInit_kernel`` (a C pointer
#: to the tensor data accessor living in torch._C); Inductor sets it before loading
_DATA_PTR_ENV = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"
#: Inductor's buffer alignment for memory planning (torch/_inductor/utils.py)
ALIGN_BYTES = 64


def load_kernel(blob: bytes, digest: str) -> Callable[..., Any]:
    """dlopen one bundled kernel extension from its verified bytes and return its ``kernel`` entry.

    ``blob`` is bytes the store verified against their checksum; they go into a
    sealed anonymous memory file (``memfd_create``, dlopened through a
    ``/proc/self/fd`` path), or where that is unavailable into a private 0700
    temp dir removed right after: what is mapped is exactly what was checked,
    never a file in the cache dir someone could swap after the check. The module
    name is keyed by ``digest`` (the content digest the metadata names the
    kernel by), so graphs sharing a kernel share one loaded module: a module is
    reused only for the very bytes it was loaded from, and bytes that differ
    from them under the same digest are hashed and, unless they really have
    that digest, refused. Bytes are hashed by the store only, once.
    """
    if not isinstance(digest, str) or not 16 <= len(digest) <= 64 or digest.strip("0123456789abcdef"):
        raise ImportError(f"kernel digest {digest!r} in the metadata is not a hex digest; refusing to load it")
    # the last dotted component must be "kernel": CPython derives PyInit_<name> from it
    name = f"_tcb_kernel_{digest}.kernel"
    with _LOCK:
        loaded = _LOADED.get(name)
        if loaded is not None:
            if loaded[1] is blob or loaded[1] == blob:
                return loaded[0].kernel
            actual = hashlib.sha256(blob).hexdigest()
            if not actual.startswith(digest):
                raise ImportError(
                    f"kernel bytes have sha256 {actual[:24]}, its metadata says {digest!r}; refusing to load it")
            # the module loaded under this digest came from other bytes (metadata that lied
            # about them): these get a module of their own
            name = f"_tcb_kernel_{digest}_{next(_SEQ)}.kernel"
        module = _dlopen_bytes(name, blob)
        _LOADED[name] = (module, blob)
        return module.kernel


def set_tensor_data_ptr_env() -> None:
    """The env var a kernel's ``PyInit`` reads; always (re)set before loading kernels: a
    value inherited from a parent process points into *its* memory."""
    os.environ[_DATA_PTR_ENV] = str(torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)


#: module name -> (kernel module, the verified bytes it was loaded from)
_LOADED: dict[str, tuple[types.ModuleType, bytes]] = {}
_LOCK = threading.Lock()
#: process-wide sequence numbers: module names and dlopen path spellings never repeat
_SEQ = itertools.count()
_FD_PATH_SEQ = itertools.count(int.from_bytes(os.urandom(8), "little") >> 1)
_BIT_TOKENS = str.maketrans({"0": "/", "1": "./"})
_MEMFD_SEALS = sum(getattr(fcntl, f"F_SEAL_{s}", 0) for s in ("SEAL", "SHRINK", "GROW", "WRITE"))


def _exec_extension(name: str, path: str) -> types.ModuleType:
    # an explicit loader: the path of a memfd has no ``.so`` suffix to find one by
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load Inductor kernel {name}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _unique_fd_path(fd: int) -> str:
    """A ``/proc/self/fd/<fd>`` spelling no library loaded in this process has.

    The dynamic linker hands back the already-loaded library for a path string it
    has seen before, and fd numbers are reused once closed: a second kernel loaded
    through ``/proc/self/fd/5`` would silently be the first one. Each load spells
    the path differently: ``/`` and ``./`` components (which the kernel resolves
    to the same fd) encode a process-wide sequence number that starts at a random
    64-bit value, so even a reloaded copy of this module never repeats a spelling.
    """
    return f"/proc/self/fd/{format(next(_FD_PATH_SEQ), '064b').translate(_BIT_TOKENS)}{fd}"


def _dlopen_bytes(name: str, blob: bytes) -> types.ModuleType:
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None and os.path.isdir("/proc/self/fd"):
        try:
            fd = memfd_create("tcb_kernel", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                _write_all(fd, blob)
                with contextlib.suppress(OSError):  # defence in depth: nobody writes it after this
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _MEMFD_SEALS)
                return _exec_extension(name, _unique_fd_path(fd))
            except (ImportError, OSError):
                pass  # e.g. memfd exec forbidden (vm.memfd_noexec): the private copy below
            finally:
                os.close(fd)
    tmp = tempfile.mkdtemp(prefix="tcb_kernel_")  # 0700, ours
    try:
        path = os.path.join(tmp, "kernel.so")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            _write_all(fd, blob)
        finally:
            os.close(fd)
        return _exec_extension(name, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_all(fd: int, blob: bytes) -> None:
    view = memoryview(blob)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError("short write of a kernel copy")
        view = view[n:]


def pin_threads(call: Callable[[list[Any]], Any], threads: int | None) -> Callable[[list[Any]], Any]:
    """Run ``call`` with the thread count its C++ kernels were built for.

    Inductor sizes per-thread reduction buffers by the compile-time thread count
    and, when that equals the CPU count, emits a plain ``omp parallel``; a
    process that runs with more threads would index past those buffers. The
    thread count is not a key factor (so caches hit across machines and launch
    settings): this pin is what keeps a 2-thread artifact correct under 8 threads
    and an 8-thread one under 2. One C call per graph call when the counts match;
    ``threads`` None (no OpenMP in the kernels) pins nothing."""
    if not threads:
        return call
    get, set_ = torch.get_num_threads, torch.set_num_threads

    def pinned(args: list[Any]) -> Any:
        current = get()
        if current == threads:
            return call(args)
        set_(threads)
        try:
            return call(args)
        finally:
            set_(current)

    return pinned


def resolve_ref(ref: str) -> Any:
    """Resolve ``"module:attr.path"`` (e.g. ``"torch:ops.aten.mm.out"``) to the object."""
    module_name, _, attr_path = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr_path.split(".")):
        obj = getattr(obj, part)
    return obj


def real_extern_kernels() -> Any:
    """Inductor's own ``extern_kernels`` namespace (fallback: imports torch._inductor)."""
    from torch._inductor.select_algorithm import extern_kernels

    return extern_kernels


def run_intermediate_hooks(name: str, val: Any) -> None:
    """No-op stand-in: intermediate hooks are a debugging aid registered in-process."""


@contextlib.contextmanager
def maybe_profile(should_profile: bool, *args: Any, **kwargs: Any) -> Iterator[Any]:
    """Same contract as Inductor's helper, for wrappers that profile themselves."""
    if should_profile:
        with torch.profiler.profile(*args, **kwargs) as prof:
            yield prof
    else:
        yield


def align(nbytes: int) -> int:
    """Round ``nbytes`` up to Inductor's allocation alignment (memory planning)."""
    return (nbytes + ALIGN_BYTES - 1) & -ALIGN_BYTES


#: names the rewritten wrapper expects in its globals instead of Inductor imports
SHIMS: dict[str, Any] = {
    "run_intermediate_hooks": run_intermediate_hooks,
    "maybe_profile": maybe_profile,
    "align": align,
}


def exec_wrapper(code: types.CodeType, namespace: dict[str, Any], filename: str) -> types.ModuleType:
    """Execute a rewritten wrapper as a module (so tracebacks point at ``filename``)."""
    module = types.ModuleType(f"_tcb_wrapper_{abs(hash(filename)):x}")
    module.__file__ = filename
    module.__dict__.update(namespace)
    exec(code, module.__dict__)  # noqa: S102 - our own stored code
    return module


def lean_callable(call: Callable[[list[Any]], Any], info: dict[str, Any]) -> Callable[..., list[Any]]:
    """Wrap the wrapper's boxed ``call`` with the little AOTAutograd does for lean graphs.

    Lean graphs need no input-mutation epilogue and no alias regeneration, so what
    is left of AOTAutograd's inference runtime is: run with grad (and, if it was
    on at compile time, autocast) disabled, bump version counters of inputs the
    graph mutates, tag dynamic output dims for Dynamo, and replay a grad-mode
    change made inside the graph.
    """
    disable_amp = bool(info.get("disable_amp"))
    bump: tuple[int, ...] = tuple(info.get("bump_version", ()))
    dyn_dims: list[tuple[int, set[int]]] = [(int(i), set(d)) for i, d in info.get("dynamic_dims", [])]
    grad_after = info.get("grad_enabled_mutation")
    set_grad = torch._C._set_grad_enabled
    is_grad = torch.is_grad_enabled

    def run(*args: Any) -> list[Any]:
        if bump:
            torch._C._increment_version(tuple(args[i] for i in bump))
        grad = is_grad()
        if grad:
            set_grad(False)
        try:
            if disable_amp:
                with torch._C._DisableAutocast():
                    outs = call(list(args))
            else:
                outs = call(list(args))
        finally:
            if grad:
                set_grad(True)
        outs = list(outs)
        for i, dims in dyn_dims:
            mark_dynamic(outs[i], dims)
        if grad_after is not None:
            set_grad(grad_after)
        return outs

    return run


def mark_dynamic(t: Any, dims: set[int]) -> None:
    """Tell a later Dynamo trace which dims of an output are dynamic (as AOTAutograd's runtime does)."""
    if not isinstance(t, torch.Tensor):
        return
    if hasattr(t, "_dynamo_propagated_dynamic_indices"):
        t._dynamo_propagated_dynamic_indices |= dims
    else:
        t._dynamo_propagated_dynamic_indices = dims.copy()


def aot_runtime_wrap(
    call: Callable[[list[Any]], Any], runtime_metadata_blob: bytes, disable_amp: bool
) -> Callable[..., Any]:
    """Fallback: rebuild AOTAutograd's real inference runtime wrapper around ``call``.

    Used for graphs returning aliases of inputs, aliases of intermediates that
    need autograd, or input mutations AOTAutograd applies outside the graph,
    where replaying its epilogue ourselves would be a re-implementation.
    Imports torch._dynamo (first: runtime_wrappers has a circular import on it).
    """
    import pickle

    import torch._dynamo  # noqa: F401  - must precede runtime_wrappers
    from torch._functorch._aot_autograd.runtime_wrappers import RuntimeWrapper

    meta = pickle.loads(runtime_metadata_blob)  # noqa: S301 - our own stored metadata
    # post_compile only reads keep_inference_input_mutations from the AOTConfig
    aot_config: Any = types.SimpleNamespace(keep_inference_input_mutations=meta.keep_input_mutations)
    runtime = RuntimeWrapper(indices_of_inps_to_detach=[], trace_joint=False, disable_amp=disable_amp)
    wrapped = runtime.post_compile(_boxed(call), aot_config, runtime_metadata=meta)

    def run(*args: Any) -> Any:
        return wrapped(list(args))

    return run


def _boxed(call: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    def boxed(args: list[Any]) -> Any:
        return call(args)

    boxed._boxed_call = True  # type: ignore[attr-defined]
    return boxed


def build_extern_namespace(refs: dict[str, str], use_inductor: bool) -> Any:
    """The ``extern_kernels`` object the wrapper calls into.

    Lean artifacts resolve each recorded reference (all plain torch callables);
    others use Inductor's real namespace.
    """
    if use_inductor:
        return real_extern_kernels()
    return types.SimpleNamespace(**{name: resolve_ref(ref) for name, ref in refs.items()})


def kernel_loader(files: dict[str, bytes], kernels: dict[str, Sequence[str]]) -> Callable[[str], Callable[..., Any]]:
    """``_load_kernel(name)`` for the rewritten wrapper: kernel name -> its verified bytes."""

    set_tensor_data_ptr_env()

    def _load_kernel(name: str) -> Callable[..., Any]:
        fname, digest = kernels[name]
        return load_kernel(files[fname], digest)

    return _load_kernel
