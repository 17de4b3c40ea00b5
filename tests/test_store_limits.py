"""Issue 14, hangs and resource exhaustion: a stopped lock holder costs a bounded wait
that names it; odd manifests are broken entries, not crashes; one refused entry does not
stop validate/prune/clear; tar headers are bounded before parsing; bundles unpack only
where the tools look; lock files go with their entries."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time

import pytest
from subprocess_helpers import REPO, run_python

from torchair_cached_backend import cli
from torchair_cached_backend.bundle import BUNDLE_MANIFEST, BundleError, pack, unpack, verify
from torchair_cached_backend.inventory import disk_size
from torchair_cached_backend.prune import prune
from torchair_cached_backend.store import Store

MODEL = """
import torch
import torchair_cached_backend as tcb
from child_helpers import same
class A(torch.nn.Module):
    def forward(self, x):
        return x.sin() * 2 + 1
x = torch.arange(6.0)
"""


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache holding one eager graph (and its program), built in a fresh process."""
    cache = str(tmp_path_factory.mktemp("filled") / "cache")
    out = run_python(MODEL + f"""
with torch.no_grad():
    y = torch.compile(A(), backend="npu_cached", options={{"cache_dir": {cache!r}, "compiler": "eager"}})(x)
emit({{"ok": same(y, A()(x)), "misses": tcb.stats().misses}})
""")
    assert out["ok"] and out["misses"] == 1
    return cache


HOLDER = textwrap.dedent("""
    import fcntl, os, signal, sys
    fds = []
    for name in sys.argv[2:]:
        fd = os.open(os.path.join(sys.argv[1], name), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, ('{"pid": %d, "host": "holder-host", "since": 1, "what": "x"}' % os.getpid()).encode())
        fds.append(fd)
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # a frozen container, a debugger: alive, never letting go
""")


def test_a_stopped_lock_holder_costs_a_bounded_wait_that_names_it(filled, tmp_path):
    cache = str(tmp_path / "cache")
    shutil.copytree(filled, cache)
    locks = os.path.join(cache, "locks")
    names = sorted(n for n in os.listdir(locks) if n.endswith(".lock") and n.startswith(("graphs-", "programs-")))
    assert {n.split("-")[0] for n in names} == {"graphs", "programs"}, names
    for kind in ("graphs", "programs"):
        shutil.rmtree(os.path.join(cache, kind))  # the entries are gone: the next start compiles
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, locks, *names], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = run_python(MODEL + f"""
import logging, time
EVENTS = []
class H(logging.Handler):
    def emit(self, r):
        EVENTS.append([time.monotonic(), r.getMessage()])
logging.getLogger("torchair_cached_backend").addHandler(H())
t0 = time.monotonic()
opts = {{"cache_dir": {cache!r}, "compiler": "eager", "lock_timeout": 6}}
with torch.no_grad():
    y = torch.compile(A(), backend="npu_cached", options=opts)(x)
emit({{"ok": same(y, A()(x)), "misses": tcb.stats().misses, "seconds": time.monotonic() - t0,
       "events": [[t - t0, m] for t, m in EVENTS]}})
""", env={"TORCHAIR_CACHE_LOCK_TIMEOUT": "6"}, timeout=90)
    finally:
        holder.kill()
        holder.wait()
    assert out["ok"] and out["misses"] == 1, out
    waiting = [(t, m) for t, m in out["events"] if m.startswith("npu_cached: waiting for the lock")]
    gave_up = [(t, m) for t, m in out["events"] if m.startswith("npu_cached: gave up waiting")]
    assert [m.split()[6].split("/")[0] for _, m in waiting] == ["graphs", "programs"], out["events"]
    assert [m.split()[9].split("/")[0] for _, m in gave_up] == ["graphs", "programs"], out["events"]
    for (t_wait, m_wait), (t_gave, _) in zip(waiting, gave_up, strict=True):
        assert t_gave - t_wait > 3.0, out["events"]  # the holder was named ~2 s into the 6 s wait
        assert f"pid {holder.pid} on host holder-host" in m_wait, m_wait
    assert out["seconds"] < 40, out["seconds"]  # two bounded waits (graph, then program) plus the compile


STOPPED_HERE = textwrap.dedent("""
    import os, signal, sys
    from torchair_cached_backend.store import Store
    held = Store(sys.argv[1], "graphs")._acquire("k", 5)  # writes its real pid, host and pid namespace
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
""")


def test_a_stopped_holder_on_this_host_is_not_waited_for(tmp_path, caplog):
    cache = str(tmp_path / "cache")
    env = dict(os.environ, PYTHONPATH=REPO)
    holder = subprocess.Popen([sys.executable, "-c", STOPPED_HERE, cache], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        while open(f"/proc/{holder.pid}/stat").read().rpartition(")")[2].split()[0] != "T":
            time.sleep(0.01)
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="torchair_cached_backend"):
            assert Store(cache, "graphs")._acquire("k", 120) is None
        waited = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    assert waited < 10, waited  # seen stopped ~2 s in, not after the 120 s timeout
    assert f"pid {holder.pid}" in caplog.text and "which is stopped" in caplog.text, caplog.text


