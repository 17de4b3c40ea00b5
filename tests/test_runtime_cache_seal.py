"""``runtime_cache``: the seal of a GE / torchair run-time cache inside an entry, without
torchair (the end-to-end tests over the real torchair are tests/torchair/test_runtime_cache.py).

The seal is written atomically (a failed write leaves the old seal, never a partial one),
a directory another process is still writing is never set aside nor handed out, files GE
adds after a verified start are sealed again, and a carried cache whose seal disagrees with
its files is refused by bundles and the remote."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import tarfile

import pytest

from torchair_cached_backend import runtime_cache as rc
from torchair_cached_backend.bundle import BUNDLE_MANIFEST, BundleError, pack, unpack
from torchair_cached_backend.stats import reset_stats, stats
from torchair_cached_backend.store import Store

KEY = "k" * 64


@pytest.fixture
def entry(tmp_path):
    """A published graph entry (no torchair): its files dir."""
    root = str(tmp_path / "cache")
    path = Store(root, "graphs").save(KEY, {"torchair_graph.py": b"print(1)\n"}, {"compiler": "torchair"})
    assert path is not None
    return os.path.join(path, "files")


def _sealed(files_dir: str, content: bytes = b"model-1") -> rc.RuntimeCache:
    cache = rc.prepare(files_dir, "ge_cache")
    assert cache is not None and cache.writer
    with open(os.path.join(cache.path, "m.om"), "wb") as f:
        f.write(content)
    cache.after_run()  # GE's first run returned: sealed
    return cache


def test_failed_seal_write_keeps_the_old_seal(entry, monkeypatch):
    _sealed(entry)
    seal_path = os.path.join(entry, "ge_cache.seal.json")
    before = open(seal_path, "rb").read()
    cache = rc.prepare(entry, "ge_cache")
    assert cache is not None and not cache.writer  # verified
    with open(os.path.join(cache.path, "more.om"), "wb") as f:
        f.write(b"written later")

    def crash(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", crash)
    cache.after_run()  # the re-seal fails: logged, never raised
    monkeypatch.undo()
    assert open(seal_path, "rb").read() == before
    assert sorted(os.listdir(entry)) == ["ge_cache", "ge_cache.seal.json", "torchair_graph.py"]  # no temp left


def test_leftovers_of_a_writer_that_died_are_dropped_and_its_cache_rebuilt(entry):
    """A process killed mid-seal leaves a temporary seal and an unsealed directory, never a seal that lies."""
    writer = rc.prepare(entry, "ge_cache")
    with open(os.path.join(writer.path, "m.om"), "wb") as f:
        f.write(b"half of a mod")
    with open(os.path.join(entry, ".ge_cache.seal.json.tmp-1-dead"), "wb") as f:
        f.write(b'{"format": "tcb-runtime-cache-se')
    writer._release()  # the process died: its lock is gone, nothing was sealed
    reset_stats()
    cache = rc.prepare(entry, "ge_cache")
    assert cache is not None and cache.writer and os.listdir(cache.path) == []  # set aside, a fresh one to fill
    assert stats().runtime_caches_set_aside == 1
    assert sorted(os.listdir(entry)) == ["ge_cache", "torchair_graph.py"]


def test_files_added_after_a_verified_start_are_sealed_again(entry):
    _sealed(entry)
    reset_stats()
    cache = rc.prepare(entry, "ge_cache")
    assert cache is not None and not cache.writer
    os.mkdir(os.path.join(cache.path, "sub"))
    for name in ("sub/more.om", ".index"):  # GE's own hidden index files are sealed too
        with open(os.path.join(cache.path, name), "wb") as f:
            f.write(b"GE compiled another model")
    cache.after_run()
    again = rc.prepare(entry, "ge_cache")
    assert again is not None and not again.writer and stats().runtime_caches_set_aside == 0
    assert set(rc.parse_seal(open(os.path.join(entry, "ge_cache.seal.json"), "rb").read(), KEY, "ge_cache")) == {
        "m.om", "sub/more.om", ".index"}


def test_a_directory_being_written_is_left_alone(entry):
    writer = rc.prepare(entry, "ge_cache")
    assert writer is not None and writer.writer
    with open(os.path.join(writer.path, "m.om"), "wb") as f:
        f.write(b"half of a mod")  # GE of another process is still writing it, unsealed
    reset_stats()
    assert rc.prepare(entry, "ge_cache") is None  # GE of this one caches privately
    assert os.listdir(writer.path) == ["m.om"] and stats().runtime_caches_set_aside == 0
    writer.after_run()
    assert rc.prepare(entry, "ge_cache") is not None  # sealed now: verified


def test_bundle_refuses_a_run_time_cache_its_seal_does_not_list(entry, tmp_path):
    _sealed(entry)
    bundle = str(tmp_path / "b.tar")
    assert pack(os.path.dirname(os.path.dirname(os.path.dirname(entry))), bundle)["runtime_caches"] == 1
    with tarfile.open(bundle) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    manifest = json.loads(next(d for m, d in members if m.name == BUNDLE_MANIFEST))
    rewritten = []
    for info, data in members:  # swap the model for another and re-make the (unsigned) bundle manifest to match
        if info.name.endswith("/files/ge_cache/m.om"):
            data = b"evil-model"
            rel = info.name.split(f"{KEY}/", 1)[1]
            manifest["entries"][0]["runtime"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        rewritten.append((info, data))
    raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
    evil = str(tmp_path / "evil.tar")
    with tarfile.open(evil, "w") as tar:
        for info, data in rewritten:
            info = copy.copy(info)
            data = raw if info.name == BUNDLE_MANIFEST else data
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleError, match="run-time cache ge_cache carried does not match its seal"):
        unpack(evil, str(tmp_path / "target"))
    assert not os.path.exists(str(tmp_path / "target" / "graphs" / KEY))


class _Carried:
    """A run-time cache as another node might publish it: any bytes under a seal."""

    def __init__(self, seal_raw: bytes, files: dict[str, bytes], subdir: str = "ge_cache") -> None:
        self.subdir, self.seal_raw, self.data = subdir, seal_raw, files
        self.files = {rel: (len(b), hashlib.sha256(b).hexdigest()) for rel, b in files.items()}

    def open(self, rel: str):
        return io.BytesIO(self.data[rel])


def _other_entry(tmp_path, name: str = "other") -> str:
    path = Store(str(tmp_path / name), "graphs").save(KEY, {"torchair_graph.py": b"print(1)\n"}, {"compiler": "torchair"})
    return os.path.join(path, "files")


def _fetched(url: str, files_dir: str) -> dict[str, bytes] | None:
    """What a fresh node installs from the remote: {path: bytes} of its ge_cache, None when nothing."""
    from torchair_cached_backend.remote import RedisRemote

    found = RedisRemote(url).get_runtime("graphs", KEY, rc.SUBDIRS)
    if "ge_cache" not in found or not rc.install(files_dir, "ge_cache", *found["ge_cache"]):
        return None
    out = {}
    for dirpath, _, names in os.walk(os.path.join(files_dir, "ge_cache")):
        for n in names:
            full = os.path.join(dirpath, n)
            out[os.path.relpath(full, os.path.join(files_dir, "ge_cache"))] = open(full, "rb").read()
    return out


def test_remote_refuses_a_run_time_cache_its_seal_does_not_list(entry, redis_server, monkeypatch, tmp_path):
    from torchair_cached_backend.remote import RedisRemote
    from torchair_cached_backend.runtime_carry import sealed_caches

    _sealed(entry)
    found, notes = sealed_caches(entry)
    url = redis_server.url(db=41)
    remote = RedisRemote(url)
    assert remote.put_runtime("graphs", KEY, found["ge_cache"])
    assert _fetched(url, _other_entry(tmp_path, "a")) == {"m.om": b"model-1"}
    reset_stats()
    other = RedisRemote(url)
    assert other.put_runtime("graphs", KEY, _Carried(found["ge_cache"].seal_raw, {"m.om": b"evil-model"}))
    assert _fetched(url, _other_entry(tmp_path, "b")) is None  # blobs match the record, not the seal
    monkeypatch.setenv("TORCHAIR_CACHE_KEY", "secret")  # with a key set, the unsigned record is refused too
    assert remote.put_runtime("graphs", KEY, found["ge_cache"]) is True
    monkeypatch.setenv("TORCHAIR_CACHE_KEY", "another")
    assert _fetched(url, _other_entry(tmp_path, "c")) is None
    assert stats().remote_faults == 2


def test_bundle_round_trip_keeps_nested_hidden_and_empty_caches(entry, tmp_path):
    cache = rc.prepare(entry, "ge_cache")
    os.makedirs(os.path.join(cache.path, "a", "b"))
    for name, data in (("a/b/m.om", b"x" * 1000), (".idx", b"i")):
        with open(os.path.join(cache.path, name), "wb") as f:
            f.write(data)
    cache.after_run()
    rc.prepare(entry, "fw.ge_cache").after_run()  # GE wrote nothing: sealed empty
    bundle = str(tmp_path / "b.tar.gz")
    assert pack(os.path.dirname(os.path.dirname(os.path.dirname(entry))), bundle)["runtime_caches"] == 2
    unpack(bundle, str(tmp_path / "target"))
    files = str(tmp_path / "target" / "graphs" / KEY / "files")
    reset_stats()
    got = {sub: rc.prepare(files, sub) for sub in ("ge_cache", "fw.ge_cache")}
    assert all(c is not None and not c.writer for c in got.values()) and stats().runtime_caches_set_aside == 0
    assert set(got["ge_cache"].snapshot) == {"a/b/m.om", ".idx"}
    assert os.stat(os.path.join(files, "ge_cache", "a")).st_mode & 0o077 == 0


def test_a_read_only_base_hands_its_sealed_cache_to_the_local_one(entry, tmp_path):
    from torchair_cached_backend import layers

    _sealed(entry, b"model from the image")
    base_root = os.path.dirname(os.path.dirname(os.path.dirname(entry)))
    local_root = str(tmp_path / "local")
    layers.configure(local_root, base_dir=base_root)
    try:
        got = Store(local_root, "graphs").load(KEY)
    finally:
        layers._BY_ROOT.pop(os.path.abspath(local_root), None)
    assert got is not None and got.path.startswith(local_root)
    reset_stats()
    cache = rc.prepare(got.files_dir, "ge_cache")
    assert cache is not None and not cache.writer and stats().runtime_caches_set_aside == 0
    assert open(os.path.join(cache.path, "m.om"), "rb").read() == b"model from the image"


def test_processes_starting_together_verify_in_parallel(entry):
    """A verifier holds the files dir's shared lock while it hashes: another one verifies beside it."""
    import fcntl
    import threading

    _sealed(entry)
    other = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(other, fcntl.LOCK_SH)  # another process, mid-verification
    got = []
    try:
        worker = threading.Thread(target=lambda: got.append(rc.prepare(entry, "ge_cache")), daemon=True)
        worker.start()
        worker.join(10)
        assert got and got[0] is not None and not got[0].writer
    finally:
        os.close(other)


