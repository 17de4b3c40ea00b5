"""The backend route replays: cached programs installed into Dynamo's frame cache.

``torch.compile(model, backend="npu_cached")`` hands every frame Dynamo has no
cache entry for to a callback (``CatchErrorsWrapper``). For our backend that
callback is :class:`ReplayingCallback`: when the frame's function (and receiver)
has a cached program - the key ``tcb.load()`` uses - it returns the program's
transformed bytecode with our checks as the frame's guard, as PyTorch's own
precompile installs entries: Dynamo stores it in the code object's cache and runs
it, with no tracing and no inner compile. Anything else goes to Dynamo's normal
path (trace + graph cache), which is always safe:

* no program, a stale one, or no variant whose checks hold for this call: Dynamo
  traces (a counted fallback; the capture adds the new variant to the program);
* an installed entry whose guard fails later (another shape, a changed attribute,
  grad mode, another instance): Dynamo calls back, another variant is installed
  or Dynamo traces.

The guard of an entry is, per ``guards=`` (on this route ``"call"`` unless the user
names it, since Dynamo re-checks its guards on every call): ``"load"`` - the frame's load-time
checks evaluated once at install for this receiver, then per call the receiver's
identity (a weak reference) and the per-call checks; ``"call"`` - every recorded
check on every call (any receiver); with ``TCB_GUARD_TREE=1`` evaluated as Dynamo evaluates
its own guards: a C++ guard tree (``guard_tree``) with the kinds it has no exact counterpart for in
one Python lambda guard (the whole check in Python where the tree cannot be built); ``"none"`` - no recorded check (torchair's
behaviour). Always: the function's free variables by identity (the entry is the code
object's, and one decorator's wrapper code serves every method it decorates), and
global module hooks fail the guard (the cached graphs inlined submodules without them). Entries belong to the backend (options) that installed them, so a
``torch.compile`` with other options never reuses them, and ``torch._dynamo.reset()``
drops them with Dynamo's own. The graphs, split graphs, continuations and callees
the bytecode calls run with Dynamo off (``torch._dynamo.disable``), as Dynamo runs
its compiled functions.
"""

from __future__ import annotations

import copy
import dis
import functools
import os
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch._dynamo import convert_frame, trace_rules
from torch._dynamo.guards import GuardManagerWrapper
from torch._dynamo.types import ConvertFrameReturn, FrameAction, FrameExecStrategy, GuardedCode, wrap_guarded_code
from torch._dynamo.utils import orig_code_map
from torch._guards import CompileId

from ..logs import log
from ..preload import check_bisect_environment
from ..stats import record_fallback
from . import trace_ids
from .capture_hook import backend_chain, backend_options
from .code_names import global_names, renamed
from .guard_runtime import receiver_locals
from .replay import global_module_hooks
from .shared_load import SharedLoad
from .signature import call_args
from .sources import RESUME_PREFIX

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
#: global kinds whose values the bytecode calls: run with Dynamo off (Dynamo disables its compiled fns)
_CALLED_KINDS = ("graph", "split", "resume", "callee")
_ROUTE_SUFFIX = "__route"
_MISSING = object()
_installed = False
_original_wrapper: Callable[..., Any] | None = None
#: installs / fallbacks of this process (tests and benchmarks read them)
counts = {"installed": 0, "eager_root": 0, "eager_nested": 0, "fallbacks": 0}


def install_route() -> None:
    """Make Dynamo's frame callback for ``npu_cached`` backends a :class:`ReplayingCallback`
    (idempotent; other backends keep Dynamo's own)."""
    global _installed, _original_wrapper
    if _installed:
        return
    _original_wrapper = convert_frame.catch_errors_wrapper

    def catch_errors_wrapper(callback: Any, hooks: Any) -> Any:
        compiler_fn = getattr(callback, "_torchdynamo_orig_backend", None)
        if compiler_fn is not None and _loader_compiler(compiler_fn):
            return NotingCallback(callback, hooks)  # load()/cache_compile's own compiles: they trace, and mark
        options = _route_options(compiler_fn)
        if options is None:
            return _original_wrapper(callback, hooks)  # type: ignore[misc]
        check_bisect_environment()
        return ReplayingCallback(callback, hooks, options)

    convert_frame.catch_errors_wrapper = catch_errors_wrapper
    from .debug_wrapper import install as defer_backend_debug

    defer_backend_debug()  # a warm torch.compile then never imports Dynamo's minifier
    _installed = True


