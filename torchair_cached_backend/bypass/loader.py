"""The guard-bypass loader: rebuild a function from its saved program and graphs.

No tracing, no compile: Dynamo's transformed bytecode is turned back into a
function bound to the live module's globals (so parameters and buffers are
read from the live module on every call), the compiled graphs are loaded from
the graph store under the names the bytecode calls, and the frame's recorded
guards stand in for Dynamo's:

* at load, the guards on globals, closure cells and the bound receiver (its
  attributes, submodules, config objects, parameters' metadata) are evaluated
  once; a variant whose guards fail is never replayed, and the log names the
  value that changed (``self.scale: 2.0 -> 3.0``);
* per call, the guards that depend on the arguments or can change between
  calls (tensor metadata, shape relations, non-tensor argument values, grad
  mode, autocast, default dtype, ``training`` flags) select the variant; when
  none matches, the call is compiled by Dynamo (the program then gains that
  variant) - never a stale variant, never a crash inside a kernel.

This module is the hit path. What a program needs only sometimes is imported when
it does: a miss (``loader_miss``), the code after a graph break (``loader_resume``),
methods compiled on their own (``loader_callees``); graphs load through ``graph_load``.
"""

from __future__ import annotations

import builtins
import logging
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from .. import code_codec, graph_load, preload
from ..compilers import get_compiler
from ..logs import log, warn_once
from ..options import BackendOptions, parse_options
from ..stats import record
from .dynamo_stub import module_for
from .guard_runtime import CHECKS_FORMAT, GuardChecks, build_checks, receiver_locals
from .program import PROGRAM_FORMAT, program_key, program_store, target_identity
from .replay import ReplayedFunction, Variant, always
from .shared_load import SharedLoad
from .sources import stale_sources, tensor_state, tensor_state_difference


class CacheMiss(LookupError):
    """No usable program for this function; the message says why."""


class _Rejected(Exception):
    """One variant cannot be replayed here; the message says why. ``explain`` completes it
    when it is first read: naming the failing guards walks each of them with its text (~17 ms
    for a transformers attention's 920), paid only when the reason is shown, not for every
    older variant passed over on the way to the one that fits."""

    def __init__(self, message: str, explain: Callable[[], str] | None = None) -> None:
        super().__init__(message)
        self._explain = explain

    def __str__(self) -> str:
        if self._explain is not None:
            explain, self._explain = self._explain, None
            try:
                detail = explain()
            except Exception as exc:  # never fail a load for its message
                detail = f"(not named: {type(exc).__name__})"
            self.args = (self.args[0] + detail,)
        return str(self.args[0])


def module_call_target(target: Any) -> Any:
    """``model.__call__`` (what transformers' ``get_compiled_call`` compiles) stands for
    the module itself: Dynamo skips ``nn.Module.__call__`` and files the frame under
    the module's ``forward``; the replay runs the hooks as ``__call__`` does."""
    import torch

    if isinstance(target, types.MethodType) and isinstance(target.__self__, torch.nn.Module):
        if target.__func__ in (torch.nn.Module.__call__, torch.nn.Module._call_impl):
            return target.__self__
    return target


def resolve_target(target: Any) -> tuple[types.FunctionType, Any]:
    """(plain function, bound receiver or None) for a module, bound method (incl.
    classmethods: the receiver is the class) or function."""
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


