"""The remote tier against a real redis-server (issue 16).

"Nodes" are fresh processes with separate cache dirs (and Inductor dirs) sharing one
server: a node replays from Redis alone with outputs equal to eager (both routes);
racing nodes compile a graph once fleet-wide; a holder that is killed or stopped
mid-compile holds the others up only for its lease; a live holder only for the wait
bound. Every fault of the server (stopped and restarted, full, evicting, refusing
auth, stopped mid-run, a corrupted or partial value, an unsigned value with a key
set) leaves the call served with one warning and a count.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from subprocess_helpers import REPO, run_python

pytestmark = pytest.mark.slow

#: one node: a model, a route, a cache; reports outputs vs eager, counters and remote warnings
NODE = r"""
import os, sys, time, torch
import torchair_cached_backend as tcb
from child_helpers import LOGS, same, stats, frames
from models import build

model, x = build(os.environ.get("MODEL", "mlp"))
shapes = [int(s) for s in os.environ.get("BATCHES", "4").split(",")]
torch.manual_seed(1)
xs = [torch.randn(b, *x.shape[1:]) if x.is_floating_point() else torch.randint(0, 100, (b, *x.shape[1:]))
      for b in shapes]
opts = {"cache_dir": os.environ["CACHE"], "compiler": os.environ.get("COMPILER", "eager")}
if os.environ.get("REMOTE"):
    opts["remote"] = os.environ["REMOTE"]
if os.environ.get("BASE"):
    opts["base_dir"] = os.environ["BASE"]