def _route_options(compiler_fn: Any) -> Any:
    """The options of the ``npu_cached`` backend ``compiler_fn`` (a ConvertFrame's), else None."""
    if compiler_fn is None:
        return None
    try:
        options = backend_options(compiler_fn)
    except Exception:
        return None
    if options is not None and options.guards == "load" and not _guards_chosen(compiler_fn):
        options = copy.copy(options)
        options.guards = "call"  # torch.compile's promise: what Dynamo would re-check per call is re-checked
    return options


def _loader_compiler(compiler_fn: Any) -> bool:
    """Whether ``compiler_fn`` is (or wraps) ``make_backend()``'s backend: ``load()`` and
    ``cache_compile``'s compiles, which tried the cache already and never replay here."""
    return any(getattr(fn, "replay_route", True) is False for fn in backend_chain(compiler_fn))


def _guards_chosen(compiler_fn: Any) -> bool:
    """Whether the user named ``guards`` in ``torch.compile(..., options=...)`` (or passed
    parsed options). Unnamed, the backend route checks every recorded guard on every call,
    as Dynamo's own guards do: a module attribute changed between two calls retraces
    instead of replaying the old graph. ``guards="load"`` is the faster, ``load()``-like
    choice for code that does not mutate module state between calls."""
    for fn in backend_chain(compiler_fn):
        if type(getattr(fn, "options", None)).__name__ == "BackendOptions":
            return True
        kwargs = getattr(fn, "kwargs", None)
        if isinstance(kwargs, dict) and "guards" in (kwargs.get("options") or {}):
            return True
    return False


def _skip(recursive: bool) -> ConvertFrameReturn:
    second = FrameAction.SKIP if recursive else FrameAction.DEFAULT
    return ConvertFrameReturn(frame_exec_strategy=FrameExecStrategy(FrameAction.SKIP, second), apply_to_code=True)


class NotingCallback(convert_frame.CatchErrorsWrapper):
    """Dynamo's own path, which the capture follows, plus what the capture cannot see: a
    continuation Dynamo compiled nothing in (no guarded code) is marked in its group, so
    every route's warm start runs it as Python instead of handing it to Dynamo again. As is,
    the callback of ``load()``/``cache_compile``'s compiles."""

    def __call__(self, frame: Any, cache_entry: Any, frame_state: Any) -> ConvertFrameReturn:
        trace_ids.enter()  # id()/hash() of objects stay compile-time-only in what this trace caches
        try:
            result = super().__call__(frame, cache_entry, frame_state)
        finally:
            trace_ids.leave()
        code = frame.f_code
        if frame_state is not None and result.guarded_code is None and code.co_name.startswith(RESUME_PREFIX):
            capture = sys.modules.get(_CAPTURE)  # loaded where frames were captured (a cold start)
            if capture is not None:
                capture.note_python_resume(code)
        return result