def build_replay(
    target: Any, options: BackendOptions, fallback: Callable[[], Callable[..., Any]] | None = None,
    shared: SharedLoad | None = None,
) -> ReplayedFunction:
    """Rebuild ``target`` from the cache or raise :class:`CacheMiss` saying why. ``shared``:
    what the loads of one program (a model's layers) share (``shared_load``)."""
    t0 = time.perf_counter()
    target = module_call_target(target)
    func, bound_self = resolve_target(target)
    key, files, program, name = _cached_program(func, bound_self, options, shared)
    compiler_name = options.resolved_compiler()
    if options.guards == "none":
        warn_once("guards-none", "npu_cached: guards='none': warm starts replay without checking what Dynamo "
                  "specialized on (torchair's behaviour); a changed model or input is not detected")
    builder = _ReplayBuilder(files, program, options, func, bound_self, key, shared=shared)
    stand_ins: list[Any] = []
    if program.get("callees") and bound_self is not None and not isinstance(bound_self, type):
        from .loader_callees import cell_callees

        builder.cells, stand_ins = cell_callees(func, bound_self, program["callees"])
    variants: list[Variant] = []
    rejected: list[_Rejected] = []
    for variant in reversed(program.get("variants", [])):  # newest first, as Dynamo's cache
        try:
            variants.append(builder.variant(variant))
        except _Rejected as exc:  # kept without its traceback: its frames (this one too) would make a
            rejected.append(exc.with_traceback(None))  # cycle holding the whole program until a collection
    if not variants and program.get("eager_root") and not rejected:
        # Dynamo skipped this frame (e.g. a graph break in a loop over layers): it runs as
        # Python, as under torch.compile, and the methods it calls replay (installed below)
        log.info("npu_cached: %s itself runs as Python (Dynamo skipped its frame); the methods it calls replay",
                 name)
        runs = func
        if builder.cells:  # its cells leading to a method replayed on its own hold that method's stand-in
            from .loader_callees import with_cells

            runs = with_cells(func, builder.cells)
        variants.append(Variant(always, runs, None))
    if not variants:
        why = " | ".join(list(dict.fromkeys(map(str, rejected)))[:2]) or "it has no variant"
        if len(rejected) > 2:
            why += f" | ({len(rejected) - 2} more variant(s) rejected)"
        raise CacheMiss(f"cached program for {name} does not fit: {why}")
    for reason in dict.fromkeys(map(str, rejected)) if log.isEnabledFor(logging.INFO) else ():
        log.info("npu_cached: %s: a cached variant is not used here: %s", name, reason)
    if options.guards == "none" or not options.check_inputs:
        variants = [Variant(always, variants[0].fn, None, variants[0].used)]
    if fallback is None:
        fallback = _torch_compile_fallback(target, options)
    import torch

    module = bound_self if isinstance(bound_self, torch.nn.Module) and func is type(bound_self).forward else None
    if module is not None and not isinstance(target, torch.nn.Module):
        module = None
    replay = ReplayedFunction(variants, bound_self, name, fallback, module, original=func)
    if program.get("callees") and bound_self is not None and not isinstance(bound_self, type):
        from .loader_callees import install_callees

        install_callees(bound_self, program["callees"], options, name, builder.shared)
    if stand_ins:  # methods reached through a decorator's cell (``loader_callees``)
        from .loader_callees import install_cell_callees

        install_cell_callees(stand_ins, bound_self, options, name, builder.shared.child("cells"))
    dt = time.perf_counter() - t0
    record(bypass_loads=1, load_seconds=dt)
    log.info("npu_cached bypass load %s (%s, %d of %d variant(s)) in %.3fs", name, compiler_name,
             len(variants), len(program.get("variants", [])), dt)
    return replay


def _cached_program(
    func: types.FunctionType, bound_self: Any, options: BackendOptions, shared: SharedLoad | None = None
) -> tuple[str, dict[str, bytes], dict[str, Any], str]:
    """``(key, files, program, name)`` of the program cached for ``func`` bound to
    ``bound_self``, or :class:`CacheMiss` saying why (none stored, another format)."""
    preload.caller_loading()  # the background thread's optional work gives way
    code = func.__code__
    compiler_name = options.resolved_compiler()
    identity = target_identity(func, bound_self)
    name = getattr(func, "__qualname__", None) or identity["qualname"]  # a decorated forward keeps its own name
    key = program_key(identity, code_codec.code_fingerprint(code), compiler_name, options)
    store = program_store(options.cache_dir)
    entry = store.load(key) if shared is None else shared.load(store, key)
    if entry is None:
        from .loader_miss import _why_missing

        raise CacheMiss(_why_missing(store, identity, key, code, compiler_name, options.cache_dir, name))
    program = entry.manifest.get("program") or {}
    if program.get("format") != PROGRAM_FORMAT:
        raise CacheMiss(f"cached program for {name} has another format (written by another version)")
    return key, entry.files, program, name


