"""GE's run-time caches (compiled models, often GBs) over the remote tier, against a real
redis-server: moved in bounded chunks (each SET/GET at most ``chunk`` bytes, one round trip
well inside the socket timeout even on a slow link), in bounded memory, checked end to end
against the seal, and never served from a partial upload.

Each node is a fresh interpreter (``TORCHAIR_CACHE_REMOTE`` set): the publisher seals its
cache after GE's first run (which publishes it); the reader has the graph's entry but no
cache, and ``runtime_cache.prepare`` takes the fleet's before GE would rebuild it."""

from __future__ import annotations

import os
import socket
import threading
import time

from subprocess_helpers import run_python

KEY = "r" * 64
MIB = 1 << 20

_NODE = """
import hashlib, os, resource
import redis  # noqa: F401 - imported before the RSS baseline
from torchair_cached_backend import runtime_cache as rc, runtime_carry  # noqa: F401
from torchair_cached_backend.remote import RedisRemote
from torchair_cached_backend.stats import stats
from torchair_cached_backend.store import Store

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def digests(top):
    out = {}
    for d, _, names in os.walk(top):
        for n in names:
            full, sha = os.path.join(d, n), hashlib.sha256()
            with open(full, "rb") as f:
                for piece in iter(lambda: f.read(1 << 20), b""):
                    sha.update(piece)
            out[os.path.relpath(full, top)] = sha.hexdigest()
    return out

path = Store(ROOT, "graphs").save(KEY, {"torchair_graph.py": b"print(1)\\n"}, {"compiler": "torchair"})
files = os.path.join(path, "files")
KILL_AFTER = globals().get("KILL_AFTER")
if KILL_AFTER is not None:  # the publisher dies once it has sent this many bytes of the cache
    import redis.connection
    real, sent = redis.connection.Connection.send_packed_command, [0]
    def dying(self, command, check_health=True):
        pieces = [command] if isinstance(command, (bytes, str)) else command
        sent[0] += sum(len(p) for p in pieces)
        if sent[0] >= KILL_AFTER:
            os._exit(9)
        return real(self, command, check_health)
    redis.connection.Connection.send_packed_command = dying
before = rss()
if globals().get("BUILD_HERE"):  # GE builds its own (the remote's is not fetched), then publishes it
    url = os.environ.pop("TORCHAIR_CACHE_REMOTE")
    cache = rc.prepare(files, "ge_cache")
    os.environ["TORCHAIR_CACHE_REMOTE"] = url
else:
    cache = rc.prepare(files, "ge_cache")
assert cache is not None
out = {"writer": cache.writer, "fetched": {} if cache.writer else digests(cache.path)}
if cache.writer and SIZES:  # GE builds it (deterministic bytes per SEED), then its first run returns
    for rel, size in SIZES.items():
        block = hashlib.sha256((SEED + rel).encode()).digest() * 32768  # 1 MiB, no two files alike
        full = os.path.join(cache.path, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            for i in range(0, size, 1 << 20):
                f.write((i.to_bytes(8, "little") + block)[:min(1 << 20, size - i)])
    cache.after_run()  # sealed, then published
out.update(growth=rss() - before, faults=stats().remote_faults, published=stats().remote_published,
           built=digests(cache.path), left=sorted(os.listdir(files)))
emit(out)
"""

SIZES = {"model.om": 40 * MIB + 12345, "kernels/k.bin": 8 * MIB, ".index": 10}
CACHE = sum(SIZES.values())


def _code(root: str, seed: str = "v1", sizes: dict | None = None, **extra) -> str:
    values = {"ROOT": root, "KEY": KEY, "SIZES": SIZES if sizes is None else sizes, "SEED": seed, **extra}
    return "".join(f"{k} = {v!r}\n" for k, v in values.items()) + _NODE


def _node(url: str, root: str, seed: str = "v1", sizes: dict | None = None, **extra) -> dict:
    return run_python(_code(root, seed, sizes, **extra), env={"TORCHAIR_CACHE_REMOTE": url}, timeout=600)


def _dying_node(url: str, root: str, **extra) -> int:
    """The exit status of a node killed while it publishes (once ``KILL_AFTER`` bytes were sent)."""
    code = "def emit(obj):\n    pass\n" + _code(root, **extra)
    got = run_python(f"""
import os, subprocess, sys
proc = subprocess.run([sys.executable, "-c", {code!r}], env=dict(os.environ, TORCHAIR_CACHE_REMOTE={url!r}))
emit({{"rc": proc.returncode}})
""")
    return got["rc"]