class ReplayingCallback(NotingCallback):
    """Dynamo's callback for one ``npu_cached`` backend: replay a cached program when
    one fits the frame, else Dynamo's own path."""

    def __init__(self, callback: Any, hooks: Any, options: Any) -> None:
        super().__init__(callback, hooks)
        self._tcb_options = options
        #: (id(function), id(receiver)) -> (receiver ref, variants, kinds, program, function): built once each
        self._tcb_built: dict[tuple[int, int], tuple[Any, list[Any], dict[str, str], dict[str, Any], Any]] = {}
        self._tcb_compiles = 0
        #: codes with no program when first seen here (a cold start): Dynamo traces them, also their recompiles
        self._tcb_uncached: set[int] = set()
        #: codes with no program at all (not a stale or unfitting one): may run as Python under a replay
        self._tcb_absent: set[int] = set()
        #: codes already counted as run eagerly under a torch dispatch mode
        self._tcb_moded: set[int] = set()
        #: the replayed code objects installed here (kept alive, so their ids stay theirs)
        self._tcb_codes: dict[int, types.CodeType] = {}
        #: codes run as Python under a replay (Dynamo compiled nothing in them at cold), kept alive
        self._tcb_python: dict[int, types.CodeType] = {}
        #: id(function) -> (function, what its receivers' loads share: a model's layers)
        self._tcb_shared: dict[int, tuple[Any, SharedLoad]] = {}
        #: codes whose program has graph breaks, met under fullgraph=True (counted once)
        self._tcb_strict: set[int] = set()

    def _tcb_one_graph(self) -> bool:
        """Whether Dynamo compiles this callback's frames as one graph (``torch.compile(fullgraph=True)``,
        or ``torch._dynamo.error_on_graph_break(True)`` around the call): a graph break then raises."""
        inner = getattr(self, "_torchdynamo_orig_backend", None)
        inner = getattr(inner, "_inner_convert", inner)
        if getattr(inner, "_one_graph", False):
            return True
        getter = getattr(torch._dynamo.utils, "_get_error_on_graph_break", None)
        return bool(getter()) if callable(getter) else False

    def __call__(self, frame: Any, cache_entry: Any, frame_state: Any) -> ConvertFrameReturn:
        code = frame.f_code
        filename = code.co_filename
        if filename.startswith(_PACKAGE_DIR):  # our own machinery (a replay's dispatch) is never traced
            return _skip(recursive=True)
        if filename.startswith(_TORCH_DIR):
            skipped = self._tcb_torch_skip(frame) if frame_state is not None else None
            if skipped is not None:
                return skipped
        elif frame_state is not None:
            try:
                result = self._tcb_replay(frame)
            except Exception as exc:  # never fail the user's call: Dynamo's path is always safe
                log.warning("npu_cached: backend route could not replay %s (%s: %s); tracing it with Dynamo",
                            code.co_qualname, type(exc).__name__, exc)
                _fallback("backend route: replay failed (traced)")
                result = None
            if result is not None:
                convert_frame.input_codes.add(code)  # so torch._dynamo.reset() clears what we install
                return result
        return super().__call__(frame, cache_entry, frame_state)  # Dynamo's path (and the mark)

    def _tcb_torch_skip(self, frame: Any) -> ConvertFrameReturn | None:
        """Dynamo's own answer for a torch frame it skips (in a skip-listed file, or already
        running), without its ``first_real_inst_idx``: that walks the whole line table with
        ``dis``, ~0.1 ms for each of the large torch functions around every module call
        (``Module._call_impl``, ``DisableContext``'s wrapper) on a warm start's first call.
        None: anything else (an inlined torch file), which Dynamo's own path decides."""
        handle = getattr(self, "_handle_skip", None)
        if handle is None:
            return None
        if _started(frame):
            reason = "frame has already started executing"
        elif trace_rules.check(frame.f_code, frame=frame):
            reason = "frame is in the Dynamo skipfiles list"
        else:
            return None
        convert_frame.input_codes.add(frame.f_code)  # as Dynamo's callback records every frame it sees
        return handle(ConvertFrameReturn(skip_reason=reason), frame)

    def _tcb_replay(self, frame: Any) -> ConvertFrameReturn | None:
        if torch._dynamo.config.disable or _started(frame):
            return None
        if _dispatch_mode_active():  # Dynamo runs the frame eagerly: counted, once per code
            if id(frame.f_code) not in self._tcb_moded:
                self._tcb_moded.add(id(frame.f_code))
                _fallback("backend route: a torch dispatch mode is active (runs eagerly)")
                log.info("npu_cached: %s runs eagerly under a torch dispatch mode (as torch.compile runs it)",
                         frame.f_code.co_qualname)
            return None
        if any(_GLOBAL_HOOKS):  # they run around every submodule, which the cached graphs inlined
            _fallback("backend route: global module hooks registered (traced)")
            return None
        code = frame.f_code
        if id(code) in self._tcb_uncached:
            return None
        local = frame.f_locals
        closure = getattr(frame, "closure", None)
        target = _resolve(code, local, frame.f_globals, closure)
        comprehension = target is None and code.co_name in _COMPREHENSIONS
        if comprehension:  # its own frame (Python 3.11), filed under its code like a function
            target = _comprehension(code, frame.f_globals, closure)
        if target is None:
            self._tcb_uncached.add(id(code))
            self._tcb_absent.add(id(code))
            return self._tcb_nested(frame, _UNRESOLVED_DEPTH)
        func, receiver = target
        built = self._tcb_build(func, receiver, code)
        if built is None:
            if id(code) not in self._tcb_absent:
                return None
            if comprehension and self._tcb_in_python_parent():  # no program: Dynamo compiled nothing in it
                counts["eager_nested"] += 1
                return _skip(recursive=False)
            return self._tcb_nested(frame, _UNRESOLVED_DEPTH if comprehension else _NESTED_DEPTH)
        variants, kinds, program = built
        if self._tcb_one_graph() and (not variants or _has_breaks(program)):  # the flag first: a walk of the frames otherwise
            # torch.compile(fullgraph=True) over a program cached with graph breaks: Dynamo traces the frame
            # and raises at the break, as it would without a cache (the replay would hide the break)
            if id(code) not in self._tcb_strict:
                self._tcb_strict.add(id(code))
                _fallback("backend route: fullgraph=True, the cached program has graph breaks (traced)")
            return None
        if not variants:  # Dynamo skipped this frame at cold start: it runs as Python, its callees replay
            counts["eager_root"] += 1
            self._tcb_python[id(code)] = code
            return _skip(recursive=False)
        options = self._tcb_options
        no_checks = options.guards == "none" or not options.check_inputs
        for variant in variants:
            if not no_checks and not _install_holds(variant, code, local, receiver):
                continue
            installed = _route_code(variant.fn.__code__, variant.fn.__globals__, kinds)
            if not _same_frame_layout(installed, code):
                continue
            frees = _free_values(code, func)
            if frees is None:
                continue
            guard = _guard(variant, code, frees, receiver, options, no_checks)
            tree = _tree(variant, code, frees, local, options, no_checks)
            if variant.used is not None:  # this process replays it: its merges never evict it
                variant.note_used()
            if tree is not None:  # every check on every call, evaluated as Dynamo evaluates its own
                manager = GuardManagerWrapper(tree.root)
                manager._tcb_keep = tree.keep  # type: ignore[attr-defined]  # alive with the entry
            else:
                manager = GuardManagerWrapper()
                manager.root.add_lambda_guard(guard, [f"npu_cached: the cached program's checks of {code.co_qualname} (guards={options.guards!r})"], None)
            manager.global_scope, manager.closure_vars = {"G": frame.f_globals}, {}  # read by Dynamo's recompile log
            orig_code_map[installed] = code  # as Dynamo records its own output code (recompile reasons)
            convert_frame.output_codes.add(installed)
            self._tcb_compiles += 1
            counts["installed"] += 1
            log.info("npu_cached: backend route replays %s (no tracing)", code.co_qualname)
            self._tcb_codes[id(installed)] = installed
            compile_id = CompileId(frame_id=-1, frame_compile_id=self._tcb_compiles)
            return wrap_guarded_code(GuardedCode(installed, manager, compile_id, "npu_cached replay"))
        _fallback("backend route: no cached variant fits the call (traced)")
        return None

    def _tcb_nested(self, frame: Any, depth_limit: int) -> ConvertFrameReturn | None:
        """A frame with no program called by replayed code (a config getter the bytecode
        calls): at cold Dynamo compiled nothing in it (else it would have a program), and
        ``load()`` runs it as Python; so does this route (not recursively: what it calls
        may have programs). Anything else with no program is Dynamo's. The replayed code may be
        far up the stack (``depth_limit``): a ``logger.warning_once`` in a property the forward
        reads runs a dozen frames of ``logging`` below it, each of which Dynamo would trace (for
        nothing) again. A function not found from its frame may have a program that could not be
        looked up: only a caller near it makes it Python."""
        caller, depth = sys._getframe(1), 0  # the callback runs on the caller's stack
        while caller is not None and depth < depth_limit:
            if id(caller.f_code) in self._tcb_codes and self._tcb_codes[id(caller.f_code)] is caller.f_code:
                counts["eager_nested"] += 1
                self._tcb_python[id(frame.f_code)] = frame.f_code
                return _skip(recursive=False)
            caller, depth = caller.f_back, depth + 1
        return None

    def _tcb_in_python_parent(self) -> bool:
        """Whether the nearest frame of user code on the stack (the comprehension's own
        function) runs as Python under a replay: Dynamo compiled nothing in it at cold, and
        what it would have inlined, a comprehension, it traced for nothing too."""
        caller = sys._getframe(2)
        while caller is not None and caller.f_code.co_filename.startswith((_PACKAGE_DIR, _TORCH_DIR)):
            caller = caller.f_back
        return caller is not None and self._tcb_python.get(id(caller.f_code)) is caller.f_code

    def _tcb_build(self, func: types.FunctionType, receiver: Any,
                   code: types.CodeType) -> tuple[list[Any], dict[str, str], dict[str, Any]] | None:
        from .loader import CacheMiss, _reason_kind, build_frame_variants

        memo_key = (id(func), id(receiver))  # (one wrapper code serves several functions)
        hit = self._tcb_built.get(memo_key)
        if hit is not None and hit[4] is func and (hit[0] is None or hit[0]() is receiver):
            return hit[1], hit[2], hit[3]
        shared = self._tcb_shared.get(id(func))
        if shared is None or shared[0] is not func:
            shared = self._tcb_shared[id(func)] = (func, SharedLoad())
        try:
            variants, program, kinds = build_frame_variants(func, receiver, self._tcb_options, shared[1])
        except CacheMiss as miss:
            text = str(miss)
            self._tcb_uncached.add(id(code))
            if text.startswith("no cached program"):  # a cold start (or code Dynamo compiled nothing in)
                self._tcb_absent.add(id(code))
            else:  # a stale or unfitting program: Dynamo traces, a counted fallback
                record_fallback(_reason_kind(text))
                counts["fallbacks"] += 1
                log.info("npu_cached: backend route: %s; tracing it with Dynamo", text)
            return None
        try:
            ref = None if receiver is None else weakref.ref(receiver)
        except TypeError:
            return None  # a receiver without weak references: Dynamo's path
        self._tcb_built[memo_key] = (ref, variants, kinds, program, func)
        return variants, kinds, program


