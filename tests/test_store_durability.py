"""Issue 14, data loss: a good entry is never replaced by a worse one. The last-used refresh
and a program merge on a real full filesystem (a tmpfs in a private mount namespace),
validate racing a writer, unpack of a newer bundle, and two versions sharing a cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from subprocess_helpers import REPO, run_python

from torchair_cached_backend import cli
from torchair_cached_backend.bundle import pack, unpack
from torchair_cached_backend.store import Store


def _in_namespace(code: str, mount: str, size: str = "256k") -> dict:
    """Run ``code`` in a fresh interpreter inside a private mount namespace where
    ``mount`` is a small tmpfs; it prints one JSON line."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1)")
    os.makedirs(mount, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    argv = ["unshare", "-m", "sh", "-ec", f"mount -t tmpfs -o size={size},mode=0700 tmpfs {mount} && exec \"$@\"",
            "sh", sys.executable, "-c", textwrap.dedent(code)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    if proc.returncode != 0 and "mount" in proc.stderr and "permission" in proc.stderr.lower():
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


FULL_DISK = """
import errno, json, logging, os
from torchair_cached_backend import store as store_mod
from torchair_cached_backend.stats import stats
from torchair_cached_backend.store import Store

WARN = []
class H(logging.Handler):
    def emit(self, r):
        WARN.append(r.getMessage())
logging.getLogger("torchair_cached_backend").addHandler(H())

MNT = os.environ["MNT"]
def fill(leave):
    # fill the tmpfs, then free `leave` bytes: a write bigger than that fails midway
    fd = os.open(os.path.join(MNT, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\\0" * 4096) == 4096:
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    os.close(fd)
    size = os.path.getsize(os.path.join(MNT, "filler"))
    os.truncate(os.path.join(MNT, "filler"), max(size - leave, 0))

g = Store(os.path.join(MNT, "cache"), "graphs")
g.save("k", {"blob": b"x" * 1000}, {"meta": {"pad": "p" * 20000}})   # a 20 KB manifest
path = os.path.join(g.entry_path("k"), "manifest.json")
m = json.load(open(path)); m["last_used"] = 0; open(path, "w").write(json.dumps(m))  # due for a refresh
p = Store(os.path.join(MNT, "cache"), "programs")
p.save("prog", {"v1": b"1" * 4000}, {"program": {"variants": ["v1"]}})
fill(8192)
hit = g.load("k") is not None           # refreshes last_used: the manifest rewrite cannot fit
faults_touch = stats().storage_faults
replaced = p.replace("prog", {"v1": b"1" * 4000, "v2": b"2" * 60000}, {"program": {"variants": ["v1", "v2"]}})
os.remove(os.path.join(MNT, "filler"))
after = Store(os.path.join(MNT, "cache"), "graphs").read_verified("k")
prog = Store(os.path.join(MNT, "cache"), "programs").read_verified("prog")
print(json.dumps({"hit": hit, "faults_touch": faults_touch, "faults": stats().storage_faults,
                  "manifest_ok": after is not None and after.manifest["meta"]["pad"] == "p" * 20000,
                  "replaced": replaced, "prog_files": sorted(prog.files) if prog else None,
                  "warnings": WARN, "quarantine": os.path.exists(os.path.join(MNT, "cache", "quarantine"))}))
"""


def test_full_disk_never_truncates_a_manifest_nor_loses_a_program(tmp_path):
    mnt = str(tmp_path / "mnt")
    out = _in_namespace(FULL_DISK.replace('os.environ["MNT"]', repr(mnt)), mnt)
    assert out["hit"] and out["manifest_ok"], out  # the good manifest was kept whole
    assert out["faults_touch"] == 1 and any("last-used" in w and "is full" in w for w in out["warnings"]), out
    assert out["replaced"] is None and out["prog_files"] == ["v1"], out  # the stored variant survives
    assert out["faults"] == 2 and not out["quarantine"], out


def test_validate_quarantines_only_the_entry_it_read(tmp_path):
    """A writer replaces the entry while validate reads it: the new entry is valid and stays."""
    cache = str(tmp_path / "cache")
    Store(cache, "programs").save("p", {"a": b"old"}, {})
    out = run_python(f"""
        from torchair_cached_backend import cli
        from torchair_cached_backend.store import Store
        real = Store._read
        def racing(self, key, touch):
            # a concurrent merge publishes a new, valid entry right after validate looked
            Store(self.root, self.kind).replace(key, {{"a": b"new, merged"}}, {{}})
            Store._read = real
            return None
        Store._read = racing
        rc = cli.main(["validate", {cache!r}])
        entry = Store({cache!r}, "programs").read_verified("p")
        emit({{"rc": rc, "files": entry.files["a"].decode() if entry else None}})
    """)
    assert out["files"] == "new, merged", out
    assert not os.path.exists(os.path.join(cache, "quarantine"))


def _program(*roots: str) -> tuple[dict, dict]:
    frames = {r: {"code": f"{r}.code"} for r in roots}
    variants = [{"root": r} for r in roots]
    files = {f"{r}.code": r.encode() * 10 for r in roots}
    return {"format": 2, "function": {"qualname": "f"}, "frames": frames, "variants": variants, "resumes": {}}, files


def test_unpack_of_a_newer_bundle_merges_programs(tmp_path):
    node = str(tmp_path / "node")
    program, files = _program("v1")
    Store(node, "programs").save("p", files, {"program": program})
    build = str(tmp_path / "build")
    program, files = _program("v1", "v2", "v3")
    Store(build, "programs").save("p", files, {"program": program})
    pack(build, str(tmp_path / "b.tar"))
    out = unpack(str(tmp_path / "b.tar"), node)
    entry = Store(node, "programs").read_verified("p")
    assert [v["root"] for v in entry.manifest["program"]["variants"]] == ["v1", "v2", "v3"]
    assert sorted(entry.files) == ["v1.code", "v2.code", "v3.code"] and out["merged"] == 1
    again = unpack(str(tmp_path / "b.tar"), node)  # nothing new: nothing written
    assert again["merged"] == 0 and again["kept"] == 1


COMPILE_UNDER = """
import torch
import torchair_cached_backend as tcb
from torchair_cached_backend import key as keys
real = keys.environment_factors
if TORCH_VERSION:
    keys.environment_factors = lambda: dict(real(), torch=TORCH_VERSION)
class A(torch.nn.Module):
    def forward(self, x):
        return x.sin() * 2 + 1
x = torch.arange(6.0)
with torch.no_grad():
    torch.compile(A(), backend="npu_cached", options={"cache_dir": CACHE, "compiler": "eager"})(x)
s = tcb.stats()
emit({"hits": s.hits, "misses": s.misses, "quarantined": s.quarantined})
"""


def test_entries_of_other_versions_coexist(tmp_path):
    """Two versions sharing one cache (alternating starts) keep each other's graphs."""
    cache = str(tmp_path / "cache")
    runs = [run_python(f"CACHE, TORCH_VERSION = {cache!r}, {v!r}\n" + COMPILE_UNDER)
            for v in ("", "9.9.9", "", "9.9.9")]
    assert [(r["hits"], r["misses"], r["quarantined"]) for r in runs] == [(0, 1, 0), (0, 1, 0), (1, 0, 0), (1, 0, 0)]
    assert not os.path.exists(os.path.join(cache, "quarantine"))
    assert len(Store(cache, "graphs").keys()) == 2
    assert cli.main(["prune", cache, "--max-size", "0"]) == 0 and Store(cache, "graphs").keys() == []
