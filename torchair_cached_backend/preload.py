"""The warm path imported in the background while the caller builds its model.

Importing our own hit-path modules (~20 modules, ~300 KB of bytecode) is the largest part
of a warm start's fixed cost: 4-5 ms of a tiny model's ~10 ms. ``import
torchair_cached_backend`` starts one daemon thread that imports exactly those modules, so
they are usually in ``sys.modules`` by the time the model is built and :func:`load` runs.

Why this is safe:

* it starts only when ``torch`` is fully imported, and then the warm path imports nothing
  outside this package (no Dynamo, no Inductor, no compile side: ``tests/test_preload.py``);
* those modules only define things: importing them on another thread changes what the
  caller's thread sees in timing only;
* importlib serializes concurrent imports of one module with per-module locks, and the
  warm-path modules import one another without cycles (tested), so two threads never
  wait on each other's locks;
* a ``fork`` waits for the thread first (an import lock held across a fork would stay
  held in the child), and a failed import is left for the caller's own import to report.

``TCB_PRELOAD=0`` turns it off.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading

ENV = "TCB_PRELOAD"
THREAD_NAME = "torchair_cached_backend.preload"
#: what a fork waits for the thread at most (it takes milliseconds; a fork never hangs on it)
FORK_WAIT_S = 10.0

#: our modules a warm ``load()`` imports (eager inner compiler), those that import the rest last;
#: ``tests/test_warm_path.py`` holds the list a warm load must import to this one
WARM_PATH = tuple("torchair_cached_backend." + m for m in (
    "logs", "options", "environment", "fingerprint", "key", "code_codec", "fs_security", "store_layout",
    "store_backend", "store", "graph_load", "compilers", "compilers.eager", "bypass", "bypass.dynamo_stub",
    "bypass.world_state", "bypass.guard_runtime", "bypass.program", "bypass.sources", "bypass.replay",
    "bypass.loader",
))

_thread: threading.Thread | None = None
_fork_hook = False


def enabled() -> bool:
    return os.environ.get(ENV, "").strip() != "0"


def _torch_imported() -> bool:
    torch = sys.modules.get("torch")
    spec = getattr(torch, "__spec__", None)
    return torch is not None and not getattr(spec, "_initializing", False)


def start() -> bool:
    """Start the background import once per process (False: not started: off, torch not yet
    imported, or already started)."""
    global _thread, _fork_hook
    if _thread is not None or not enabled() or not _torch_imported():
        return False
    if not _fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork)
        _fork_hook = True
    thread = threading.Thread(target=_run, name=THREAD_NAME, daemon=True)
    _thread = thread
    thread.start()
    return True


def _run() -> None:
    for name in WARM_PATH:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001  (the caller's own import of it raises it, where it is seen)
            return


def wait(timeout: float | None = None) -> bool:
    """Wait for the background import (True: it is done, or never started)."""
    thread = _thread
    if thread is None or thread is threading.current_thread():
        return True
    thread.join(timeout)
    return not thread.is_alive()


def _before_fork() -> None:
    wait(FORK_WAIT_S)