if os.environ.get("BARRIER"):  # start the call together with the other nodes: ready, then wait for "go"
    open(os.path.join(os.environ["BARRIER"], f"ready-{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(os.environ["BARRIER"], "go")):
        time.sleep(0.01)
t0 = time.perf_counter()
with torch.no_grad():
    if os.environ.get("ROUTE", "backend") == "bypass":
        fn = tcb.load(model, opts.pop("cache_dir"), **opts)
    else:
        fn = torch.compile(model, backend="npu_cached", options=opts, dynamic=False)
    ok = all(same(fn(v), model(v)) for v in xs)
    took = time.perf_counter() - t0
    if os.environ.get("SECOND_CALL"):  # e.g. the server was stopped in between (see the test)
        time.sleep(float(os.environ["SECOND_CALL"]))
        model2, y = build("conv")
        fn2 = torch.compile(model2, backend="npu_cached", options=dict(opts, cache_dir=os.environ["CACHE"]))
        ok = ok and same(fn2(y), model2(y))
emit({"ok": ok, "stats": stats(), "frames": frames(), "seconds": took,
      "remote_warnings": [m for m in LOGS if m.startswith("npu_cached: remote cache")], "logs": LOGS[-30:]})
"""


def node(cache, remote=None, **env):
    full = {"CACHE": str(cache), **{k: str(v) for k, v in env.items()}}
    if remote:
        full["REMOTE"] = remote
    full.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache) + "-inductor")
    return run_python(NODE, env=full)


def spawn(cache, remote, **env):
    """A node as a Popen (for races and for killing/stopping it)."""
    prelude = "import json as _json\ndef emit(o):\n    print(_json.dumps(o, default=str), flush=True)\n"
    full = dict(os.environ, CACHE=str(cache), REMOTE=remote, TORCHINDUCTOR_CACHE_DIR=str(cache) + "-inductor",
                OMP_NUM_THREADS="1", TORCHINDUCTOR_VEC_ISA_OK="1",
                PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]), **{k: str(v) for k, v in env.items()})
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(NODE)], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc, timeout=240):
    import json

    out, err = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{out[-3000:]}\n{err[-5000:]}"
    return json.loads(lines[-1])


def served(rep, misses=None):
    assert rep["ok"], rep
    if misses is not None:
        assert rep["stats"]["misses"] == misses, rep


def wait_for_lock(server, db, timeout=120.0):
    import redis

    client = redis.Redis(host="127.0.0.1", port=server.port, db=db)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.keys("tcb:l:graphs:*"):
            return
        time.sleep(0.05)
    raise AssertionError("the holder never took the remote compile lock")


# --------------------------------------------------------------------------- sharing
@pytest.fixture(scope="module")
def inductor_fleet(redis_server, tmp_path_factory):
    """Node A compiles the MLP with Inductor (C++ kernels) and publishes to an empty remote."""
    root = tmp_path_factory.mktemp("fleet")
    url = redis_server.url(db=1)
    a = node(root / "a", url, COMPILER="inductor")
    served(a)
    assert a["stats"]["misses"] >= 1 and a["stats"]["remote_published"] >= 2 and not a["remote_warnings"], a
    return root, url


@pytest.mark.parametrize("route", ["bypass", "backend"])
def test_second_node_replays_from_redis_alone(inductor_fleet, route):
    root, url = inductor_fleet
    b = node(root / f"b-{route}", url, COMPILER="inductor", ROUTE=route)
    served(b, misses=0)
    assert b["stats"]["remote_hits"] >= 2 and b["stats"]["hits"] >= 1 and not b["remote_warnings"], b
    if route == "bypass":
        assert b["frames"] == 0 and b["stats"]["bypass_loads"] == 1 and b["stats"]["fallbacks"] == 0, b


def test_four_racing_nodes_compile_once(redis_server, tmp_path):
    url = redis_server.url(db=2)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [spawn(tmp_path / f"n{i}", url, COMPILER="inductor", BARRIER=barrier) for i in range(4)]
    deadline = time.monotonic() + 120
    while len(list(barrier.glob("ready-*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    (barrier / "go").touch()
    reps = [result(p) for p in procs]
    for rep in reps:
        served(rep)
    assert sum(r["stats"]["misses"] for r in reps) == 1, [r["stats"] for r in reps]
    assert sum(r["stats"]["remote_hits"] for r in reps) >= 3


def test_killed_holder_lease_expires(redis_server, tmp_path):
    url = redis_server.url(db=3, lease=2)
    holder = spawn(tmp_path / "holder", url, COMPILER="inductor")
    try:
        wait_for_lock(redis_server, 3)
        holder.send_signal(signal.SIGKILL)
    finally:
        holder.wait(30)
    t0 = time.monotonic()
    rep = node(tmp_path / "other", url, COMPILER="inductor")
    served(rep, misses=1)  # the lease expired: it compiled itself, well before the wait bound
    assert time.monotonic() - t0 < 120


def test_stopped_holder_waits_are_bounded(redis_server, tmp_path):
    url = redis_server.url(db=4, lease=2)
    holder = spawn(tmp_path / "holder", url, COMPILER="inductor")
    try:
        wait_for_lock(redis_server, 4)
        holder.send_signal(signal.SIGSTOP)
        rep = node(tmp_path / "other", url, COMPILER="inductor")
        served(rep, misses=1)
    finally:
        holder.send_signal(signal.SIGCONT)
    held = result(holder)  # the holder resumes and is served too
    served(held)


def test_programs_merge_across_nodes(redis_server, tmp_path):
    """Two nodes each compile another batch size (a program variant each); a third replays both
    from the remote without Dynamo: no node's variant was lost."""
    url = redis_server.url(db=6)
    served(node(tmp_path / "a", url, BATCHES="4"), misses=1)
    served(node(tmp_path / "b", url, BATCHES="8"), misses=1)
    c = node(tmp_path / "c", url, BATCHES="4,8", ROUTE="bypass")
    served(c, misses=0)
    assert c["frames"] == 0 and c["stats"]["fallbacks"] == 0, c


def test_concurrent_merges_keep_every_writer(redis_server):
    """WATCH/MULTI: eight writers merging at once into one record, each after a slow read."""
    from torchair_cached_backend.remote import RedisRemote

    remote = RedisRemote(redis_server.url(db=7))

    def merger(old, old_files, new, new_files):
        time.sleep(0.02)  # widen the race window
        items = sorted(set((old or {}).get("items", [])) | set(new["items"]))
        return {"items": items}, {**old_files, **new_files}

    threads = [threading.Thread(target=remote.merge, args=("programs", "k", {f"f{i}": bytes([i])}, {"items": [i]}, merger))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    manifest, files = remote.get("programs", "k")
    assert manifest["items"] == list(range(8)) and sorted(files) == [f"f{i}" for i in range(8)]


# --------------------------------------------------------------------------- faults
def test_server_stopped_mid_run(redis_factory, tmp_path):
    """A node publishes its first graph, the server is stopped before its second: served, one warning
    (the remote coming back is tests below, in-process)."""
    server = redis_factory()
    proc = spawn(tmp_path / "b", server.url(retry_after=1), MODEL="mlp", SECOND_CALL=3)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (tmp_path / "b" / "programs").exists():
        time.sleep(0.05)
    server.stop()
    rep = result(proc)
    served(rep)
    assert rep["stats"]["remote_published"] >= 1 and rep["stats"]["remote_faults"] >= 1, rep
    assert len(rep["remote_warnings"]) == 1, rep["remote_warnings"]
    assert rep["stats"]["misses"] == 2, rep


# --------------------------------------------------------------------------- layers
def test_read_only_base_serves_and_is_never_written(redis_server, tmp_path):
    base = tmp_path / "image-cache"
    served(node(base), misses=1)  # baked at image build time

    def snapshot():
        return sorted((str(p.relative_to(base)), p.stat().st_mtime_ns, p.stat().st_size) for p in base.rglob("*"))

    before = snapshot()
    url = redis_server.url(db=12)
    rep = node(tmp_path / "local", url, BASE=base, BATCHES="4", SECOND_CALL=0)
    served(rep, misses=1)  # the mlp from the base; the conv compiled into local (and the remote)
    assert rep["stats"]["base_hits"] >= 1 and rep["stats"]["remote_published"] >= 1, rep
    assert snapshot() == before


def test_bad_remote_option_is_a_clear_error():
    from torchair_cached_backend.options import OptionError, parse_options

    with pytest.raises(OptionError, match="rediss://"):
        parse_options({"remote": "http://cache:6379"})
    with pytest.raises(OptionError, match="lease"):
        parse_options({"remote": "redis://127.0.0.1:6379/0?lease=-1"})


def test_explain_here_against_a_remote(inductor_fleet):
    root, url = inductor_fleet
    env = dict(os.environ, PYTHONPATH=REPO, TORCHINDUCTOR_VEC_ISA_OK="1", TORCHINDUCTOR_FREEZING="1")
    out = subprocess.run([sys.executable, "-m", "torchair_cached_backend", "explain", "--here", url],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "misses here" in out.stdout and "TORCHINDUCTOR_FREEZING: None -> '1'" in out.stdout, out.stdout


def test_big_entries_are_chunked_and_each_chunk_verified(redis_server):
    import redis

    from torchair_cached_backend.remote import RedisRemote

    remote = RedisRemote(redis_server.url(db=13, chunk=1000))
    blob = os.urandom(4500)
    assert remote.put("graphs", "big", {"k.so": blob, "small": b"x"}, {"meta": 1})
    db = redis.Redis(host="127.0.0.1", port=redis_server.port, db=13)
    chunks = sorted(k.decode() for k in db.scan_iter(match="tcb:b:*:*"))
    assert len(chunks) == 5
    manifest, files = remote.get("graphs", "big")
    assert manifest == {"meta": 1} and files == {"k.so": blob, "small": b"x"}
    db.set(chunks[2], bytes(1000))  # one chunk altered
    fresh = RedisRemote(redis_server.url(db=13, chunk=1000))
    assert fresh.get("graphs", "big") is None


# --------------------------------------------------------------------------- in-process: the Store's layers
class _Warnings:
    """Warnings the package logs while the block runs."""

    def __enter__(self):
        import logging

        self.records: list[str] = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda r: self.records.append(r.getMessage())  # type: ignore[method-assign]
        logging.getLogger("torchair_cached_backend").addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        import logging

        logging.getLogger("torchair_cached_backend").removeHandler(self.handler)

    @property
    def remote(self):
        return [m for m in self.records if m.startswith("npu_cached: remote cache")]


def _layered(tmp_path, name, url, **kw):
    from torchair_cached_backend import layers
    from torchair_cached_backend.store import Store

    root = tmp_path / name
    root.mkdir(mode=0o700)
    layers.configure(str(root), remote=url, **kw)
    return Store(str(root), "graphs")


FILES = {"k.so": os.urandom(3000), "wrapper.py": b"print('hi')\n"}


def _delta(before, after, name):
    return getattr(after, name) - getattr(before, name)


@pytest.mark.parametrize("damage", ["blob", "record", "missing-blob", "unsigned", "altered"])
def test_corrupt_partial_or_unsigned_entry_is_a_miss_with_one_warning(redis_server, tmp_path, monkeypatch, damage):
    """A node reads nothing it cannot verify: the local cache stays empty (the caller compiles),
    one warning, a count; a republish (the recompiling node's) heals the remote."""
    import json

    import redis

    import torchair_cached_backend as tcb

    db = 14 + ["blob", "record", "missing-blob", "unsigned", "altered"].index(damage)
    url = redis_server.url(db=db)
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=db)
    writer = _layered(tmp_path, "writer", url)
    assert writer.save("k1", FILES, {"compiler": "eager"})
    record_key = "tcb:m:graphs:k1"
    body = json.loads(client.get(record_key))
    digest = body["files"]["k.so"]["sha256"]
    if damage == "blob":
        client.set(f"tcb:b:{digest}", bytes(3000))  # same size, other bytes
    elif damage == "record":
        client.set(record_key, client.get(record_key)[:40])  # truncated
    elif damage == "missing-blob":
        client.delete(f"tcb:b:{digest}")  # as an eviction would
    else:
        monkeypatch.setenv("TORCHAIR_CACHE_KEY", "fleet-secret")
        if damage == "altered":  # signed, then altered
            assert writer.save("k1-signed", FILES, {"compiler": "eager"})
            signed = json.loads(client.get("tcb:m:graphs:k1-signed"))
            signed["manifest"]["compiler"] = "inductor"
            client.set(record_key, json.dumps(signed).replace('"k1-signed"', '"k1"'))
    reader = _layered(tmp_path, "reader", url)
    before = tcb.stats()
    with _Warnings() as w:
        assert reader.load("k1") is None and reader.load("k1") is None  # twice: refused once, not refetched
    assert reader.keys() == []  # nothing written locally
    assert len(w.remote) == 1 and _delta(before, tcb.stats(), "remote_faults") >= 1, w.records
    assert writer.remove("k1") and writer.save("k1", FILES, {"compiler": "eager"})  # the republish
    healed = _layered(tmp_path, "healed", url)
    entry = healed.load("k1")
    assert entry is not None and entry.files == FILES


@pytest.mark.parametrize("case", ["wrong-password", "full", "evicting", "paused", "down"])
def test_server_faults_are_misses_with_one_warning(redis_factory, tmp_path, case):
    """Every operation returns (bounded by the socket timeout) and nothing raises: the caller
    compiles and serves; one warning per cause; counted."""
    import redis

    import torchair_cached_backend as tcb

    extra = {"wrong-password": ("--requirepass", "right"),
             "full": ("--maxmemory", "4mb", "--maxmemory-policy", "noeviction"),
             "evicting": ("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")}.get(case, ())
    server = redis_factory(*extra)
    url = server.url(timeout=0.3)
    if case == "wrong-password":
        url = url.replace(":right@", ":wrong@")
    seeded = _layered(tmp_path, "seed", server.url(timeout=0.3) if case != "wrong-password" else None)
    if case == "evicting":
        assert seeded.save("k1", FILES, {})
        client = server.client()
        for i in range(12):  # push the entry out
            client.set(f"ballast{i}", b"x" * (256 << 10))
    if case == "full":
        client = server.client()
        for size in (64 << 10, 256):  # fill it to the brim
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                for i in range(100_000):
                    client.set(f"ballast{size}-{i}", b"x" * size)
    if case == "paused":
        os.kill(server.proc.pid, signal.SIGSTOP)
    if case == "down":
        server.stop()
    store = _layered(tmp_path, "node", url)
    before = tcb.stats()
    t0 = time.monotonic()
    try:
        with _Warnings() as w:
            assert store.load("k1") is None
            path = store.save("k2", FILES, {})
            assert path is not None and store.load("k2") is not None  # the local cache is unaffected
            with store.lock("k3"):
                pass
    finally:
        if case == "paused":
            os.kill(server.proc.pid, signal.SIGCONT)
    assert time.monotonic() - t0 < 10
    faults = _delta(before, tcb.stats(), "remote_faults")
    if case == "evicting":  # the whole entry went (a plain miss) or part of it (refused, one warning)
        assert len(w.remote) <= 1
    else:
        assert faults >= 1 and len(w.remote) == 1, (faults, w.records)


def test_remote_comes_back_after_retry_after(redis_factory, tmp_path):
    server = redis_factory()
    url = server.url(retry_after=0.5, timeout=0.3)
    store = _layered(tmp_path, "node", url)
    server.stop()
    assert store.load("k1") is None  # a fault: skipped for 0.5 s
    server.start()
    time.sleep(0.6)
    assert store.save("k1", FILES, {})
    other = _layered(tmp_path, "other", url)
    assert other.load("k1") is not None


def test_live_holder_wait_is_bounded(redis_server):
    """A holder whose lease stays valid (a live node compiling for very long) holds the others up
    only for the wait bound; a lease that lapses frees the key at once."""
    import redis

    from torchair_cached_backend.remote import RedisRemote

    remote = RedisRemote(redis_server.url(db=20, wait=1.0, lease=1))
    db = redis.Redis(host="127.0.0.1", port=redis_server.port, db=20)
    db.set("tcb:l:graphs:busy", "another-node:1:abc", px=60_000)
    t0 = time.monotonic()
    with remote.compile_lock("graphs", "busy", 600) as held:
        assert held is False
    assert 0.9 < time.monotonic() - t0 < 5
    db.set("tcb:l:graphs:lapsing", "dead-node:1:abc", px=300)
    with remote.compile_lock("graphs", "lapsing", 600) as held:
        assert held is True
        time.sleep(1.2)  # longer than the lease: renewed meanwhile
        assert db.get("tcb:l:graphs:lapsing").decode().split(":")[1] == str(os.getpid())  # still ours
    assert not db.exists("tcb:l:graphs:lapsing")  # released
