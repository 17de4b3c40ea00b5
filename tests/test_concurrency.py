"""Races and crashes: single-flight compiles across processes, locks of dead processes,
and SIGKILL at every stage of a save (injected inside the store)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import textwrap

from subprocess_helpers import REPO

from torchair_cached_backend.store import KILL_STAGES, Store

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]), OMP_NUM_THREADS="1")

RACER = textwrap.dedent(
    """
    import json, logging, os, sys, time
    import torch
    import torchair_cached_backend as tcb
    from torchair_cached_backend.compilers import get_compiler
    from torchair_cached_backend.store import Store

    EVENTS = []
    class _Events(logging.Handler):
        def emit(self, record):
            EVENTS.append([time.time(), record.getMessage()])
    log = logging.getLogger("torchair_cached_backend")
    log.addHandler(_Events())
    log.setLevel(logging.INFO)

    root, at_lock, racers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    real_acquire = Store._acquire
    def acquire(self, key, timeout):  # say "I am at the lock's door" just before knocking
        open(os.path.join(at_lock, str(os.getpid())), "w").close()
        return real_acquire(self, key, timeout)
    Store._acquire = acquire
    eager = get_compiler("eager")
    real_compile = eager.compile
    def compile_when_all_wait(*args, **kwargs):  # hold the lock until every racer is at its door
        deadline = time.time() + 120
        while len(os.listdir(at_lock)) < racers and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        return real_compile(*args, **kwargs)
    eager.compile = compile_when_all_wait

    x = torch.arange(4.0)
    f = torch.compile(lambda t: t.cos() * 5, backend="npu_cached", options={"cache_dir": root, "compiler": "eager"})
    with torch.no_grad():
        y = f(x)
    s = tcb.stats()
    print(json.dumps({"hits": s.hits, "misses": s.misses, "ok": bool(torch.allclose(y, x.cos() * 5)),
                      "waited": [t for t, m in EVENTS if m.startswith("npu_cached: waited") and "for graphs/" in m],
                      "stored": [t for t, m in EVENTS if m.startswith("npu_cached miss") and m.endswith("and stored")]}))
    """
)


def test_eight_processes_racing_on_one_key_compile_once(tmp_path):
    racers = 8
    at_lock = tmp_path / "at_lock"
    at_lock.mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path / "cache"), str(at_lock), str(racers)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        for _ in range(racers)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["ok"] for r in results), results
    assert sum(r["misses"] for r in results) == 1 and sum(r["hits"] for r in results) == racers - 1, results
    (stored_at,) = [t for r in results for t in r["stored"]]
    waited = [t for r in results for t in r["waited"]]
    # every racer knocked before the compile finished: the seven that lost all waited, and got the
    # lock only after the entry was stored (then loaded it)
    assert len(waited) == racers - 1, results
    assert all(t >= stored_at for t in waited), "a waiter got the lock before the entry was stored"
    assert Store(str(tmp_path / "cache"), "graphs").keys() and len(os.listdir(tmp_path / "cache" / "graphs")) == 1


HOLDER = textwrap.dedent(
    """
    import sys, time
    from torchair_cached_backend.store import Store
    held = Store(sys.argv[1], "graphs").lock("k")
    held.__enter__()
    print("held", flush=True)
    time.sleep(600)
    """
)


def test_a_lock_left_by_a_killed_process_never_blocks(tmp_path):
    store = Store(str(tmp_path / "cache"), "graphs")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, store.root], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert store._acquire("k", timeout=0.5) is None, "the lock did not block while its holder lived"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert holder.returncode == -signal.SIGKILL
    held = store._acquire("k", timeout=30)  # flock dies with its process: no stale lock to break
    assert held is not None and held.is_locked
    held.release()


KILLED = """
import os, torch
from models import build
model, x = build("mlp")
with torch.no_grad():
    torch.compile(model, backend="npu_cached", options={"cache_dir": os.environ["CACHE"], "compiler": "eager"})(x)
print("not killed")
"""


def test_sigkill_at_every_stage_of_a_save_leaves_no_partial_entry(run, tmp_path):
    def killed(stage: str) -> int:
        env = dict(ENV, TORCHAIR_CACHE_TEST_KILL_AT=stage, CACHE=str(tmp_path / stage))
        return subprocess.run([sys.executable, "-c", KILLED], env=env, capture_output=True, timeout=300).returncode

    with concurrent.futures.ThreadPoolExecutor(len(KILL_STAGES)) as pool:
        codes = dict(zip(KILL_STAGES, pool.map(killed, KILL_STAGES), strict=True))
    assert all(code == -signal.SIGKILL for code in codes.values()), codes
    dirs = {stage: str(tmp_path / stage) for stage in KILL_STAGES}
    out = run(
        f"""
        import torch
        import torchair_cached_backend as tcb
        from torchair_cached_backend.store import Store
        from child_helpers import same, stats
        from models import build
        res = {{}}
        for stage, d in {dirs!r}.items():
            import torch._dynamo
            torch._dynamo.reset()
            before = stats()
            model, x = build("mlp")
            with torch.no_grad():
                ok = same(torch.compile(model, backend="npu_cached", options={{"cache_dir": d, "compiler": "eager"}})(x), model(x))
            after = stats()
            store = Store(d, "graphs")
            res[stage] = {{"ok": ok, "hits": after["hits"] - before["hits"], "misses": after["misses"] - before["misses"],
                          "quarantined": after["quarantined"] - before["quarantined"],
                          "entries": [k for k in store.keys() if store.read_verified(k) is not None]}}
        emit(res)
        """
    )
    for stage in KILL_STAGES:
        r = out[stage]
        assert r["ok"] and r["quarantined"] == 0 and len(r["entries"]) == 1, (stage, r)
        # killed after the rename: the entry was whole and is served; before it: nothing was published
        assert (r["hits"], r["misses"]) == ((1, 0) if stage == "after_rename" else (0, 1)), (stage, r)