class SlowLink:
    """A loopback TCP proxy that paces each direction to ``rate`` bytes/s (a slow link)."""

    def __init__(self, port: int, rate: float) -> None:
        self.port, self.rate = port, rate
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = self.sock.getsockname()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        due = time.monotonic()
        try:
            while data := src.recv(64 << 10):
                dst.sendall(data)
                due = max(due, time.monotonic()) + len(data) / self.rate
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def url(self, db: int, **params: object) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"redis://127.0.0.1:{self.address[1]}/{db}" + (f"?{query}" if query else "")

    def close(self) -> None:
        self.sock.close()


def _chunk_keys(redis_server, db: int) -> dict[bytes, int]:
    import redis

    conn = redis.Redis(host="127.0.0.1", port=redis_server.port, db=db)
    return {k: conn.strlen(k) for k in conn.scan_iter(match="tcb:c:*", count=1000)}


def test_a_cache_of_many_chunks_crosses_a_slow_link_between_fresh_processes(redis_server, tmp_path):
    """48 MiB over a 10 MB/s link with a 1 s socket timeout: every round trip moves at most one
    4 MiB chunk (~0.4 s here)."""
    link = SlowLink(redis_server.port, rate=10e6)
    try:
        url = link.url(db=50, timeout=1)
        t0 = time.monotonic()
        built = _node(url, str(tmp_path / "a"))
        t1 = time.monotonic()
        fetched = _node(url, str(tmp_path / "b"))
        t2 = time.monotonic()
    finally:
        link.close()
    assert built["writer"] and built["published"] >= 1 and built["faults"] == 0, built
    assert not fetched["writer"] and fetched["faults"] == 0, fetched  # taken from the fleet, verified
    assert fetched["fetched"] == built["built"] and set(built["built"]) == set(SIZES)  # byte-exact
    chunks = _chunk_keys(redis_server, 50)
    assert len(chunks) >= 12 and max(chunks.values()) <= 4 * MIB  # bounded pieces
    print(f"slow link: publish {t1 - t0:.1f}s, fetch {t2 - t1:.1f}s, {len(chunks)} chunks")


def test_a_large_cache_is_published_and_fetched_in_bounded_memory(redis_server, tmp_path):
    """160 MiB: neither node holds the cache (or its model) in memory, only a few chunks."""
    url = redis_server.url(db=53)
    sizes = {"model.om": 150 * MIB + 7, "kernels/k.bin": 10 * MIB}
    t0 = time.monotonic()
    built = _node(url, str(tmp_path / "a"), sizes=sizes)
    t1 = time.monotonic()
    fetched = _node(url, str(tmp_path / "b"), sizes={})
    t2 = time.monotonic()
    print(f"160 MiB: publish {t1 - t0:.1f}s, fetch {t2 - t1:.1f}s, RSS growth {built['growth'] / MIB:.1f} / "
          f"{fetched['growth'] / MIB:.1f} MiB")
    assert not fetched["writer"] and fetched["fetched"] == built["built"] and set(built["built"]) == set(sizes)
    for node in (built, fetched):
        assert node["growth"] < 32 * MIB, f"RSS grew {node['growth'] / MIB:.0f} MiB"


def test_an_upload_killed_midway_is_never_served(redis_server, tmp_path):
    url = redis_server.url(db=51)
    assert _dying_node(url, str(tmp_path / "a"), KILL_AFTER=20 * MIB) == 9  # part of the model was sent
    fresh = _node(url, str(tmp_path / "b"), sizes={})
    assert fresh["writer"] and fresh["fetched"] == {} and fresh["faults"] == 0  # not served: GE builds its own

    # a complete publish, then another node's newer upload dies midway: the complete one is still served
    _node(url, str(tmp_path / "c"), seed="v1")
    complete = _node(url, str(tmp_path / "d"), sizes={})
    assert not complete["writer"] and set(complete["fetched"]) == set(SIZES)
    assert _dying_node(url, str(tmp_path / "e"), seed="v2", KILL_AFTER=30 * MIB, BUILD_HERE=True) == 9
    after = _node(url, str(tmp_path / "f"), sizes={})
    assert not after["writer"] and after["fetched"] == complete["fetched"] and after["faults"] == 0


def test_a_corrupted_chunk_is_refused_and_the_cache_rebuilt(redis_server, tmp_path):
    import redis

    url = redis_server.url(db=52)
    built = _node(url, str(tmp_path / "a"))
    conn = redis.Redis(host="127.0.0.1", port=redis_server.port, db=52)
    sizes = {k: conn.strlen(k) for k in conn.scan_iter(match="tcb:*", count=1000)}
    victim = max(sizes, key=sizes.get)  # a chunk of the model
    byte = conn.getrange(victim, 1000, 1000)
    conn.setrange(victim, 1000, bytes([byte[0] ^ 1]))  # one bit rots in Redis
    rebuilt = _node(url, str(tmp_path / "b"), seed="v2")
    assert rebuilt["writer"] and rebuilt["fetched"] == {} and rebuilt["faults"] >= 1, rebuilt  # refused: GE rebuilt
    assert rebuilt["left"] == ["ge_cache", "ge_cache.seal.json", "torchair_graph.py"]  # no partial download left
    assert rebuilt["built"] != built["built"]  # its own build (seed v2), sealed and republished
    healed = _node(url, str(tmp_path / "c"), sizes={})
    assert not healed["writer"] and healed["fetched"] == rebuilt["built"] and healed["faults"] == 0