def test_a_cache_set_aside_is_taken_from_the_fleet_before_ge_rebuilds_it(entry, redis_server):
    from torchair_cached_backend import layers
    from torchair_cached_backend.remote import RedisRemote

    url = redis_server.url(db=42)
    _sealed(entry, b"the fleet's model")
    from torchair_cached_backend.runtime_carry import sealed_caches

    assert RedisRemote(url).put_runtime("graphs", KEY, sealed_caches(entry)[0]["ge_cache"])  # another node sealed it
    with open(os.path.join(entry, "ge_cache", "m.om"), "wb") as f:
        f.write(b"the fleet's modeL")  # this node's copy rots
    root = os.path.dirname(os.path.dirname(os.path.dirname(entry)))
    layers.configure(root, remote=url)
    reset_stats()
    try:
        cache = rc.prepare(entry, "ge_cache")
    finally:
        layers._BY_ROOT.pop(os.path.abspath(root), None)
    assert cache is not None and not cache.writer and stats().runtime_caches_set_aside == 1
    assert open(os.path.join(cache.path, "m.om"), "rb").read() == b"the fleet's model"


def test_unpack_adds_the_bundles_run_time_cache_to_an_entry_already_there(entry, tmp_path):
    """A node that has the graph (fetched without its compiled model, or from an older bundle) gets
    the bundle's sealed model, checked again; one it has of its own is kept."""
    _sealed(entry, b"model from the bundle")
    rc.prepare(entry, "fw.ge_cache").after_run()
    bundle = str(tmp_path / "b.tar")
    pack(os.path.dirname(os.path.dirname(os.path.dirname(entry))), bundle)
    target = str(tmp_path / "target")
    files = os.path.join(Store(target, "graphs").save(KEY, {"torchair_graph.py": b"print(1)\n"},
                                                      {"compiler": "torchair"}), "files")
    own = rc.prepare(files, "fw.ge_cache")
    with open(os.path.join(own.path, "mine.om"), "wb") as f:
        f.write(b"this node's own")
    own.after_run()
    out = unpack(bundle, target)
    assert out["kept"] == 1
    reset_stats()
    cache = rc.prepare(files, "ge_cache")
    assert cache is not None and not cache.writer and stats().runtime_caches_set_aside == 0
    assert open(os.path.join(cache.path, "m.om"), "rb").read() == b"model from the bundle"
    assert os.listdir(os.path.join(files, "fw.ge_cache")) == ["mine.om"]  # its own kept
    assert not [n for n in os.listdir(os.path.join(target, "graphs")) if n.startswith(".")]  # staging removed
    assert out["runtime_caches_added"] == 1