ODD = {
    "huge int": lambda raw: raw.replace('"last_used": ', '"last_used": ' + "9" * 400 + ", \"x\": ", 1),
    "Infinity": lambda raw: raw.replace('"created": ', '"created": Infinity, "y": ', 1),
    "deep nesting": lambda raw: raw.replace('"meta": ', '"deep": ' + "[" * 100_000 + "]" * 100_000 + ', "meta": ', 1),
    "wrong type": lambda raw: raw.replace('"last_used": ', '"last_used": "yesterday", "z": ', 1),
}


def _graph_manifest(cache: str) -> str:
    gdir = os.path.join(cache, "graphs")
    (key,) = os.listdir(gdir)
    return os.path.join(gdir, key, "manifest.json")


def test_odd_manifests_are_broken_entries_not_crashes(filled, tmp_path, capsys):
    caches = {}
    for name, change in ODD.items():
        cache = str(tmp_path / name.replace(" ", "_"))
        shutil.copytree(filled, cache)
        path = _graph_manifest(cache)
        raw = open(path).read()
        odd = change(raw)
        assert odd != raw
        open(path, "w").write(odd)
        caches[name] = cache
    out = run_python(MODEL + f"""
import torch._dynamo
res = {{}}
for name, cache in {caches!r}.items():
    torch._dynamo.reset()
    before = tcb.stats()
    try:
        with torch.no_grad():
            y = torch.compile(A(), backend="npu_cached", options={{"cache_dir": cache, "compiler": "eager"}})(x)
        after = tcb.stats()
        res[name] = [same(y, A()(x)), after.misses - before.misses, after.quarantined - before.quarantined]
    except Exception as exc:
        res[name] = f"{{type(exc).__name__}}: {{str(exc)[:200]}}"
emit(res)
""")
    for name in ODD:
        assert out[name] == [True, 1, 1], (name, out[name])  # set aside, rebuilt, served
    cache = str(tmp_path / "cli")
    shutil.copytree(filled, cache)
    path = _graph_manifest(cache)
    open(path, "w").write(ODD["huge int"](open(path).read()))
    bundle = str(tmp_path / "odd.tar")
    _pack_raw(cache, bundle)
    with pytest.raises(BundleError, match="malformed manifest"):
        verify(bundle)
    with pytest.raises(BundleError):
        unpack(bundle, str(tmp_path / "unpacked"))
    assert not os.path.exists(tmp_path / "unpacked" / "graphs")
    capsys.readouterr()
    assert cli.main(["ls", cache]) == 0 and "BROKEN" in capsys.readouterr().out
    assert cli.main(["validate", cache]) == 1 and "moved to quarantine" in capsys.readouterr().out


