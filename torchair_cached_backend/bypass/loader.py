"""The guard-bypass loader: rebuild a function from its saved program and graphs.

No tracing, no guards, no compile: Dynamo's transformed bytecode is turned back
into a function bound to the live module's globals (so parameters and buffers
are read from the live module on every call), the compiled graphs are loaded
from the graph store under the names the bytecode calls, and a cheap input
check stands in for the guards.
"""

from __future__ import annotations

import builtins
import importlib
import time
import types
from collections.abc import Callable
from typing import Any

from ..compilers import get_compiler
from ..logs import log
from ..options import BackendOptions, parse_options
from ..stats import record
from ..store import Store
from . import code_codec
from .program import function_identity, program_key, program_store
from .signature import InputSignatureError, SignatureCheck
from .sources import stale_sources, tensor_state, tensor_state_difference


class CacheMiss(LookupError):
    """No usable program for this function; the message says why."""


def resolve_target(target: Any) -> tuple[types.FunctionType, Any]:
    """(plain function, bound self or None) for a module, bound method or function."""
    import torch

    if isinstance(target, torch.nn.Module):
        forward = type(target).forward
        if not isinstance(forward, types.FunctionType):
            raise TypeError(f"{type(target).__qualname__}.forward is not a plain Python function")
        return forward, target
    if isinstance(target, types.MethodType):
        func = target.__func__
        if not isinstance(func, types.FunctionType):
            raise TypeError(f"{target!r} is not bound to a Python function")
        return func, target.__self__
    if isinstance(target, types.FunctionType):
        return target, None
    raise TypeError(
        f"cannot warm-start {type(target).__name__} {target!r}: pass an nn.Module, a bound method or a Python function"
    )