def test_a_sealed_cache_is_published_without_holding_up_the_first_call(entry, redis_server, monkeypatch):
    """GE's compiled model can take minutes to upload: the first call returns once it is sealed,
    the upload runs beside it (visible to the fleet only once complete)."""
    import threading

    from torchair_cached_backend import layers
    from torchair_cached_backend.remote import RedisRemote

    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    real = RedisRemote.put_runtime

    def slow_link(self, *args):
        started.set()
        released = release.wait(5)
        finished.set()
        assert released, "the first call waited for the upload"
        return real(self, *args)

    monkeypatch.setattr(RedisRemote, "put_runtime", slow_link)
    url = redis_server.url(db=43)
    root = os.path.dirname(os.path.dirname(os.path.dirname(entry)))
    layers.configure(root, remote=url)
    try:
        cache = rc.prepare(entry, "ge_cache")
        assert cache is not None and cache.writer
        with open(os.path.join(cache.path, "m.om"), "wb") as f:
            f.write(b"a model that takes long to upload")
        cache.after_run()  # returns while the upload is held
        assert started.wait(5) and not finished.is_set()
        assert RedisRemote(url).get_runtime("graphs", KEY, rc.SUBDIRS) == {}  # not visible before it completes
        release.set()
        assert rc.wait_for_uploads(30)
        assert set(RedisRemote(url).get_runtime("graphs", KEY, rc.SUBDIRS)) == {"ge_cache"}
    finally:
        release.set()
        layers._BY_ROOT.pop(os.path.abspath(root), None)