def _has_breaks(program: dict[str, Any]) -> bool:
    """Whether a cached program was compiled with graph breaks (a continuation, or its root run as Python)."""
    if program.get("eager_root"):
        return True
    return any(desc.get("kind") == "resume" for frame in (program.get("frames") or {}).values()
               for desc in (frame.get("globals") or {}).values())


def _fallback(kind: str) -> None:
    counts["fallbacks"] += 1
    record_fallback(kind)


def _started(frame: Any) -> bool:
    """Whether the frame already ran past its ``RESUME`` (a resumed generator): Dynamo's own test
    (from 3.13 a fresh frame's ``f_lasti`` is its ``RESUME``'s own index)."""
    if _LASTI_AT_RESUME:
        return frame.f_lasti > first_instruction(frame.f_code)
    return frame.f_lasti >= first_instruction(frame.f_code)


_LASTI_AT_RESUME = sys.version_info >= (3, 13)


_RESUME = dis.opmap.get("RESUME")
#: id(code) -> (code, index of its first RESUME): a live code object never changes (strong refs, bounded)
_first_memo: dict[int, tuple[types.CodeType, int]] = {}


def first_instruction(code: types.CodeType) -> int:
    """``convert_frame.first_real_inst_idx`` (the index of the first ``RESUME``, in code units)
    without ``dis``: that walks the whole function's line table, ~0.1 ms per large function on
    every frame the callback sees; this reads the opcode bytes up to it, memoized per code."""
    hit = _first_memo.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    if _RESUME is None:  # before 3.11 there is no RESUME: Dynamo answers 0
        return 0
    raw = code.co_code  # opcodes at even offsets (arguments and inline caches between them)
    index = next((i // 2 for i in range(0, len(raw), 2) if raw[i] == _RESUME), None)
    if index is None:
        return convert_frame.first_real_inst_idx(code)  # Dynamo's answer (its error) for such code
    if len(_first_memo) >= 8192:
        _first_memo.clear()
    _first_memo[id(code)] = (code, index)
    return index


def _dispatch_mode_active() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


def _resolve(code: types.CodeType, local: dict[str, Any], scope: dict[str, Any],
             closure: Any) -> tuple[Any, Any] | None:
    """(function, receiver) the frame runs: a method found on its first argument's class
    (or on the class itself, for a classmethod), matched by code and closure cells (a
    decorated ``forward`` runs a wrapper's code shared by every method it decorates),
    else a module-level function."""
    first = _first_argument(code, local)
    if first is not None:
        klass = first if isinstance(first, type) else type(first)
        for base in klass.__mro__:
            attrs = vars(base)
            named = attrs.get(code.co_name)
            for attr in ((named,) if named is not None else ()) + tuple(attrs.values()):
                fn = _runs(attr.__func__ if isinstance(attr, classmethod) else attr, code, closure)
                if fn is not None:
                    if isinstance(attr, classmethod) != isinstance(first, type):
                        return None
                    return fn, first
    fn = _runs(scope.get(code.co_name), code, closure)
    return None if fn is None else (fn, None)


_CAPTURE = __name__.rsplit(".", 1)[0] + ".capture"
#: how far up the stack :meth:`ReplayingCallback._tcb_nested` looks for replayed code: for a
#: function found with no program (Dynamo compiled nothing in it at cold), and for one not found
_NESTED_DEPTH = 64
_UNRESOLVED_DEPTH = 8
#: code names of comprehensions (their own frames in Python 3.11, never found by :func:`_resolve`)
_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})
#: how many ``functools.wraps`` layers :func:`_runs` looks through (a method under decorators)
_WRAPPED_DEPTH = 4