class ReplayedFunction:
    """A function replayed from cache; calls it with the input check in front.

    Calls are bound like the original function's (keywords, defaults, keyword-only
    arguments) to the full argument list the signature was recorded for."""

    def __init__(
        self,
        variants: list[tuple[SignatureCheck, Callable[..., Any]]],
        bound_self: Any,
        arg_names: list[str],
        check_inputs: bool,
        qualname: str,
        func: types.FunctionType | None = None,
    ) -> None:
        self._variants = variants
        self._self = bound_self
        self._arg_names = arg_names
        self._check = check_inputs
        self.__qualname__ = self.__name__ = qualname
        prefix = () if bound_self is None else (bound_self,)
        self._prefix = prefix
        self._fn0 = variants[0][1]
        n_self = len(prefix)
        code = func.__code__ if func is not None else None
        self._n_pos = (code.co_argcount - n_self) if code is not None else len(arg_names)
        self._pos_names = arg_names[: self._n_pos]
        self._kwonly = arg_names[self._n_pos :]
        defaults = (func.__defaults__ or ()) if func is not None else ()
        pos_all = list(code.co_varnames[: code.co_argcount]) if code is not None else []
        self._defaults = dict(zip(pos_all[len(pos_all) - len(defaults) :], defaults, strict=True)) if defaults else {}
        self._kwdefaults = dict((func.__kwdefaults__ or {}) if func is not None else {})
        self._simple = not self._kwonly and not self._defaults

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The values of every recorded argument, in order, as the original would bind them."""
        if len(args) > self._n_pos:
            raise InputSignatureError(
                f"{self.__qualname__}() takes {self._n_pos} positional arguments but {len(args)} were given"
            )
        kwargs = dict(kwargs)
        values = list(args)
        for name in self._pos_names[len(args) :]:
            if name in kwargs:
                values.append(kwargs.pop(name))
            elif name in self._defaults:
                values.append(self._defaults[name])
            else:
                raise InputSignatureError(f"{self.__qualname__}() missing required argument {name!r}")
        for name in self._kwonly:
            if name in kwargs:
                values.append(kwargs.pop(name))
            elif name in self._kwdefaults:
                values.append(self._kwdefaults[name])
            else:
                raise InputSignatureError(f"{self.__qualname__}() missing required keyword-only argument {name!r}")
        if kwargs:
            raise InputSignatureError(f"{self.__qualname__}() got unexpected keyword arguments {sorted(kwargs)}")
        return tuple(values)

    def _invoke(self, fn: Callable[..., Any], values: tuple[Any, ...]) -> Any:
        if not self._kwonly:
            return fn(*self._prefix, *values)
        n = self._n_pos
        return fn(*self._prefix, *values[:n], **dict(zip(self._kwonly, values[n:], strict=False)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or not self._simple or len(args) != self._n_pos:
            args = self._bind(args, kwargs)
        if not self._check:
            return self._invoke(self._fn0, args)
        first_error = None
        for check, fn in self._variants:
            error = check.mismatch(args)
            if error is None:
                check.check_grad()
                return self._invoke(fn, args)
            first_error = first_error or error
        raise InputSignatureError(
            f"{self.__qualname__}: {first_error}. The cache holds a graph for other inputs; "
            "clear the cache entry, or compile with dynamic=True, to serve these inputs"
        )


def build_replay(target: Any, options: BackendOptions) -> ReplayedFunction:
    """Rebuild ``target`` from the cache or raise :class:`CacheMiss` saying why."""
    t0 = time.perf_counter()
    func, bound_self = resolve_target(target)
    code = func.__code__
    compiler_name = options.resolved_compiler()
    identity = function_identity(code, func.__globals__.get("__name__"))
    key = program_key(identity, code_codec.code_fingerprint(code), compiler_name)
    store = program_store(options.cache_dir)
    entry = store.load(key)
    if entry is None:
        raise CacheMiss(_why_missing(store, identity, key, code, compiler_name, options.cache_dir))
    program = entry.manifest["program"]
    if program.get("function", {}).get("varargs"):
        raise CacheMiss(f"{identity['qualname']} takes *args/**kwargs: its replay is not supported, it is compiled instead")
    if program.get("unsupported"):
        raise CacheMiss(f"cached program for {identity['qualname']} cannot be replayed: {program['unsupported']}")
    stale = stale_sources(program.get("traced", []))
    if stale:
        store.remove(key)
        raise CacheMiss(f"cached program for {identity['qualname']} is stale ({'; '.join(stale)}); rebuilding")
    if program.get("tensor_state") is not None and bound_self is not None:
        diffs = tensor_state_difference(program["tensor_state"], tensor_state(bound_self) or {})
        if diffs:
            store.remove(key)
            raise CacheMiss(
                f"parameters/buffers of {type(bound_self).__qualname__} changed since caching ({'; '.join(diffs[:5])}); rebuilding"
            )
    scope = func.__globals__
    builder = _FrameBuilder(entry.files, program["frames"], scope, options, func)
    variants = []
    for variant in program["variants"]:
        fn = builder.function(variant["root"], root=True)
        variants.append((SignatureCheck(variant["signature"], variant["grad_enabled"]), fn))
    if not variants:
        raise CacheMiss(f"cached program for {identity['qualname']} has no variant")
    arg_names = program["variants"][0].get("arg_names", [])
    replay = ReplayedFunction(variants, bound_self, arg_names, options.check_inputs, identity["qualname"], func)
    dt = time.perf_counter() - t0
    record(bypass_loads=1, load_seconds=dt)
    log.info("npu_cached bypass load %s (%s, %d variant(s)) in %.3fs", identity["qualname"], compiler_name, len(variants), dt)
    return replay


def _why_missing(store: Any, identity: dict[str, Any], key: str, code: types.CodeType, compiler: str, cache_dir: str) -> str:
    """Explain a program miss: an entry for an *edited* version of the function is
    stale (removed here, so it is never replayed), else nothing was cached."""
    fingerprint = code_codec.code_fingerprint(code)
    edited = []
    for other in store.keys():
        if other == key:
            continue
        try:
            manifest = store.read_manifest(other) or {}
        except Exception:
            continue
        program = manifest.get("program") or {}
        function = program.get("function") or {}
        if (function.get("module"), function.get("qualname")) != (identity["module"], identity["qualname"]):
            continue
        if program.get("compiler") == compiler and program.get("fingerprint") not in (None, fingerprint):
            edited.append(other)
    for other in edited:
        try:
            store.remove(other)
        except Exception:  # only tidying: the key differs, so the entry can never be replayed anyway
            pass
    if edited:
        return (
            f"cached program for {identity['qualname']} is stale ({identity['qualname']} was edited since it was "
            f"cached); rebuilding"
        )
    return f"no cached program for {identity['qualname']} (compiler {compiler}) in {cache_dir}"


class _LightDynamoUtils:
    """Stands in for ``torch._dynamo.utils`` in replayed bytecode.

    Transformed code calls a few trivial helpers from it (sizes and strides of
    dynamic inputs, runtime-overhead timers); importing Dynamo for them would
    cost a second at start. Anything else is delegated to the real module.
    """

    __name__ = "torch._dynamo.utils"

    @staticmethod
    def call_size(x: Any, i: int) -> int:
        return x.size(i)

    @staticmethod
    def call_stride(x: Any, i: int) -> int:
        return x.stride(i)

    @staticmethod
    def call_storage_offset(x: Any) -> int:
        return x.storage_offset()

    @staticmethod
    def record_pregraph_bytecode_enter() -> None:
        return None

    # Rebuilding user objects the graph returns (dataclasses, plain classes) goes
    # through these: write straight into the instance ``__dict__``, bypassing
    # ``__setattr__`` (frozen dataclasses) exactly as a fresh ``__init__`` would.
    @staticmethod
    def object_setattr_ignore_descriptor(obj: Any, name: str, value: Any) -> None:
        _instance_dict(obj)[name] = value

    @staticmethod
    def object_delattr_ignore_descriptor(obj: Any, name: str) -> None:
        del _instance_dict(obj)[name]

    object_new = staticmethod(object.__new__)
    dict_getitem = staticmethod(dict.__getitem__)
    list_getitem = staticmethod(list.__getitem__)

    @staticmethod
    def record_pregraph_bytecode_exit(cm: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("torch._dynamo.utils"), name)


def _instance_dict(obj: Any) -> dict[str, Any]:
    import threading

    try:
        return object.__getattribute__(obj, "__dict__")
    except AttributeError:
        if isinstance(obj, threading.local):  # its per-thread dict is not visible to object's getattr
            return threading.local.__getattribute__(obj, "__dict__")
        raise


def _module(name: str) -> Any:
    import sys

    if name == "torch._dynamo.utils" and name not in sys.modules:
        return _LightDynamoUtils()
    return importlib.import_module(name)


class _FrameBuilder:
    """Builds frame functions, installing what their bytecode reads from globals."""

    def __init__(
        self, files: dict[str, bytes], frames: dict[str, Any], scope: dict[str, Any], options: BackendOptions, func: Any
    ) -> None:
        self.files = files
        self.frames = frames
        self.scope = scope
        self.options = options
        self.func = func
        self.built: dict[str, Callable[..., Any]] = {}
        self.graph_store = Store(options.cache_dir, "graphs")

    def function(self, fid: str, root: bool = False) -> Callable[..., Any]:
        if fid in self.built:
            return self.built[fid]
        frame = self.frames[fid]
        for name, desc in frame["globals"].items():
            self.scope[name] = self._value(desc)
        code = code_codec.loads_code(self.files[frame["code"]])
        if root:
            fn = types.FunctionType(code, self.scope, code.co_name, self.func.__defaults__, self.func.__closure__)
            fn.__kwdefaults__ = self.func.__kwdefaults__
        else:
            fn = types.FunctionType(code, self.scope, code.co_name)
        self.built[fid] = fn
        return fn

    def _value(self, desc: dict[str, Any]) -> Any:
        kind = desc["kind"]
        if kind == "graph":
            return self._graph(desc["key"], desc["compiler"])
        if kind == "module":
            return _module(desc["name"])
        if kind == "builtins":
            return builtins.__dict__
        if kind == "resume":
            return self.function(desc["frame"])
        if kind == "resume_eager":
            code = code_codec.loads_code(self.files[desc["code"]])
            log.info("npu_cached: resume function %s was never compiled at capture; it runs eagerly", desc["name"])
            return types.FunctionType(code, self.scope, desc["name"])
        if kind == "value":
            return code_codec.decode_value(desc["value"])
        raise CacheMiss(f"unknown global kind {kind!r} in cached program (written by a newer version?)")

    def _graph(self, key: str, compiler_name: str) -> Callable[..., Any]:
        from ..backend import load_graph

        graph = load_graph(self.graph_store, key, get_compiler(compiler_name), self.options)
        if graph is None:
            raise CacheMiss(f"graph {key[:12]} of the cached program is missing or broken")
        return graph.fn


def load(
    target: Any,
    cache_dir: str | None = None,
    *,
    compiler: str = "auto",
    check_inputs: bool = True,
    fallback: bool = True,
    **options: Any,
) -> Callable[..., Any]:
    """Warm-start ``target`` (nn.Module, bound method or function) from a cache
    written by ``torch.compile(..., backend="npu_cached")`` or :func:`cache_compile`.

    Returns a callable with the same arguments as ``target``. On a miss (nothing
    cached, stale source, changed parameters) it logs why and, with
    ``fallback=True``, returns ``torch.compile(target, backend="npu_cached")``
    so the cache is rebuilt; with ``fallback=False`` it raises :class:`CacheMiss`.
    """
    opts = parse_options(dict(options, cache_dir=cache_dir, compiler=compiler, check_inputs=check_inputs))
    try:
        return build_replay(target, opts)
    except CacheMiss as miss:
        if not fallback:
            raise
        log.info("npu_cached: %s; compiling instead", miss)
    import torch

    from ..backend import make_backend

    kwargs = dict(options, cache_dir=opts.cache_dir, compiler=compiler, check_inputs=check_inputs)
    return torch.compile(target, backend=make_backend(**kwargs), dynamic=opts.dynamic)