def test_a_cache_published_in_the_former_layout_is_still_fetched(redis_server, tmp_path):
    """Nodes of an older version publish a run-time cache as blobs under its file's sha256
    (``tcb:b:<sha>[:<i>]``, no chunk digests): a node of this one still takes it, checked
    against the seal as it streams in."""
    import redis

    from torchair_cached_backend import runtime_cache as rc
    from torchair_cached_backend.remote import RedisRemote
    from torchair_cached_backend.store import Store

    src = os.path.join(Store(str(tmp_path / "a"), "graphs").save(KEY, {"g.py": b"1"}, {"compiler": "torchair"}), "files")
    cache = rc.prepare(src, "ge_cache")
    data = os.urandom(5 * MIB + 3)
    with open(os.path.join(cache.path, "m.om"), "wb") as f:
        f.write(data)
    cache.after_run()
    seal = open(os.path.join(src, "ge_cache.seal.json"), "rb").read()
    url = redis_server.url(db=54, chunk=2 * MIB)
    old = RedisRemote(url)
    raw, blobs = old._record("graphs", KEY, {"ge_cache.seal.json": seal, "ge_cache/m.om": data}, {}, runtime="ge_cache")
    conn = redis.Redis(host="127.0.0.1", port=redis_server.port, db=54)
    for bkey, blob in blobs.items():
        conn.set(bkey, blob)
    conn.set(old._rkey("graphs", KEY, "ge_cache"), raw)
    assert all(k.startswith(b"tcb:b:") for k in conn.scan_iter(match="tcb:[bc]:*"))  # the former layout

    dst = os.path.join(Store(str(tmp_path / "b"), "graphs").save(KEY, {"g.py": b"1"}, {"compiler": "torchair"}), "files")
    found = RedisRemote(url).get_runtime("graphs", KEY, rc.SUBDIRS)
    assert set(found) == {"ge_cache"} and rc.install(dst, "ge_cache", *found["ge_cache"])
    assert open(os.path.join(dst, "ge_cache", "m.om"), "rb").read() == data
    rotten = next(k for k in blobs if k.endswith(":1"))
    conn.setrange(rotten, 10, bytes([blobs[rotten][10] ^ 1]))  # a rotten chunk there too
    other = os.path.join(Store(str(tmp_path / "c"), "graphs").save(KEY, {"g.py": b"1"}, {"compiler": "torchair"}),
                         "files")
    found = RedisRemote(url).get_runtime("graphs", KEY, rc.SUBDIRS)
    assert not rc.install(other, "ge_cache", *found["ge_cache"]) and os.listdir(other) == ["g.py"]


def test_a_cache_that_would_fill_the_disk_is_not_fetched(redis_server, tmp_path):
    """The seal says how many bytes come: a cache that would not leave room to spare on the
    reader's filesystem (a 40 MiB tmpfs for a 48 MiB cache) is refused before one chunk is
    read, so the host's other writes never meet a full disk; GE builds its own there."""
    import json
    import shutil
    import subprocess
    import sys

    import pytest
    import redis
    from subprocess_helpers import REPO

    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1)")
    url = redis_server.url(db=55)
    _node(url, str(tmp_path / "a"))  # published
    conn = redis.Redis(host="127.0.0.1", port=redis_server.port, db=55)
    small = str(tmp_path / "small")
    os.makedirs(small)
    code = ("import json as _json\ndef emit(obj):\n    print(_json.dumps(obj, default=str))\n"
            + _code(os.path.join(small, "cache"), sizes={}))
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHAIR_CACHE_REMOTE=url,
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    sent_before = conn.info("stats")["total_net_output_bytes"]
    proc = subprocess.run(["unshare", "-m", "sh", "-ec", f"mount -t tmpfs -o size=40m,mode=0700 tmpfs {small} && "
                           'exec "$@"', "sh", sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sent = conn.info("stats")["total_net_output_bytes"] - sent_before
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["writer"] and out["fetched"] == {}, out  # not taken: GE builds it here
    assert out["left"] == ["ge_cache", "torchair_graph.py"], out  # no staging left behind
    assert sent < 4 * MIB, f"{sent} bytes were sent to a node that had no room for them"
    assert "needs 48.0 MiB" in proc.stderr and "free space" in proc.stderr, proc.stderr[-2000:]
