"""A GE run-time cache at scale (a 256 MiB compiled model here; GBs in production) packs and
unpacks in bounded memory: every file streams through in pieces, its sha256 checked as it
goes, and the receiving side still publishes nothing until every byte passed.

Each step runs in a fresh interpreter and measures its own peak RSS growth
(``ru_maxrss`` after the imports, before and after the step)."""

from __future__ import annotations

import os

import pytest
from subprocess_helpers import run_python

KEY = "s" * 64
MIB = 1 << 20
SIZES = {"model.om": 200 * MIB, "sub/part.om": 56 * MIB, ".index": 100}
CACHE_BYTES = sum(SIZES.values())
#: far below the cache: a pack or unpack that held one model (or the cache) in memory would exceed it
RSS_BOUND = 48 * MIB

_SETUP = """
import hashlib, os
from torchair_cached_backend import runtime_cache as rc
from torchair_cached_backend.store import Store

path = Store(ROOT, "graphs").save(KEY, {"torchair_graph.py": b"print(1)\\n"}, {"compiler": "torchair"})
files = os.path.join(path, "files")
cache = rc.prepare(files, "ge_cache")
assert cache is not None and cache.writer
digests = {}
block = os.urandom(1 << 20)
for rel, size in SIZES.items():
    full = os.path.join(cache.path, rel)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    sha, left, i = hashlib.sha256(), size, 0
    with open(full, "wb") as f:
        while left:
            piece = (i.to_bytes(8, "little") + block)[:min(left, 1 << 20)]  # real bytes, no two pieces alike
            f.write(piece)
            sha.update(piece)
            left -= len(piece)
            i += 1
    digests[rel] = sha.hexdigest()
cache.after_run()  # sealed
emit({"files": files, "digests": digests})
"""

_MEASURED = """
import hashlib, os, resource
from torchair_cached_backend import bundle, runtime_cache  # imports before the baseline

def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

before = rss()
STEP
after = rss()
emit({"growth": after - before, "before": before, "result": result})
"""


def _run_step(step: str, **values) -> dict:
    code = "".join(f"{name} = {value!r}\n" for name, value in values.items()) + _MEASURED.replace("STEP", step)
    return run_python(code, timeout=600)


def _digests(cache_dir: str) -> dict[str, str]:
    import hashlib

    out = {}
    for dirpath, _, names in os.walk(cache_dir):
        for name in names:
            full = os.path.join(dirpath, name)
            sha = hashlib.sha256()
            with open(full, "rb") as f:
                for piece in iter(lambda: f.read(MIB), b""):
                    sha.update(piece)
            out[os.path.relpath(full, cache_dir)] = sha.hexdigest()
    return out


@pytest.fixture(scope="module")
def big_cache(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("scale") / "cache")
    made = run_python(f"ROOT = {root!r}\nKEY = {KEY!r}\nSIZES = {SIZES!r}\n" + _SETUP, timeout=600)
    return root, made["files"], made["digests"]


def test_a_large_run_time_cache_packs_and_unpacks_in_bounded_memory(big_cache, tmp_path):
    root, _, digests = big_cache
    archive = str(tmp_path / "big.tar")
    packed = _run_step("result = bundle.pack(SRC, OUT)", SRC=root, OUT=archive)
    assert packed["result"]["runtime_caches"] == 1 and packed["result"]["payload_bytes"] >= CACHE_BYTES
    assert packed["growth"] < RSS_BOUND, f"pack grew RSS by {packed['growth'] / MIB:.0f} MiB"

    target = str(tmp_path / "target")
    unpacked = _run_step("result = bundle.unpack(SRC, OUT)", SRC=archive, OUT=target)
    assert unpacked["result"]["published"] == 1
    assert unpacked["growth"] < RSS_BOUND, f"unpack grew RSS by {unpacked['growth'] / MIB:.0f} MiB"

    files = os.path.join(target, "graphs", KEY, "files")
    assert _digests(os.path.join(files, "ge_cache")) == digests  # byte-exact
    verified = run_python(f"""
from torchair_cached_backend import runtime_cache as rc
cache = rc.prepare({files!r}, "ge_cache")
emit({{"verified": cache is not None and not cache.writer}})
""")
    assert verified["verified"]


def test_a_corrupted_byte_in_a_large_member_refuses_the_bundle(big_cache, tmp_path):
    root, _, _ = big_cache
    archive = str(tmp_path / "big.tar")
    _run_step("result = bundle.pack(SRC, OUT)", SRC=root, OUT=archive)
    with open(archive, "r+b") as f:  # a byte in the middle of the model's data flips
        f.seek(os.path.getsize(archive) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    target = str(tmp_path / "target")
    got = _run_step("""try:
    bundle.unpack(SRC, OUT)
    result = "unpacked"
except bundle.BundleError as exc:
    result = str(exc)""", SRC=archive, OUT=target)
    assert "fails its sha256" in got["result"]
    assert got["growth"] < RSS_BOUND
    leftovers = [os.path.join(d, n) for d, _, names in os.walk(target) for n in names] if os.path.exists(target) else []
    assert not os.path.exists(os.path.join(target, "graphs", KEY)) and leftovers == []  # nothing half-installed


def test_an_unpack_killed_midway_leaves_nothing_installed(big_cache, tmp_path):
    """The process dies with part of the model written: no entry, no cache GE could run; the
    next unpack publishes it whole."""
    root, _, digests = big_cache
    archive = str(tmp_path / "big.tar")
    _run_step("result = bundle.pack(SRC, OUT)", SRC=root, OUT=archive)
    target = str(tmp_path / "target")
    died = run_python(f"""
import os, subprocess, sys
code = '''
import os
from torchair_cached_backend import bundle
real = bundle._stream_member
def dying(tar, b, scanned, name, sink=None):
    if sink is not None and name.endswith("/model.om"):
        class Half:
            written = 0
            def write(self, data):
                sink.write(data)
                Half.written += len(data)
                if Half.written > 64 << 20:
                    sink.flush()
                    os._exit(9)  # killed mid-write
        return real(tar, b, scanned, name, sink=Half())
    return real(tar, b, scanned, name, sink=sink)
bundle._stream_member = dying
bundle.unpack({archive!r}, {target!r})
'''
proc = subprocess.run([sys.executable, "-c", code])
emit({{"rc": proc.returncode}})
""", timeout=600)
    assert died["rc"] == 9
    graphs = os.path.join(target, "graphs")
    assert not os.path.exists(os.path.join(graphs, KEY))  # only a hidden staging directory, never the entry
    assert all(name.startswith(".") for name in os.listdir(graphs))
    _run_step("result = bundle.unpack(SRC, OUT)", SRC=archive, OUT=target)
    assert _digests(os.path.join(graphs, KEY, "files", "ge_cache")) == digests