def _runs(attr: Any, code: types.CodeType, closure: Any) -> types.FunctionType | None:
    """The function of ``attr`` that runs ``code`` with these cells: ``attr`` itself, or a
    function it wraps (``__wrapped__``, as ``functools.wraps`` records it: transformers'
    ``capture_outputs`` and ``deprecate_kwarg`` put a wrapper in the class dict, and the
    decorated ``forward`` then runs as a frame of its own, called by the wrapper)."""
    if isinstance(attr, property):  # a getter (``config.output_attentions``) or setter
        return next((f for f in (attr.fget, attr.fset, attr.fdel) if isinstance(f, types.FunctionType)
                     and f.__code__ is code and _same_cells(f, closure)), None)
    for _ in range(_WRAPPED_DEPTH + 1):
        if isinstance(attr, types.FunctionType) and attr.__code__ is code and _same_cells(attr, closure):
            return attr
        try:  # read from the instance dict: never a user ``__getattr__`` or property on a class attribute
            attr = vars(attr).get("__wrapped__")  # also through a non-function wrapper (lru_cache)
        except TypeError:  # no ``__dict__``
            return None
    return None


def _comprehension(code: types.CodeType, scope: dict[str, Any], closure: Any) -> tuple[Any, None] | None:
    """A comprehension's frame as a function of its own (it has no other), to look its program up."""
    cells = tuple(closure or ())
    if len(cells) != len(code.co_freevars) or not all(isinstance(c, types.CellType) for c in cells):
        return None
    return types.FunctionType(code, scope, code.co_name, None, cells or None), None