def test_exit_waits_for_an_upload_only_up_to_its_bound(tmp_path, redis_server):
    """A slow link must not hang a shutdown: the exit waits ``TORCHAIR_CACHE_UPLOAD_WAIT`` seconds for a
    running upload, then abandons it (logged) and the record never appears (another node builds it)."""
    import subprocess
    import sys
    import time

    url = redis_server.url(db=44)
    child = f"""
import os, time
from torchair_cached_backend import layers, runtime_cache as rc
from torchair_cached_backend.remote import RedisRemote
from torchair_cached_backend.store import Store
RedisRemote.put_runtime = lambda self, *a: time.sleep(60)  # a link that takes a minute
root = {str(tmp_path / 'cache')!r}
files = os.path.join(Store(root, "graphs").save({KEY!r}, {{"g.py": b"1"}}, {{"compiler": "torchair"}}), "files")
layers.configure(root, remote={url!r})
cache = rc.prepare(files, "ge_cache")
open(os.path.join(cache.path, "m.om"), "wb").write(b"a model")
cache.after_run()
print("first call returned", flush=True)
"""
    env = dict(os.environ, TORCHAIR_CACHE_UPLOAD_WAIT="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=45)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert "first call returned" in proc.stdout
    assert took < 40, f"the exit waited {took:.0f} s for the upload"
    assert "TORCHAIR_CACHE_UPLOAD_WAIT" in proc.stderr, proc.stderr  # says which upload it left and how to wait longer
    from torchair_cached_backend.remote import RedisRemote

    assert RedisRemote(url).get_runtime("graphs", KEY, rc.SUBDIRS) == {}