def _pack_raw(cache: str, bundle: str) -> None:
    """A bundle of ``cache`` as pack would write it, but without reading entries through the
    store (so a hostile entry manifest travels as is): what another tool could produce."""
    members, records = [], []
    for kind in ("graphs", "programs"):
        kdir = os.path.join(cache, kind)
        for key in sorted(os.listdir(kdir)) if os.path.isdir(kdir) else []:
            files = {}
            for rel in ["manifest.json"] + [f"files/{n}" for n in sorted(os.listdir(os.path.join(kdir, key, "files")))]:
                data = open(os.path.join(kdir, key, rel), "rb").read()
                members.append((f"cache/{kind}/{key}/{rel}", data))
                files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            records.append({"root": "", "kind": kind, "key": key, "versions": {}, "files": files,
                            "size": sum(f["size"] for f in files.values())})
    manifest = {"format": "torchair-cache-bundle", "version": 1, "created": 0, "entries": records}
    members.append((BUNDLE_MANIFEST, json.dumps(manifest).encode()))
    with tarfile.open(bundle, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_one_refused_entry_does_not_stop_validate_prune_clear(tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown an entry to another uid")
    base = tmp_path / "base"
    store = Store(str(base), "graphs")
    for key in ("a", "b", "c", "d"):
        store.save(key, {"blob": bytes(4096)}, {})

    def hostile_copy(name: str) -> str:
        cache = str(tmp_path / name)
        shutil.copytree(base, cache)
        entry = os.path.join(cache, "graphs", "b")
        for d, _, files in os.walk(entry):
            for n in [d] + [os.path.join(d, f) for f in files]:
                os.chown(n, 65534, 65534)  # another user's entry
        elsewhere = str(tmp_path / f"{name}-elsewhere")
        shutil.move(os.path.join(cache, "graphs", "d"), elsewhere)
        os.symlink(elsewhere, os.path.join(cache, "graphs", "d"))  # and a planted symlink
        return cache

    for command in (["validate"], ["prune", "--max-size", "0"], ["clear"]):
        cache = hostile_copy(command[0])
        capsys.readouterr()
        rc = cli.main([command[0], cache, *command[1:]])
        out = capsys.readouterr().out
        assert rc == 1, (command, out)
        assert "graphs/b" in out and "graphs/d" in out, (command, out)
        left = sorted(os.listdir(os.path.join(cache, "graphs")))
        # validate sets planted entries aside as a warm start does (quarantine/, never read); prune and
        # clear leave what they refuse in place
        assert left == (["a", "c"] if command[0] == "validate" else ["b", "d"]), (command, left)
        if command[0] == "validate":
            assert len(os.listdir(os.path.join(cache, "quarantine"))) == 2, out
    cache = hostile_copy("bound")
    report = prune(cache, 0)  # what max_size runs after each store: it keeps working
    assert sorted(report.removed) == ["graphs/a", "graphs/c"] and sorted(report.refused) == ["graphs/b", "graphs/d"]


def _pax_bomb(path: str, header_bytes: int) -> None:
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = header_bytes
    with gzip.open(path, "wb", compresslevel=1) as out:
        out.write(info.tobuf(tarfile.USTAR_FORMAT))
        chunk = b"0" * (1 << 20)
        for _ in range(header_bytes // len(chunk)):
            out.write(chunk)
        out.write(b"\0" * 1024)


def test_a_pax_header_bomb_is_refused_before_it_is_read(tmp_path):
    bundle = str(tmp_path / "bomb.tar.gz")
    _pax_bomb(bundle, 256 << 20)
    assert os.path.getsize(bundle) < 2 << 20
    out = run_python(f"""
        import resource
        from torchair_cached_backend.bundle import BundleError, Limits, verify
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            verify({bundle!r}, limits=Limits(max_member_size=1 << 20, max_total_size=1 << 20))
            error = None
        except BundleError as exc:
            error = str(exc)
        emit({{"error": error, "grew_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before}})
    """)
    assert out["error"] and "header" in out["error"], out
    assert out["grew_kib"] < 64 << 10, out  # not the 256 MiB header


def _rerooted(tmp_path, root: str) -> str:
    """A signed-off bundle whose one entry sits at ``root`` (members and manifest agree)."""
    src = tmp_path / "src"
    Store(str(src / "r"), "graphs").save("k", {"graph.py": b"print(1)\n"}, {})
    plain = str(tmp_path / "plain.tar")
    pack(str(src), plain)
    out = str(tmp_path / f"{abs(hash(root))}.tar")
    with tarfile.open(plain) as tin, tarfile.open(out, "w") as tout:
        for m in tin.getmembers():
            data = tin.extractfile(m).read()
            if m.name == BUNDLE_MANIFEST:
                manifest = json.loads(data)
                manifest["entries"][0]["root"] = root
                data = json.dumps(manifest).encode()
            info = tarfile.TarInfo(m.name.replace("cache/r/", f"cache/{root}/"))
            info.size = len(data)
            tout.addfile(info, io.BytesIO(data))
    return out


@pytest.mark.parametrize("root", [".tmp-x/r", "a/b/c/d/e/f/g/h/i", "graphs/r", "m/.hidden"])
def test_unpack_only_into_roots_the_tools_see(tmp_path, root):
    bundle = _rerooted(tmp_path, root)
    target = tmp_path / "target"
    with pytest.raises(BundleError, match="malformed manifest"):
        unpack(bundle, str(target))
    assert not target.exists() or not any(target.rglob("manifest.json"))


def test_lock_files_go_with_their_entries_and_count(tmp_path):
    cache = str(tmp_path / "cache")
    store = Store(cache, "graphs")
    for i in range(30):
        with store.lock(f"k{i}"):
            store.save(f"k{i}", {"blob": bytes(100)}, {})
    locks = os.path.join(cache, "locks")
    lock_bytes = sum(os.path.getsize(os.path.join(locks, n)) for n in os.listdir(locks) if n.endswith(".lock"))
    assert lock_bytes > 0
    report = prune(cache, 1 << 40, dry_run=True)
    assert report.size_before == sum(disk_size(store.entry_path(k)) for k in store.keys()) + lock_bytes
    prune(cache, 0)
    assert store.keys() == [] and not [n for n in os.listdir(locks) if n.endswith(".lock")]
    for i in range(5):
        with store.lock(f"k{i}"):
            store.save(f"k{i}", {"blob": bytes(100)}, {})
    store.remove("k0")
    assert "graphs-k0.lock" not in os.listdir(locks)
    assert cli.main(["clear", cache]) == 0
    assert store.keys() == [] and not [n for n in os.listdir(locks) if n.endswith(".lock")]
    with store.lock("k1"):  # a lock held while its entry is removed keeps working
        assert store.save("k1", {"b": b"x"}, {}) and store.remove("k1")
        assert "graphs-k1.lock" in os.listdir(locks)  # held: not deleted under its holder