def _first_argument(code: types.CodeType, local: dict[str, Any]) -> Any:
    """The frame's first positional argument (a receiver), also through ``*args``
    (``wrapped_func(*args, **kwargs)`` of a decorator)."""
    if code.co_argcount:
        return local.get(code.co_varnames[0])
    if code.co_flags & 0x04:
        rest = local.get(code.co_varnames[code.co_kwonlyargcount])
        if isinstance(rest, tuple) and rest:
            return rest[0]
    return None


def _same_cells(fn: types.FunctionType, closure: Any) -> bool:
    mine = fn.__closure__ or ()
    theirs = tuple(closure or ())
    return len(mine) == len(theirs) and all(a is b for a, b in zip(mine, theirs, strict=True))


def _holds(check: Callable[..., bool], code: types.CodeType, local: dict[str, Any]) -> bool:
    try:
        pos, kwargs = call_args(code, local)
        return bool(check(*pos, **kwargs))
    except Exception:
        return False


#: nn.Module's global hook dicts (forward and backward), which the guard requires empty
_GLOBAL_HOOKS = global_module_hooks()


def _free_values(code: types.CodeType, func: types.FunctionType) -> tuple[tuple[str, Any], ...] | None:
    """(name, value) of the function's free variables, which the entry holds by identity (one
    decorator's wrapper code serves every method it decorates, each with its own cells); None
    for an empty cell or a closure that does not match the code (Dynamo's path)."""
    try:
        return tuple(zip(code.co_freevars, [c.cell_contents for c in func.__closure__ or ()], strict=True))
    except ValueError:
        return None


