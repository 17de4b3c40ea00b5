"""The warm path imported in the background while the caller builds its model.

Importing our own hit-path modules (~20 modules, ~300 KB of bytecode) is the largest part
of a warm start's fixed cost: 4-5 ms of a tiny model's ~10 ms. ``import
torchair_cached_backend`` starts one daemon thread that imports exactly those modules, so
they are usually in ``sys.modules`` by the time the model is built and :func:`load` runs
(:data:`DROP_IN`: ``cache_compile``'s two modules too).
Once Dynamo is imported too (a transformers model's build imports it), the same thread
imports what the backend route adds (:data:`ROUTE`: ``torch.compile(model,
backend="npu_cached")`` replaying from Dynamo's frame callback), ~1.5-2 ms more, then the part of
``torch.compile()``'s own first use that is torch's per-process memo (:data:`TORCH_FIRST_USE`,
~3.5 ms: the compiler bisector's import, Dynamo's skip and inline file sets) and what a frame
under a replay that has no program of its own imports (:data:`ROUTE_MISS`). After the warm
path it also reads the versions every cache key holds (:data:`VERSIONS`, our own memos), and
last it calls the operators transformer graphs call once on tiny tensors (:data:`OPS`,
``op_warmup``): torch's own first use of each, ~0.8 ms of a tiny Llama's replayed first call.

Why this is safe:

* it starts only when ``torch`` is fully imported, and then the warm path imports nothing
  outside this package (no Dynamo, no Inductor, no compile side: ``tests/test_preload.py``);
  the route's modules wait for Dynamo's own import to finish and import nothing else outside
  the package either; of torch's, only :data:`TORCH_FIRST_USE`, which the caller's first
  ``torch.compile()`` would do the same way;
* those modules only define things, and those memos are what torch computes anyway:
  doing either on another thread changes what the caller's thread sees in timing only
  (save the bisector's one reading of ``TORCH_BISECT_*``, see :data:`BISECTOR`);
* importlib serializes concurrent imports of one module with per-module locks, and these
  modules import one another without cycles (tested), so two threads never wait on each
  other's locks;
* a ``fork`` waits for the thread first (an import lock held across a fork would stay
  held in the child), and a failed import is left for the caller's own import to report;
* the operators' first use reads and writes no global state and starts no thread pool
  (``op_warmup``, tested), and it is optional: it stops as soon as the caller begins a
  load (:func:`caller_loading`), so a load right after the import never waits for it;
* once what a caller waits for is done (:func:`caller_needs`) the thread pauses (at most
  :data:`PARK_S`) until that caller's load begins and drops what it never waits for, so
  the load never runs beside another of the thread's imports.

``TCB_PRELOAD=0`` turns it off.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import threading
from _thread import start_new_thread

ENV = "TCB_PRELOAD"
THREAD_NAME = "torchair_cached_backend.preload"
#: what a fork waits for the thread at most (it takes milliseconds; a fork never hangs on it)
FORK_WAIT_S = 10.0
#: what an interpreter exit waits for the operator in flight at most
EXIT_WAIT_S = 5.0

#: our modules a warm ``load()`` imports (eager inner compiler), those that import the rest last;
#: ``tests/test_warm_path.py`` holds the list a warm load must import to this one
WARM_PATH = tuple("torchair_cached_backend." + m for m in (
    "logs", "options", "environment", "fingerprint", "key", "code_codec", "fs_security", "store_layout",
    "store_backend", "store", "graph_load", "compilers", "compilers.eager", "bypass", "bypass.dynamo_stub",
    "bypass.world_state", "bypass.guard_runtime", "bypass.program", "bypass.sources", "bypass.replay",
    "bypass.shared_load", "bypass.loader",
))
#: what ``cache_compile(...)`` (the torchair drop-in) imports besides :data:`WARM_PATH`: its call (the
#: model's directory name, its options) runs before the first call's load, ~0.5-1 ms of imports
DROP_IN = tuple("torchair_cached_backend." + m for m in ("torchair_config", "drop_in"))
#: what a warm ``torch.compile(model, backend="npu_cached")`` imports besides :data:`WARM_PATH`
#: (the frame callback that installs replays, the name's resolution, the debug wrapper's deferral)
ROUTE = tuple("torchair_cached_backend." + m for m in (
    "bypass.code_names", "bypass.signature", "compile_mode", "bypass.capture_hook", "bypass.debug_wrapper", "bypass.trace_ids",
    "bypass.frame_install",
))
#: what a warm backend route imports besides :data:`ROUTE` when a frame under a replayed one has no
#: program of its own (Dynamo compiled nothing in it: transformers' config ``__getattribute__`` under
#: BERT's forward): the miss's explanation and the store's layers, ~0.8 ms of that first call otherwise
ROUTE_MISS = tuple("torchair_cached_backend." + m for m in ("layers", "bypass.loader_miss"))
#: the route's modules import Dynamo: the thread first waits for Dynamo's own import (its module
#: lock) to finish, and never imports Dynamo itself
DYNAMO = "torch._dynamo"
#: what every ``torch.compile()`` call pays on first use in a process, done by the thread after
#: :data:`ROUTE`: it only fills per-process memos torch fills at that call anyway. The bisector's module
#: (~2.3 ms, its dataclasses) reads ``TORCH_BISECT_*`` once, at its import: set them before the
#: process starts (as its CLI does for the processes it runs); one set later is warned about
#: (:func:`check_bisect_environment`). Dynamo's file sets (~1.3 ms) are pure functions of torch's
#: module lists, and torch clears a memo itself when it edits a list (DDP's python reducer does).
BISECTOR = "torch._inductor.compiler_bisector"
TRACE_RULES = "torch._dynamo.trace_rules"
#: memo -> the module list it is computed from (None: from torch itself)
TRACE_RULE_MEMOS = {"get_mod_skiplist": "MOD_SKIPLIST", "get_mod_inlinelist": "MOD_INLINELIST",
                    "get_legacy_mod_inlinelist": "LEGACY_MOD_INLINELIST", "get_tensor_method": None}
#: the queue's marker for filling :data:`TRACE_RULE_MEMOS`
_MEMOS = "<trace rule memos>"
TORCH_FIRST_USE = (BISECTOR, _MEMOS)
#: the queue's marker, right after :data:`WARM_PATH`, for the versions every cache key holds
#: (``environment``'s per-process memos: the torch_npu/torchair/CANN lookups ask the path
#: finders, ~0.25 ms of a warm load otherwise)
VERSIONS = "<environment versions>"
#: the queue's marker, always last, for torch's first use of the operators transformer graphs call
#: (``op_warmup``: ~0.8 ms of a tiny Llama's replayed first call)
OPS = "<operator first use>"
OP_WARMUP = "torchair_cached_backend.op_warmup"
#: the backend route's frame callback: loaded, a load may be the route's (its miss path stays queued)
_ROUTE_CALLBACK = "torchair_cached_backend.bypass.frame_install"
#: what stays queued once the caller loads (:func:`caller_loading`): on ``load()``'s route, on the backend route
_KEPT_BY_LOAD = frozenset(WARM_PATH) | {VERSIONS}
_KEPT_BY_ROUTE_LOAD = _KEPT_BY_LOAD | frozenset(ROUTE_MISS)
#: what the caller waits for (:func:`caller_needs`): at ``load()``'s (or ``cache_compile``'s) first use;
#: at ``torch.compile(backend="npu_cached")``'s name resolution, the route and torch.compile()'s first use too
LOAD_NEEDS = _KEPT_BY_LOAD
ROUTE_NEEDS = _KEPT_BY_LOAD | {DYNAMO, *ROUTE, *TORCH_FIRST_USE}
DROP_IN_NEEDS = _KEPT_BY_LOAD | frozenset(DROP_IN)
#: the package's lazy names whose modules the thread imports -> what their first use waits for
FIRST_USE_NEEDS = {"load": LOAD_NEEDS, "CacheMiss": LOAD_NEEDS, "cache_compile": DROP_IN_NEEDS}

_lock = threading.Lock()
#: what :func:`caller_needs` waits for (None: nothing), and the event the thread sets once none of it is left
_awaited: frozenset[str] | None = None
_awaited_done = threading.Event()
#: the item the thread is working on (None between items)
_in_flight: str | None = None
#: what the caller waits for the thread at most (its imports take milliseconds; a start never hangs on it)
NEED_WAIT_S = 2.0
#: how long the thread pauses, once what a caller waited for is done, for that caller to begin its load
#: (:func:`caller_loading`, which then drops what the load never waits for) before it goes on
PARK_S = 0.05
#: set to end the thread's pause (:data:`PARK_S`): a load began, the interpreter exits or forks
_resume = threading.Event()
#: set once the caller's first load from the cache begins, or the interpreter exits: the thread's
#: optional work (the operators' first use) stops
_optional_stop = threading.Event()
#: held while the thread runs operators: an exit waits for it (see :func:`_at_exit`)
_ops_lock = threading.Lock()
_queue: list[str] = []
_thread: _Worker | None = None
_draining = False
_started = False
_route_queued = False
_exit_hooks = False


def enabled() -> bool:
    return os.environ.get(ENV, "").strip() != "0"


def _torch_imported() -> bool:
    torch = sys.modules.get("torch")
    spec = getattr(torch, "__spec__", None)
    return torch is not None and not getattr(spec, "_initializing", False)


def start() -> bool:
    """Start the background import once per process (False: not started: off, torch not yet
    imported, or already started); the route's modules too when Dynamo is (being) imported."""
    global _started
    with _lock:
        if _started or not enabled() or not _torch_imported():
            return False
        _started = True
    return _submit(list(WARM_PATH) + [VERSIONS] + list(DROP_IN) + (_route_names() if DYNAMO in sys.modules else [])
                   + [OPS])