def _torch_compile_fallback(target: Any, options: BackendOptions) -> Callable[[], Callable[..., Any]]:
    """``torch.compile`` of what a replay stands for. For a module that is its
    ``forward`` (bound): the replay runs the module's hooks itself, and a replay
    installed as ``model.forward`` must not call back into ``model.__call__``."""

    # a module's forward: set on the instance (read now: a replay swaps in its own while it
    # runs the module's hooks), or the class's
    own = instance_forward(target)

    def make() -> Callable[..., Any]:
        import torch

        from ..backend import make_backend

        kwargs = {k: v for k, v in options.as_dict().items() if v is not None}
        compiled = target
        if isinstance(target, torch.nn.Module):
            compiled = own or types.MethodType(type(target).forward, target)
        return torch.compile(compiled, backend=make_backend(**kwargs), dynamic=options.dynamic)

    return make


class _Site:
    """The parts of a function a frame is rebuilt with (for ``wrap_inline`` frames)."""

    def __init__(self, defaults: Any, kwdefaults: Any, closure: tuple[Any, ...], freevars: tuple[str, ...]) -> None:
        self.__defaults__ = defaults
        self.__kwdefaults__ = kwdefaults
        self.__closure__ = closure
        self.__code__ = types.SimpleNamespace(co_freevars=freevars)