def _install_holds(variant: Any, code: types.CodeType, local: dict[str, Any], receiver: Any) -> bool:
    """Whether the variant's checks hold for the call about to run it (Dynamo does not check
    an entry's guard on the call that installs it). A variant whose per-call check is its
    full check, not decoded yet (``check is None``), is tested as ``load()`` tests one: the
    load-time guards over the receiver and the frame's cells, then the per-call guards -
    together every recorded guard, the full check's set. The full check (~0.7 ms of decoding
    on a small transformers model) is then decoded by the entry's guard on the next call."""
    if variant.check is not None:
        return _holds(variant.check, code, local)
    return _split_holds(variant.checks, code, local, receiver)


def _split_holds(checks: Any, code: types.CodeType, local: dict[str, Any], receiver: Any) -> bool:
    """Every recorded guard of ``checks`` for the frame locals ``local``, without the full check."""
    if checks.receiver is not None and receiver is None:
        return _holds(checks.full, code, local)  # no receiver to read the load-time guards from
    load_local = receiver_locals(checks.receiver, receiver)
    for name in code.co_freevars:  # the function's cells, as the load route reads them
        value = local.get(name, _MISSING)
        if value is not _MISSING:
            load_local[name] = value
    return checks.load_holds(load_local) and _holds(checks.call, code, local)


def _guard(variant: Any, code: types.CodeType, frees: tuple[tuple[str, Any], ...], receiver: Any,
           options: Any, no_checks: bool) -> Callable[[dict[str, Any]], bool]:
    """The entry's guard over the frame's locals (see the module docstring): global module
    hooks, the free variables ``frees`` by identity, the receiver, the recorded checks (a
    full check not decoded yet is decoded on the guard's first evaluation)."""
    hooks = _GLOBAL_HOOKS
    ref = weakref.ref(receiver) if receiver is not None and options.guards != "call" else None
    checks = variant.checks
    holds = None if variant.check is None else functools.partial(_holds, variant.check, code)

    def guard(L: dict[str, Any]) -> bool:
        nonlocal holds
        if hooks[0] or hooks[1] or hooks[2] or hooks[3]:
            return False
        for name, value in frees:
            if L.get(name, _MISSING) is not value:
                return False
        if ref is not None and _first_argument(code, L) is not ref():
            return False
        if no_checks:
            return True
        if holds is None:
            holds = _full_holds(checks, code)
        return holds(L)

    return guard


