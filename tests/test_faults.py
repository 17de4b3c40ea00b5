"""Storage faults never fail the user's call, on real filesystems the test makes.

Each child runs in a private mount namespace (``unshare -m``) where the test
mounts what it needs: a read-only bind mount of an empty dir and of a filled
cache, a 48 KiB tmpfs (full, or nearly full so a save fails midway), a read-only
``locks/`` dir inside a writable cache. ``EACCES`` runs the child without
CAP_DAC_OVERRIDE (``setpriv``), so root obeys file modes. Every call must return
the right output; faults are counted in ``stats().storage_faults`` and warned
about once per cause; a read-only cache serves its entries without one write.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from subprocess_helpers import REPO

CHILD = textwrap.dedent(
    """
    import json, logging, os, shutil, sys
    import torch
    import torchair_cached_backend as tcb
    from child_helpers import same, stats

    WARNINGS = []
    class _Warnings(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                WARNINGS.append(record.getMessage())
    logging.getLogger("torchair_cached_backend").addHandler(_Warnings())

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x.sin() * 2 + 1

    class Shift(torch.nn.Module):
        def forward(self, x):
            return x.cos() - 1

    class Square(torch.nn.Module):
        def forward(self, x):
            return x * x + 3

    X = torch.arange(6.0).reshape(2, 3)

    def call(model, cache_dir, via="compile"):
        import torch._dynamo
        torch._dynamo.reset()
        WARNINGS.clear()
        before = stats()
        if via == "compile":
            fn = torch.compile(model, backend="npu_cached", options={"cache_dir": cache_dir, "compiler": "eager"})
        elif via == "cache_compile":
            fn = tcb.cache_compile(model.forward, cache_dir=cache_dir, compiler="eager")
        else:
            fn = tcb.load(model, cache_dir, compiler="eager", fallback=False)
        with torch.no_grad():
            y = fn(X)
        after = stats()
        delta = {k: after[k] - before[k] for k in ("hits", "misses", "storage_faults", "quarantined", "bypass_loads")}
        return {"ok": same(y, model(X)), **delta, "warnings": list(WARNINGS)}

    def tree(path):
        out = {}
        for d, dirs, files in os.walk(path):
            for n in dirs + files:
                p = os.path.join(d, n)
                out[os.path.relpath(p, path)] = os.lstat(p).st_mtime_ns
        return out
    """
)


def _can_mount(tmp_path) -> str | None:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare(1) and mount(8)"
    probe = tmp_path / "probe"
    probe.mkdir()
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=48k tmpfs {probe}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return f"cannot mount in a private mount namespace here (needs root/CAP_SYS_ADMIN): {proc.stderr.strip()}"
    return None


@pytest.fixture
def mounts(tmp_path):
    reason = _can_mount(tmp_path)
    if reason:
        pytest.skip(reason)


def run_child(code: str, *, setup: list[str] = (), wrap: list[str] = (), timeout: float = 240) -> dict:
    """Run CHILD + ``code`` in a fresh interpreter: after ``setup`` shell commands in a
    private mount namespace when given, under ``wrap`` (e.g. setpriv) when given."""
    script = CHILD + textwrap.dedent(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    argv = [*wrap, sys.executable, "-c", script]
    if setup:
        argv = ["unshare", "-m", "sh", "-ec", " && ".join([*setup, 'exec "$@"']), "sh", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"child failed (rc={proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1])


def _one_warning(result: dict, *needles: str) -> None:
    assert len(result["warnings"]) == 1, result["warnings"]
    for needle in needles:
        assert needle in result["warnings"][0], result["warnings"][0]


def test_read_only_empty_full_disk_and_unlockable_locks(tmp_path, mounts):
    ro, full, nearly, locked = (tmp_path / n for n in ("ro", "full", "nearly", "locked"))
    for d in (ro, full, nearly, locked / "locks"):
        d.mkdir(parents=True)
    setup = [
        f"mount --bind {ro} {ro}", f"mount -o remount,ro,bind {ro}",
        f"mount -t tmpfs -o size=48k,mode=0700 tmpfs {full}",
        f"(dd if=/dev/zero of={full}/filler bs=4k 2>/dev/null || true)",  # to the last byte
        f"mount -t tmpfs -o size=48k,mode=0700 tmpfs {nearly}",
        f"dd if=/dev/zero of={nearly}/filler bs=4k count=8 2>/dev/null",  # 16 KiB left: a save fails midway
        f"mount --bind {locked}/locks {locked}/locks", f"mount -o remount,ro,bind {locked}/locks",
    ]
    out = run_child(
        f"""
        res = {{}}
        res["ro_missing_dir"] = call(Scale(), {str(ro / "cache")!r})
        res["ro_cache_compile"] = call(Shift(), {str(ro)!r}, via="cache_compile")
        res["ro_tree"] = tree({str(ro)!r})
        res["full"] = call(Scale(), {str(full / "cache")!r})
        res["nearly_full"] = call(Square(), {str(nearly / "cache")!r})
        res["nearly_tree"] = [p for p in tree({str(nearly / "cache")!r}) if p.startswith("graphs")]
        res["locks_ro"] = call(Scale(), {str(locked)!r})
        res["locks_ro_hit"] = call(Scale(), {str(locked)!r})
        res["locks_tree"] = tree({str(locked / "locks")!r})
        print(json.dumps(res))
        """,
        setup=setup,
    )
    for name in ("ro_missing_dir", "ro_cache_compile", "full", "nearly_full", "locks_ro"):
        r = out[name]
        assert r["ok"] and r["misses"] == 1 and r["hits"] == 0, (name, r)
        assert r["storage_faults"] >= 1, (name, r)
    # read-only, empty: compiled and served uncached, one warning naming cause and fix, nothing written
    _one_warning(out["ro_missing_dir"], "read-only filesystem", "TORCHAIR_CACHE_HOME", "prebuild")
    assert out["ro_cache_compile"]["warnings"] == []  # same filesystem, same cause: already said once
    assert out["ro_tree"] == {}
    # full disk: one warning with the fix; a save that fails midway leaves nothing behind
    _one_warning(out["full"], "is full", "max_size", "prune")
    _one_warning(out["nearly_full"], "is full")  # another filesystem: its own warning
    assert all(p == "graphs" for p in out["nearly_tree"]), out["nearly_tree"]  # no entry, no .tmp-* left
    # a lock that cannot be created: compiled without it, and still cached
    _one_warning(out["locks_ro"], "lock file", "not coordinated")
    hit = out["locks_ro_hit"]
    assert hit["ok"] and hit["hits"] == 1 and hit["misses"] == 0 and hit["warnings"] == [], hit
    assert out["locks_tree"] == {}


FILL = """
res = {}
for name, model in (("scale", Scale()), ("shift", Shift()), ("square", Square())):
    res[name] = call(model, os.path.join(ROOT, name))
res["cache_compile"] = call(Scale(), os.path.join(ROOT, "cc"), via="cache_compile")
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache written by a cold process: one entry per model, and a cache_compile tree."""
    root = tmp_path_factory.mktemp("filled") / "cache"
    out = run_child(f"ROOT = {str(root)!r}\n" + FILL)
    assert all(r["ok"] and r["misses"] == 1 for r in out.values()), out
    for manifest in root.rglob("manifest.json"):  # old enough that a hit would refresh last_used
        data = json.loads(manifest.read_text())
        data["last_used"] = 0
        manifest.write_text(json.dumps(data))
    return root


def _copy_with_broken_entry(filled, dest):
    shutil.copytree(filled, dest)
    (graph,) = (dest / "square" / "graphs").iterdir()
    with open(graph / "files" / "graph_code.py", "ab") as f:
        f.write(b"# flipped\n")
    return dest


WARM = """
res = {}
res["hit"] = call(Scale(), os.path.join(ROOT, "scale"))
res["bypass"] = call(Shift(), os.path.join(ROOT, "shift"), via="load")
res["cache_compile"] = call(Scale(), os.path.join(ROOT, "cc"), via="cache_compile")
res["broken"] = call(Square(), os.path.join(ROOT, "square"))
res["tree"] = tree(ROOT)
print(json.dumps(res))
"""


def _check_warm_without_writes(out: dict, before: dict, cause: str) -> None:
    assert out["hit"]["ok"] and out["hit"]["hits"] == 1 and out["hit"]["misses"] == 0, out["hit"]
    assert out["bypass"]["ok"] and out["bypass"]["bypass_loads"] == 1 and out["bypass"]["misses"] == 0, out["bypass"]
    assert out["cache_compile"]["ok"] and out["cache_compile"]["bypass_loads"] == 1, out["cache_compile"]
    for name in ("bypass", "cache_compile"):  # no lock file, no last_used update, no CACHEDIR.TAG
        assert out[name]["storage_faults"] == 0 and out[name]["warnings"] == [], (name, out[name])
    # through torch.compile Dynamo runs and its capture offers the program again; the graph hit itself
    # writes nothing (a program write is the capture's: skipped by Store.replace when unchanged)
    assert not [w for w in out["hit"]["warnings"] if "graphs/" in w], out["hit"]["warnings"]
    broken = out["broken"]
    assert broken["ok"] and broken["misses"] == 1 and broken["quarantined"] == 0, broken
    assert any("is broken" in w and cause in w and "not moved" in w for w in broken["warnings"]), broken["warnings"]
    assert out["tree"] == before, "the read-only cache changed"


def test_read_only_cache_with_entries_serves_hits_without_a_write(tmp_path, mounts, filled):
    root = _copy_with_broken_entry(filled, tmp_path / "image")
    before = {os.path.relpath(p, root): os.lstat(p).st_mtime_ns for p in map(str, root.rglob("*"))}
    out = run_child(f"ROOT = {str(root)!r}\n" + WARM, setup=[f"mount --bind {root} {root}", f"mount -o remount,ro,bind {root}"])
    _check_warm_without_writes(out, before, "read-only")


def test_permission_denied_cache_serves_hits_and_compiles_the_rest(tmp_path, filled):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1) to drop CAP_DAC_OVERRIDE")
    root = _copy_with_broken_entry(filled, tmp_path / "shared")
    (tmp_path / "empty").mkdir(mode=0o500)
    for d, dirs, _ in os.walk(root):  # read-only by mode: r-x for the owner, no write
        for n in dirs:
            os.chmod(os.path.join(d, n), 0o500)
    os.chmod(root, 0o500)
    before = {os.path.relpath(p, root): os.lstat(p).st_mtime_ns for p in map(str, root.rglob("*"))}
    out = run_child(
        f"ROOT = {str(root)!r}\n" + WARM.replace('print(json.dumps(res))', f'res["empty"] = call(Scale(), {str(tmp_path / "empty")!r})\nprint(json.dumps(res))'),
        wrap=["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"],
    )
    _check_warm_without_writes(out, before, "read-only")
    empty = out["empty"]
    assert empty["ok"] and empty["misses"] == 1 and empty["storage_faults"] >= 1, empty
    said = [w for r in out.values() if isinstance(r, dict) and "warnings" in r for w in r["warnings"] if "no permission" in w]
    assert len(said) == 1 and "chmod" in said[0], said  # once per cause and filesystem
    assert os.listdir(tmp_path / "empty") == []


def test_vanished_cache_dir_and_io_errors(tmp_path):
    root = str(tmp_path / "cache")
    out = run_child(
        f"""
        import errno
        from torchair_cached_backend import fs_security, store
        res = {{"first": call(Scale(), {root!r})}}
        shutil.rmtree({root!r})  # a cleanup job removes the cache dir while the process runs
        res["after_vanish"] = call(Shift(), {root!r})
        res["vanished_hit"] = call(Shift(), {root!r})
        def eio(*a, **k):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_read, real_write = fs_security.read_at, fs_security.write_at
        fs_security.read_at = fs_security.write_at = eio  # a failing disk: every read and write
        res["eio_hit"] = call(Shift(), {root!r})
        res["eio_miss"] = call(Square(), {root!r})
        fs_security.read_at, fs_security.write_at = real_read, real_write
        res["healed"] = call(Shift(), {root!r})
        print(json.dumps(res))
        """
    )
    assert all(r["ok"] for k, r in out.items()), out
    assert out["after_vanish"]["misses"] == 1 and out["after_vanish"]["storage_faults"] == 0
    assert out["vanished_hit"]["hits"] == 1  # recreated and stored
    eio_hit, eio_miss = out["eio_hit"], out["eio_miss"]
    assert eio_hit["hits"] == 0 and eio_hit["misses"] == 1 and eio_hit["quarantined"] == 0 and eio_hit["storage_faults"] >= 1
    _one_warning(eio_hit, "I/O error", "validate")
    assert eio_miss["misses"] == 1 and eio_miss["storage_faults"] >= 1 and eio_miss["warnings"] == []
    assert out["healed"]["hits"] == 1 and out["healed"]["quarantined"] == 0  # the entry survived the I/O errors