def _without_receiver(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(receiver: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return call


class _ReplayBuilder:
    """Builds the variants of one program: checks, frame functions, graphs."""

    def __init__(
        self, files: dict[str, bytes], program: dict[str, Any], options: BackendOptions, func: Any, bound_self: Any,
        key: str = "", lazy_full: bool = False, shared: SharedLoad | None = None,
    ) -> None:
        self.key = key
        #: what the loads of this program share (a model's layers); a fresh one when alone
        self.shared = SharedLoad() if shared is None else shared
        self._tensor_state: dict[str, list[Any]] | None = None
        #: the backend route: a root variant whose per-call check is the full check gets
        #: ``check=None`` (the full check is decoded where first used: ``frame_install``)
        self.lazy_full = lazy_full
        self.files = files
        self.program = program
        self.frames: dict[str, Any] = program.get("frames", {})
        self.scope: dict[str, Any] = func.__globals__
        self.options = options
        self.func = func
        self.bound_self = bound_self
        self.graph_store = graph_load.graph_store(options)
        self.values: dict[str, Any] = {}  # our global name -> value (installed into scope once all checks pass)
        self.context: dict[str, dict[str, Any]] = {}
        self.consts: dict[str, Any] = {}  # decoded guard constants, shared by the program's frames
        self.renames: dict[str, str] = {}
        #: free variable -> stand-in: a decorator's cell holding a method compiled on its own (``loader_callees``)
        self.cells: dict[str, Any] = {}
        if program.get("callees"):  # methods / helpers Dynamo compiled on their own (``loader_callees``)
            from .loader_callees import global_callees

            self.renames = global_callees(self, program["callees"])

    def _code(self, blob: str) -> types.CodeType:
        code = self.shared.codes.get(blob)
        if code is None:
            code = self.shared.codes[blob] = code_codec.loads_code(self.files[blob], verified=True)  # sha256 checked
        if not self.renames:
            return code
        from .code_names import renamed  # only programs with callees rename: not on every hit

        return renamed(code, self.renames)

    # -- variants -------------------------------------------------------
    def variant(self, variant: dict[str, Any]) -> Variant:
        fid = variant["root"]
        frame = self.frames.get(fid)
        if frame is None:
            raise _Rejected(f"frame {fid} is missing from the program")
        self._frame_usable(frame)
        if self.bound_self is not None and variant.get("tensor_state") is not None:
            if self._tensor_state is None:
                self._tensor_state = tensor_state(self.bound_self) or {}
            diffs = tensor_state_difference(variant["tensor_state"], self._tensor_state)
            if diffs:
                raise _Rejected(f"parameters/buffers changed ({'; '.join(diffs[:3])})")
        site = self._site(frame)
        checks = self._checks(frame, resume=False, site=site)
        pending = self._globals(frame)  # also builds resume groups and loads graphs
        for name, value in pending.items():
            self.scope[name] = value
        code = self._code(frame["code"])
        closure = site.__closure__
        if self.cells and site is self.func:  # the checks (built above) keep the function's own cells
            from .loader_callees import swapped_closure

            closure = swapped_closure(self.func, self.cells)
        fn: Callable[..., Any] = types.FunctionType(code, self.scope, code.co_name, site.__defaults__, closure)
        fn.__kwdefaults__ = site.__kwdefaults__  # type: ignore[attr-defined]
        used = ((self.options.cache_dir, self.key), fid)
        if checks is not None and self.lazy_full and not frame.get("wrapper") and self._checks_all(checks):
            return Variant(None, fn, checks, used)
        check: Callable[..., bool] = always if checks is None else self._per_call(checks)
        if frame.get("wrapper") and self.bound_self is not None:  # inner(*args): called without the receiver
            fn, check = _without_receiver(fn), _without_receiver(check)
        return Variant(check, fn, checks, used)

    def _site(self, frame: dict[str, Any]) -> Any:
        """What the frame's function is made with: the replayed function's defaults and
        closure, or for Dynamo's ``wrap_inline`` frame (a torch.nn built-in or decorated
        forward: ``inner(*args, **kwargs)`` calling ``fn``) a closure over what it wraps."""
        wrapper = frame.get("wrapper")
        if not wrapper:
            return self.func
        kind = wrapper.get("kind")
        if kind == "module" and self.bound_self is not None:
            wrapped: Any = self.bound_self
        elif kind == "method" and self.bound_self is not None:
            wrapped = types.MethodType(self.func, self.bound_self)
        elif kind == "function" and self.bound_self is None:
            wrapped = self.func
        else:
            raise _Rejected(f"it was compiled for another kind of target ({kind})")
        return _Site(None, None, (types.CellType(wrapped),), ("fn",))

    def _fixed(self, checks: GuardChecks) -> bool:
        """Whether the frame's receiver is fixed for the replay's lifetime (or it has none):
        then its guards and the globals' are checked once at load, the rest per call."""
        return checks.receiver is None or self.bound_self is not None

    def _checks_all(self, checks: GuardChecks) -> bool:
        """Whether every recorded guard is checked per call (``guards="call"``, a receiver not fixed at load)."""
        return not (self._fixed(checks) and self.options.guards != "call")

    def _per_call(self, checks: GuardChecks) -> Callable[..., bool]:
        return checks.full if self._checks_all(checks) else checks.call

    def _frame_usable(self, frame: dict[str, Any]) -> None:
        if frame.get("unsupported"):
            raise _Rejected(f"it was not replayable when captured: {frame['unsupported']}")
        blob = frame.get("code")
        stale = self.shared.stale.get(blob) if blob else None
        if stale is None:
            stale = stale_sources(frame.get("traced", []))
            if blob:
                self.shared.stale[blob] = stale
        if stale:
            raise _Rejected(f"code changed since caching ({'; '.join(stale[:3])})")

    def _checks(self, frame: dict[str, Any], resume: bool, site: Any = None) -> GuardChecks | None:
        """The frame's checks; load-time guards evaluated now (a failure rejects it)."""
        site = self.func if site is None else site
        guards = frame.get("guards") or {}
        if self.options.guards == "none":
            return None
        if guards.get("format") != CHECKS_FORMAT or not guards.get("code"):
            raise _Rejected("its guards were not recorded by this version")
        receiver = guards.get("receiver")
        bound = self.bound_self is not None and receiver is not None
        for name, desc in frame.get("globals", {}).items():  # guards may read Dynamo's (renamed) globals
            if desc["kind"] in ("module", "builtins", "value") and name not in self.values:
                self.values[name] = self.scope[name] = self._light_value(desc)  # _globals reuses it
        # checks read the receiver from the locals: the same for every receiver of one function,
        # built once for the loads of the program (``shared_load``); but a continuation's
        # per-call check holds its receiver (``___recv``): its load-time guards (which never
        # read it) are evaluated on the shared checks first, its own built only if they hold
        bind = resume and bound
        if bind and self.options.guards == "call":  # no load-time evaluation to filter by
            return self._build_checks(guards, receiver, True, resume, site)
        memo = (guards["code"], 0) if resume else (guards["code"], id(site)) if site is self.func else None
        hit = self.shared.checks.get(memo) if memo else None
        if hit is not None and hit[0] is site:
            checks = hit[1]
        else:
            checks = self._build_checks(guards, receiver, False, resume, site)
            if memo:
                self.shared.checks[memo] = (site, checks)
        if not self._checks_all(checks):  # "call" checks them all per call, against the state then
            local = receiver_locals(receiver, self.bound_self) if bound else {}
            if not resume and site.__closure__:
                for name, cell in zip(site.__code__.co_freevars, site.__closure__, strict=False):
                    try:
                        local[name] = cell.cell_contents
                    except ValueError:  # an empty cell
                        continue
            if not checks.load_holds(local):
                raise _Rejected("what it was specialized on changed: ",
                                lambda: "; ".join(checks.load_failures(local)[:3]))
        return self._build_checks(guards, receiver, True, resume, site) if bind else checks

    def _build_checks(self, guards: dict[str, Any], receiver: str | None, bind: bool, resume: bool,
                      site: Any) -> GuardChecks:
        try:
            checks = build_checks(self.files[guards["code"]], guards.get("consts", []), guards.get("meta", []),
                                  self.scope, receiver, self.bound_self if bind else None, self.consts,
                                  (self.shared.codes, guards["code"]))
        except code_codec.CodecError as exc:
            raise _Rejected(f"a value its guards compare with cannot be rebuilt here: {exc}") from exc
        if not resume:
            kwdefaults = dict(site.__kwdefaults__ or {})
            if guards.get("uses_cells"):
                kwdefaults["___cells"] = site.__closure__ or ()
            checks.set_defaults(site.__defaults__, kwdefaults)
        return checks

    def _light_value(self, desc: dict[str, Any]) -> Any:
        kind = desc["kind"]
        if kind == "module":
            return module_for(desc["name"])
        if kind == "builtins":
            return builtins.__dict__
        return code_codec.decode_value(desc["value"])

    def _globals(self, frame: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, desc in frame.get("globals", {}).items():
            if name in self.values:
                out[name] = self.values[name]
                continue
            kind = desc["kind"]
            if kind == "graph":
                value: Any = self._graph(desc["key"], desc["compiler"])
            elif kind == "split":  # Dynamo's DDP optimizer's split of cached graphs
                value = self._split(desc)
            elif kind == "resume":
                value = self._resume(desc["origin"], name)
            elif kind in ("module", "builtins", "value"):
                value = self._light_value(desc)
            else:
                raise _Rejected(f"unknown global kind {kind!r} (written by a newer version?)")
            self.values[name] = value
            out[name] = value
        return out

    # -- resume groups (programs with graph breaks: ``loader_resume``) ---
    def _resume(self, origin: str, global_name: str = "") -> Any:
        """The stand-in for a resume function: its variants, routed by receiver if need be."""
        from .loader_resume import build_resume

        return build_resume(self, origin, global_name)

    # -- graphs ---------------------------------------------------------
    def _split(self, desc: dict[str, Any]) -> Any:
        """Dynamo's DDP optimizer's split graph, rebuilt over its cached pieces."""
        from .split_graph import SplitGraph

        parts = {part: (self._graph(d["key"], d["compiler"]), bool(d["unwrap"])) for part, d in desc["parts"].items()}
        try:
            return SplitGraph(desc["steps"], parts)
        except (KeyError, IndexError, TypeError, ValueError, StopIteration) as exc:
            raise _Rejected(f"its split graph (DDP) cannot be rebuilt: {exc!r}") from exc

    def _graph(self, key: str, compiler_name: str) -> Callable[..., Any]:
        """The graph ``key`` loaded (once for the loads of the program: a key names one artifact)."""
        loaded = self.shared.graphs.get(key)
        if loaded is None:
            loaded = self.shared.graphs[key] = self._load_graph(key, compiler_name)
        return loaded

    def _load_graph(self, key: str, compiler_name: str) -> Callable[..., Any]:
        compiler = get_compiler(compiler_name)
        entry = self.graph_store.load(key)  # read and verified once: the context check and the load share it
        if entry is None:
            raise _Rejected(f"graph {key[:12]} of the cached program is missing or broken")
        self._verify_context(key, compiler, entry.manifest)
        graph = graph_load.load_graph(_LoadedEntry(self.graph_store, entry), key, compiler, self.options)
        if graph is None:
            raise _Rejected(f"graph {key[:12]} of the cached program is missing or broken")
        return graph.fn

    def _verify_context(self, key: str, compiler: Any, manifest: dict[str, Any]) -> None:
        """The graph's key factors that do not depend on the graph (compiler settings,
        thread count, deterministic mode, versions...) must equal this process's:
        a factor in the key protects this route too."""
        from .. import key as keys

        context_factors = getattr(keys, "context_factors", None)
        if context_factors is None:
            return
        if compiler.name not in self.context:
            self.context[compiler.name] = context_factors(compiler, self.options)
        expected = self.context[compiler.name]
        stored = manifest.get("factors") or {}
        diffs = keys.explain_difference({k: stored.get(k) for k in expected}, expected)
        diffs += keys.stale_call_targets(stored.get("call_targets"))  # functions/ops the graph calls by name
        if diffs:
            raise _Rejected(f"graph {key[:12]} was compiled under other settings ({'; '.join(diffs[:3])})")


class _LoadedEntry:
    """The graph store as ``load_graph`` sees it, serving the entry this load already read
    and verified (its other operations, e.g. quarantine, go to the store)."""

    def __init__(self, store: Any, entry: Any) -> None:
        self._store = store
        self._entry = entry

    def load(self, key: str) -> Any:
        return self._entry if key == self._entry.key else self._store.load(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


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
    cached, changed code or specializations) it logs why and, with
    ``fallback=True``, returns ``torch.compile(target, backend="npu_cached")``
    so the cache is rebuilt; with ``fallback=False`` it raises :class:`CacheMiss`.
    ``guards`` (option): ``"load"`` (default), ``"call"`` or ``"none"``.
    """
    opts = parse_options(dict(options, cache_dir=cache_dir, compiler=compiler, check_inputs=check_inputs))
    target = module_call_target(target)
    if _is_ddp(target):
        from .loader_routes import _load_ddp

        return _load_ddp(target, opts, fallback)
    target = own_call(_unwrapped(target))
    if instance_forward(target) is not None:
        from .loader_routes import _load_instance_forward

        return _load_instance_forward(target, opts, fallback)
    return _replay_or_compile(target, opts, fallback)


def _replay_or_compile(target: Any, options: BackendOptions, fallback: bool) -> Callable[..., Any]:
    """The replay of ``target``; on a miss, with ``fallback``, a stand-in that compiles it
    (logged), else the :class:`CacheMiss`."""
    try:
        return build_replay(target, options)
    except CacheMiss as miss:
        if not fallback:
            raise
        log.info("npu_cached: %s; compiling instead", miss)
        from .loader_miss import _stand_in

        return _stand_in(target, options, miss)


def _unwrapped(target: Any) -> Any:
    """``load(torch.compile(model), dir)``: the module ``torch.compile`` wrapped (its
    ``OptimizedModule`` has no forward of its own)."""
    optimized = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    for _ in range(8):
        if optimized is None or not isinstance(target, optimized):
            break
        target = target._orig_mod
    return target


def own_call(target: Any) -> Any:
    """A module whose class overrides ``__call__`` (``return super().__call__(x) * 2``) is
    called through it, and Dynamo compiled that frame: it stands for the bound ``__call__``,
    not for ``forward``."""
    import torch

    if not isinstance(target, torch.nn.Module):
        return target
    call = type(target).__call__
    if isinstance(call, types.FunctionType) and call not in (torch.nn.Module.__call__, torch.nn.Module._call_impl):
        return types.MethodType(call, target)
    return target


def instance_forward(target: Any) -> Any:
    """The ``forward`` set on a module instance (``m.forward = types.MethodType(f, m)``, a
    ``functools.partial``...), which ``nn.Module.__call__`` runs instead of the class's;
    None when there is none or it is a replay of ours (``model.forward = tcb.load(...)``)."""
    import torch

    if not isinstance(target, torch.nn.Module):
        return None
    forward = target.__dict__.get("forward")
    for _ in range(8):  # ``m.forward = torch.compile(m.forward)``: what Dynamo compiles is the function it wraps
        inner = getattr(forward, "_torchdynamo_orig_callable", None)
        if inner is None:
            break
        forward = inner
    if forward is None or isinstance(forward, ReplayedFunction):
        return None
    if isinstance(forward, types.MethodType) and forward.__self__ is target and forward.__func__ is type(target).forward:
        return None  # the class's own forward, bound
    return forward


def _is_ddp(target: Any) -> bool:
    ddp = getattr(sys.modules.get("torch.nn.parallel"), "DistributedDataParallel", None)
    return ddp is not None and isinstance(target, ddp)


def _reason_kind(message: str) -> str:
    """A short, countable reason for ``stats().fallback_reasons``."""
    for needle, kind in (
        ("no cached program", "nothing cached"),
        ("was edited", "function edited"),
        ("code changed", "traced code changed"),
        ("specialized on changed", "guards failed at load"),
        ("not replayable when captured", "not replayable"),
        ("other settings", "compiled under other settings"),
        ("parameters/buffers changed", "parameters changed"),
        ("another format", "older cache format"),
        ("set on the instance", "instance forward not replayed"),
    ):
        if needle in message:
            return kind
    return "other"


#: what only a miss (``loader_miss``) or a DDP module or an instance forward (``loader_routes``)
#: needs: re-exported on first use, never imported by a plain hit
_ELSEWHERE = {"_why_missing": "loader_miss", "_compiling_stand_in": "loader_miss", "_stand_in": "loader_miss",
              "_load_ddp": "loader_routes", "_load_instance_forward": "loader_routes"}


def __getattr__(name: str) -> Any:
    if name in _ELSEWHERE:
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{_ELSEWHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_frame_variants(
    func: types.FunctionType, bound_self: Any, options: BackendOptions, shared: SharedLoad | None = None
) -> tuple[list[Variant], dict[str, Any], dict[str, str]]:
    """For the backend route (``frame_install``): the variants :func:`build_replay` serves for
    ``func`` bound to ``bound_self`` (same key, same checks), without a ``ReplayedFunction``,
    fallback or callee installation (Dynamo's frame cache serves those); plus the program and
    the kind of every global its frames read. An empty list with ``program["eager_root"]``: the
    frame runs as Python. A variant that checks every guard per call has ``check=None``: its
    full check is decoded only when Dynamo first evaluates the installed entry's guard.
    Raises :class:`CacheMiss` saying why. ``shared``: as :func:`build_replay`'s."""
    t0 = time.perf_counter()
    key, files, program, name = _cached_program(func, bound_self, options, shared)
    builder = _ReplayBuilder(files, program, options, func, bound_self, key, lazy_full=True, shared=shared)
    variants: list[Variant] = []
    rejected: list[Any] = []
    for variant in reversed(program.get("variants", [])):
        if (builder.frames.get(variant.get("root")) or {}).get("wrapper"):
            rejected.append("it was compiled through a wrapper frame")
            continue
        try:
            variants.append(builder.variant(variant))
        except _Rejected as exc:
            rejected.append(exc.with_traceback(None))  # named only if no variant fits (no frame cycle: above)
    if not variants and not (program.get("eager_root") and not rejected):
        why = " | ".join(dict.fromkeys(map(str, rejected))) or "no variant"
        raise CacheMiss(f"cached program for {name} does not fit: {why}")
    kinds = {g: d.get("kind", "") for f in builder.frames.values() for g, d in f.get("globals", {}).items()}
    kinds.update({ours: "callee" for ours in builder.renames.values()})
    record(bypass_loads=1, load_seconds=time.perf_counter() - t0)
    return variants, program, kinds