def _full_holds(checks: Any, code: types.CodeType) -> Callable[[dict[str, Any]], bool]:
    """The full check of ``checks`` over frame locals, decoded now; if it cannot be (its bytes
    were verified with the entry, so never seen), the same guards in two parts."""
    try:
        return functools.partial(_holds, checks.full, code)
    except Exception as exc:  # never fail the user's call
        log.warning("npu_cached: the full check of %s could not be loaded (%s: %s); its guards are "
                    "checked in two parts", code.co_qualname, type(exc).__name__, exc)
        return functools.partial(_split_checks, checks, code)


def _split_checks(checks: Any, code: types.CodeType, L: dict[str, Any]) -> bool:
    return _split_holds(checks, code, L, _first_argument(code, L))


#: ``TCB_GUARD_TREE=1``: ``guards="call"`` as a C++ guard tree. Opt-in: building the tree costs
#: ~35-50 ms per frame at the first warm call (the tiny Llama's first call 17 -> 65 ms) and saves
#: ~15-35 us per call, so it pays only in a long-running process (tests set it directly)
USE_GUARD_TREE = os.environ.get("TCB_GUARD_TREE", "") == "1"


def _tree(variant: Any, code: types.CodeType, frees: tuple[tuple[str, Any], ...], local: dict[str, Any],
          options: Any, no_checks: bool) -> Any:
    """The entry's guard as a C++ guard tree (``guard_tree``) for ``guards="call"``: the same
    checks as :func:`_guard`'s, each evaluated as Dynamo evaluates its own; None (the Python
    guard) for other modes, a check wrapped for a receiver-less frame, or what cannot be built."""
    checks = getattr(variant, "checks", None)
    if (not USE_GUARD_TREE or no_checks or options.guards != "call" or checks is None
            or (variant.check is not None and variant.check is not checks.full)):
        return None
    from .guard_tree import build_tree

    return build_tree(checks, code, local, frees, _GLOBAL_HOOKS)  # the hook dicts the Python guard checks


def _same_frame_layout(installed: types.CodeType, code: types.CodeType) -> bool:
    """Dynamo runs the installed code in the frame's own locals: same parameters and cells."""
    n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
    return (installed.co_varnames[:n] == code.co_varnames[:n] and installed.co_argcount == code.co_argcount
            and installed.co_kwonlyargcount == code.co_kwonlyargcount and installed.co_freevars == code.co_freevars
            and (installed.co_flags & 0x0C) == (code.co_flags & 0x0C))


def _route_code(code: types.CodeType, scope: dict[str, Any], kinds: dict[str, str]) -> types.CodeType:
    """The replayed bytecode with the globals it calls (graphs, splits, continuations,
    callees) renamed to Dynamo-disabled versions of themselves, installed beside them."""
    rename: dict[str, str] = {}
    for name in global_names(code):
        if kinds.get(name) not in _CALLED_KINDS or name not in scope:
            continue
        ours = name + _ROUTE_SUFFIX
        value = scope[name]
        current = scope.get(ours)
        if getattr(current, "_tcb_wraps", None) is not value:
            current = _disabled(value)
            scope[ours] = current
        rename[name] = ours
    return renamed(code, rename) if rename else code


def _disabled(value: Any) -> Any:
    resume = sys.modules.get("torchair_cached_backend.bypass.replay_resume")  # loaded by a program's graph break
    if resume is not None and (isinstance(value, resume.ResumeFactory)
                               or (isinstance(value, resume.ResumeRouter) and value.factory)):
        wrapped: Any = _DisabledFactory(value)
    else:
        wrapped = torch._dynamo.disable(value, reason="npu_cached replayed graph")
    try:
        wrapped._tcb_wraps = value
    except AttributeError:
        pass
    return wrapped


class _DisabledFactory:
    """A continuation factory (called with the cells): the function it returns runs with Dynamo off."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory

    def __call__(self, cells: tuple[Any, ...]) -> Any:
        return torch._dynamo.disable(self.factory(cells), reason="npu_cached replayed continuation")