def after_dynamo() -> bool:
    """Queue the route's modules (once): called when Dynamo's backend registry has been imported
    (``registry``), while Dynamo's own import finishes on the caller's thread. Only after
    :func:`start` (the package's import with torch in)."""
    with _lock:
        if not _started:
            return False
    return _submit(_route_names())


def _route_names() -> list[str]:
    global _route_queued
    with _lock:
        if _route_queued:
            return []
        _route_queued = True
    return [DYNAMO, *ROUTE, *TORCH_FIRST_USE, *ROUTE_MISS]


def _submit(names: list[str]) -> bool:
    """Queue ``names`` for the thread, starting it when none is draining the queue."""
    global _thread, _draining, _exit_hooks
    if not names:
        return False
    with _lock:
        _queue.extend(names)
        if _draining:
            return True
        _draining = True
        if not _exit_hooks:
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(before=_before_fork)
            atexit.register(_at_exit)
            _exit_hooks = True
        thread = _Worker()
        _thread = thread
    thread.start()
    return True


class _Worker:
    """The background thread as :func:`wait` and the tests see it (``is_alive``, ``join``,
    ``ident``). Started by ``_thread.start_new_thread``: ``threading.Thread.start`` waits
    until the new thread reports it runs, two context switches that cost ~0.3-0.4 ms of
    every ``import torchair_cached_backend`` and buy nothing here."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.ident: int | None = None
        self.name = THREAD_NAME
        self.daemon = True  # as a raw thread is: the interpreter's exit never waits for it

    def start(self) -> None:
        try:
            start_new_thread(self._run, ())
        except BaseException:
            self._done.set()
            raise

    def _run(self) -> None:
        self.ident = threading.get_ident()  # no threading.Thread stands for it: :func:`on_thread` asks this
        try:
            _drain()
        finally:
            self._done.set()

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)


def _drain() -> None:
    global _in_flight
    try:
        _drain_queue()
    finally:
        with _lock:
            _in_flight = None
            _awaited_done.set()


def _drain_queue() -> None:
    global _draining, _in_flight
    while True:
        with _lock:
            _in_flight = None
            woken = _awaited is not None and not _pending(_awaited) and not _awaited_done.is_set()
            if woken:  # woken once, not at every item
                _awaited_done.set()
        if woken:
            # the caller is about to run what it waited for (a load): starting another item now would
            # run it beside the load, which then hands the interpreter to this thread at every file it
            # reads (up to a switch interval each: a tiny Llama's load 6 -> 14 ms) and would wake the
            # caller late (it needs the interpreter back). The load's first step drops what it never
            # waits for and ends the pause (caller_loading); a caller that does not load resumes us
            # after PARK_S
            _resume.wait(PARK_S)
        with _lock:
            if not _queue:
                _draining = False
                return
            name = _queue.pop(0)
            _in_flight = name
        if name == DYNAMO and name not in sys.modules:  # never import Dynamo here (its import failed)
            _stop()
            return
        if name in sys.modules and name != DYNAMO:
            continue
        try:
            if name == _MEMOS:
                _fill_trace_rule_memos()
            elif name == VERSIONS:
                _read_versions()
            elif name == OPS:
                with _lock:
                    later = bool(_queue)
                    if later:  # modules queued meanwhile (the route's, once Dynamo is in) go first
                        _queue.append(OPS)
                if not later:
                    _warm_ops()
            else:
                importlib.import_module(name)  # for DYNAMO: waits until the caller's import of it is done
        except BaseException:  # noqa: BLE001  (the caller's own import of it raises it, where it is seen)
            _stop()
            return


def on_thread() -> bool:
    """Whether the caller runs on the background thread. It has no ``threading.Thread`` object:
    asking ``threading.current_thread()`` there would register a dummy one that ``threading``
    then lists as alive for the rest of the process."""
    thread = _thread
    return thread is not None and thread.ident == threading.get_ident()


def caller_needs(names: frozenset[str]) -> None:
    """The caller is about to import ``names`` (and read the versions) while the thread may still be at
    them: wait for the thread to finish them instead of importing beside it. Two threads importing
    one list convoy on the interpreter (each file read hands it over, and taking it back waits up to a
    switch interval): a tiny Llama built before the package's import, then loaded, took ~2-4 ms longer
    than with no thread at all. Those of ``names`` still queued move to the front and everything else
    queued waits behind them, and after them the thread pauses for the caller's load (see
    :func:`_drain_queue`). Never from inside an import (the thread may need a module lock this
    thread holds) and at most :data:`NEED_WAIT_S`: past it the caller imports what is left itself."""
    global _awaited
    thread = _thread
    if thread is None or not thread.is_alive() or on_thread() or _inside_import():
        return
    with _lock:
        _queue[:] = [n for n in _queue if n in names] + [n for n in _queue if n not in names]
        if not _draining or not _pending(names):
            return
        _awaited = names
        _awaited_done.clear()
        _resume.clear()
    try:
        _awaited_done.wait(NEED_WAIT_S)
    finally:
        with _lock:
            _awaited = None


def _pending(names: frozenset[str]) -> bool:
    """Whether the thread has any of ``names`` still to do (under :data:`_lock`; those queued lead)."""
    return _in_flight in names or bool(_queue and _queue[0] in names)


def _inside_import() -> bool:
    """Whether this thread is importing a module (it then holds that module's import lock): a
    ``from torchair_cached_backend import load`` alone runs importlib's frames too, but not this one."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_find_and_load" and code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def caller_loading() -> None:
    """The caller began loading from the cache: what the thread does that the load does not wait
    for stops, so it never holds the interpreter while the caller runs: the operators' first use,
    and every queued module outside the warm path (the route's, ``torch.compile()``'s first use,
    the drop-in's), which a load started here never waits for. Run beside the load they cost it
    far more than their own time: each file the load reads releases the interpreter to the thread,
    which then keeps it for up to a switch interval (5 ms), a tiny Llama's load 9 -> 15-27 ms.
    On the backend route (its frame callback is loading) the route's miss path stays queued.
    What is dropped is imported where it is used, as without the thread."""
    _optional_stop.set()
    keep = _KEPT_BY_ROUTE_LOAD if _ROUTE_CALLBACK in sys.modules else _KEPT_BY_LOAD
    with _lock:
        _queue[:] = [name for name in _queue if name in keep]
    _resume.set()


def _warm_ops() -> None:
    with _ops_lock:  # checked under the lock: an exit that took it first means never start
        if not _optional_stop.is_set():
            importlib.import_module(OP_WARMUP).warm(_optional_stop)


def _at_exit() -> None:
    """At interpreter exit, before torch's C++ state is torn down: a thread still inside an
    operator then would abort the process (``terminate called without an active exception``).
    The warm-up stops after its current operator, and no later one starts (the lock stays held)."""
    _optional_stop.set()
    _resume.set()
    _ops_lock.acquire(timeout=EXIT_WAIT_S)


def _read_versions() -> None:
    """Fill ``environment``'s version memos; a lookup that fails is left to the caller's first
    use, where it is reported (the rest of the queue goes on)."""
    try:
        sys.modules["torchair_cached_backend.environment"].environment_factors()
    except Exception:  # noqa: BLE001
        pass


def _fill_trace_rule_memos() -> None:
    """Fill the memos; one whose list the caller's thread edited meanwhile (DDP's python reducer
    adds a module, then clears the memo) is cleared again, so no memo outlives an edit."""
    rules = sys.modules.get(TRACE_RULES)
    for name, source in TRACE_RULE_MEMOS.items():
        memo = getattr(rules, name, None)
        if not callable(memo):  # another torch may have renamed one: then it is simply not filled
            continue
        before = frozenset(getattr(rules, source, ())) if source else None
        memo()
        if source and frozenset(getattr(rules, source, ())) != before:
            getattr(memo, "cache_clear", lambda: None)()


#: the bisector's variables (torch reads each through a per-process memo)
BISECT_VARIABLES = ("TORCH_BISECT_BACKEND", "TORCH_BISECT_SUBSYSTEM")
_bisect_warned = False


def check_bisect_environment() -> None:
    """Warn once when a ``TORCH_BISECT_*`` variable was set after the bisector read the environment
    (the thread imported it, ahead of ``torch.compile()``): torch would not bisect that process."""
    global _bisect_warned
    if _bisect_warned:
        return
    bisector = sys.modules.get(BISECTOR)
    read = getattr(bisector, "get_env_val", None)
    if read is None:
        return
    for var in BISECT_VARIABLES:
        if os.environ.get(var) and not read(var):
            _bisect_warned = True
            import warnings

            warnings.warn(
                f"{var} was set after torchair_cached_backend imported torch's compiler bisector in the "
                f"background, so torch.compile does not bisect this process: set it before the process "
                f"starts, or set TCB_PRELOAD=0", RuntimeWarning, stacklevel=3)
            return


def _stop() -> None:
    global _draining
    with _lock:
        _queue.clear()
        _draining = False


def wait(timeout: float | None = None) -> bool:
    """Wait for the background import (True: it is done, or never started)."""
    thread = _thread
    if thread is None or on_thread():
        return True
    thread.join(timeout)
    return not thread.is_alive()


def _before_fork() -> None:
    _resume.set()  # a paused thread goes on at once: the fork waits for its work, not for the pause
    wait(FORK_WAIT_S)
