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
if os.environ.get("BARRIER"):  # start the call at one wall-clock instant with the other nodes
    time.sleep(max(0.0, float(os.environ["BARRIER"]) - time.time()))
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
    """Node A compiles the GPT with Inductor (kernels) and publishes to an empty remote."""
    root = tmp_path_factory.mktemp("fleet")
    url = redis_server.url(db=1)
    a = node(root / "a", url, MODEL="gpt", COMPILER="inductor")
    served(a)
    assert a["stats"]["misses"] >= 1 and a["stats"]["remote_published"] >= 2 and not a["remote_warnings"], a
    return root, url


@pytest.mark.parametrize("route", ["bypass", "backend"])
def test_second_node_replays_from_redis_alone(inductor_fleet, route):
    root, url = inductor_fleet
    b = node(root / f"b-{route}", url, MODEL="gpt", COMPILER="inductor", ROUTE=route)
    served(b, misses=0)
    assert b["stats"]["remote_hits"] >= 2 and b["stats"]["hits"] >= 1 and not b["remote_warnings"], b
    if route == "bypass":
        assert b["frames"] == 0 and b["stats"]["bypass_loads"] == 1 and b["stats"]["fallbacks"] == 0, b


def test_four_racing_nodes_compile_once(redis_server, tmp_path):
    url = redis_server.url(db=2)
    barrier = time.time() + 12  # after the imports of all four
    procs = [spawn(tmp_path / f"n{i}", url, COMPILER="inductor", BARRIER=barrier) for i in range(4)]
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


def test_live_holder_wait_is_bounded(redis_server, tmp_path):
    """A holder whose lease stays valid (a live node in a very slow compile) holds the others
    up only for the wait bound; then they compile themselves."""
    import redis

    url = redis_server.url(db=5, wait=1.5)
    db5 = redis.Redis(host="127.0.0.1", port=redis_server.port, db=5)
    served(node(tmp_path / "probe", url), misses=1)  # learn the graph's key
    (record_key,) = [k.decode() for k in db5.scan_iter(match="tcb:m:graphs:*")]
    db5.flushdb()
    db5.set(record_key.replace(":m:", ":l:"), "another-node:1:abc", px=120_000)
    t0 = time.monotonic()
    rep = node(tmp_path / "waiter", url)
    waited = time.monotonic() - t0
    served(rep, misses=1)
    assert any("compiling here" in m for m in rep["logs"]), rep["logs"]
    assert waited < 60


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
def test_server_stopped_mid_run_and_restarted(redis_factory, tmp_path):
    server = redis_factory()
    url = server.url(retry_after=1)
    served(node(tmp_path / "a", url), misses=1)

    # the first call hits the remote; the server is stopped while the node sleeps before its second
    proc = spawn(tmp_path / "b", url, MODEL="mlp", SECOND_CALL=4)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (tmp_path / "b" / "graphs").exists():
        time.sleep(0.05)
    server.stop()
    rep = result(proc)
    served(rep)
    assert rep["stats"]["remote_hits"] >= 1 and rep["stats"]["remote_faults"] >= 1, rep
    assert len(rep["remote_warnings"]) == 1, rep["remote_warnings"]
    server.start()
    c = node(tmp_path / "c", url, MODEL="conv")  # back: used again
    served(c, misses=1)
    assert c["stats"]["remote_published"] >= 1 and not c["remote_warnings"], c


@pytest.mark.parametrize("case", ["wrong-password", "full", "evicting", "paused"])
def test_server_faults_serve_the_call_with_one_warning(redis_factory, tmp_path, case):
    if case == "wrong-password":
        server = redis_factory("--requirepass", "right")
        url = server.url().replace(":right@", ":wrong@")
    elif case == "full":
        server = redis_factory("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
        import redis

        client = server.client()
        for size in (64 << 10, 256):  # fill it up: big values, then small ones to the brim
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                for i in range(100_000):
                    client.set(f"ballast{size}-{i}", b"x" * size)
        url = server.url()
    elif case == "evicting":
        server = redis_factory("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
        url = server.url()
        served(node(tmp_path / "a", url), misses=1)
        client = server.client()
        for i in range(12):  # push the entry out
            client.set(f"ballast{i}", b"x" * (256 << 10))
    else:
        server = redis_factory()
        url = server.url(timeout=0.3)
        os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        rep = node(tmp_path / "b", url)
        took = time.monotonic() - t0
    finally:
        if case == "paused":
            os.kill(server.proc.pid, signal.SIGCONT)
    served(rep, misses=1)
    if case != "evicting":  # eviction may take the whole entry (a plain miss) or part of it (one warning)
        assert rep["stats"]["remote_faults"] >= 1 and len(rep["remote_warnings"]) == 1, rep
    else:
        assert len(rep["remote_warnings"]) <= 1, rep
    assert took < 90


@pytest.mark.parametrize("damage", ["blob", "record", "missing-blob"])
def test_corrupt_or_partial_value_is_a_miss_then_healed(redis_server, tmp_path, damage):
    db = {"blob": 8, "record": 9, "missing-blob": 10}[damage]
    url = redis_server.url(db=db)
    served(node(tmp_path / "a", url), misses=1)
    import redis

    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=db)
    (record_key,) = list(client.scan_iter(match="tcb:m:graphs:*"))
    if damage == "record":
        client.set(record_key, b'{"format": 1, "kind": "graphs", "key"')
    else:
        import json

        body = json.loads(client.get(record_key))
        digest = max(body["files"].values(), key=lambda i: i["size"])["sha256"]
        if damage == "blob":
            value = client.get(f"tcb:b:{digest}")
            client.set(f"tcb:b:{digest}", bytes(len(value)))  # same size, other bytes
        else:
            client.delete(f"tcb:b:{digest}")
    b = node(tmp_path / "b", url)
    served(b, misses=1)
    assert b["stats"]["remote_faults"] >= 1 and len(b["remote_warnings"]) == 1, b
    c = node(tmp_path / "c", url)  # b republished a good entry
    served(c, misses=0)
    assert c["stats"]["remote_hits"] >= 1 and not c["remote_warnings"], c


def test_signed_remote_refuses_unsigned_and_altered(redis_server, tmp_path):
    url = redis_server.url(db=11)
    served(node(tmp_path / "unsigned", url), misses=1)  # published without a key
    refused = node(tmp_path / "keyed", url, TORCHAIR_CACHE_KEY="fleet-secret")
    served(refused, misses=1)
    assert refused["stats"]["remote_faults"] >= 1 and len(refused["remote_warnings"]) == 1, refused
    assert "unsigned" in refused["remote_warnings"][0], refused
    # the keyed node republished it signed: another keyed node uses it
    ok = node(tmp_path / "keyed2", url, TORCHAIR_CACHE_KEY="fleet-secret")
    served(ok, misses=0)
    assert ok["stats"]["remote_hits"] >= 1, ok
    other_key = node(tmp_path / "other-key", url, TORCHAIR_CACHE_KEY="another-secret")
    served(other_key, misses=1)
    assert len(other_key["remote_warnings"]) == 1 and "altered" in other_key["remote_warnings"][0], other_key


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
    warm = node(tmp_path / "local", url, BASE=base, ROUTE="bypass")
    served(warm, misses=0)
    assert warm["frames"] == 0


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
