"""``torchair-cache ls`` lists each graph's run-time caches (GE's compiled model, torchair's
static kernels) with size and state; ``validate`` hashes them against their seals and sets a
broken one aside as it does a broken entry (no torchair needed: the caches are written as GE
writes them, through ``runtime_cache.prepare``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torchair_cached_backend import runtime_cache as rc
from torchair_cached_backend.store import Store

KEY = "c" * 64


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchair_cached_backend", *args], capture_output=True, text=True)


def _write(cache: rc.RuntimeCache, name: str, data: bytes) -> None:
    with open(os.path.join(cache.path, name), "wb") as f:
        f.write(data)


@pytest.fixture
def caches(tmp_path):
    """One graph entry with a cache in each state: sealed, sealed then altered (size), unsealed
    (its writer died), and one still being written (this process holds its lock)."""
    root = str(tmp_path / "cache")
    files = os.path.join(Store(root, "graphs").save(KEY, {"torchair_graph.py": b"print(1)\n"},
                                                    {"compiler": "torchair"}), "files")
    good = rc.prepare(files, "ge_cache")
    _write(good, "m.om", b"m" * 3000)
    good.after_run()
    altered = rc.prepare(files, "fw.ge_cache")
    _write(altered, "m.om", b"fw")
    altered.after_run()
    _write(altered, "m.om", b"fw model rewritten")  # another size than its seal says
    dead = rc.prepare(files, "bw.ge_cache")
    _write(dead, "m.om", b"half")
    dead._release()  # its process died before the first run returned: never sealed
    writing = rc.prepare(files, "static_kernels")
    _write(writing, "k.bin", b"kernel")
    yield root, files, writing
    writing._release()


def _runtime_lines(out: str) -> dict[str, str]:
    return {line.split()[2]: line for line in out.splitlines() if line.strip().startswith("run-time cache")}


def test_ls_lists_each_run_time_cache_with_size_and_state(caches):
    root, _, _ = caches
    ls = cli("ls", root)
    assert ls.returncode == 0, ls.stderr
    lines = _runtime_lines(ls.stdout)
    assert set(lines) == {"ge_cache", "fw.ge_cache", "bw.ge_cache", "static_kernels"}, ls.stdout
    assert lines["ge_cache"].rstrip().endswith("sealed") and "2.9 KiB" in lines["ge_cache"]
    assert "broken" in lines["fw.ge_cache"] and "sizes differ" in lines["fw.ge_cache"]
    assert "unsealed" in lines["bw.ge_cache"] and "no seal" in lines["bw.ge_cache"]
    assert "being written" in lines["static_kernels"]
    assert "1 entry" in ls.stdout


def test_validate_hashes_them_and_sets_broken_ones_aside(caches):
    root, files, writing = caches
    model = os.path.join(files, "ge_cache", "m.om")
    data = bytearray(open(model, "rb").read())
    data[100] ^= 1  # same size: only hashing finds it
    open(model, "wb").write(bytes(data))
    assert _runtime_lines(cli("ls", root).stdout)["ge_cache"].rstrip().endswith("sealed")  # ls does not hash

    out = cli("validate", root)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"broken: graphs/{KEY[:16]} run-time cache ge_cache" in out.stdout and "sha256" in out.stdout
    assert "run-time cache fw.ge_cache" in out.stdout and "run-time cache bw.ge_cache" in out.stdout
    assert "moved to quarantine/" in out.stdout and "busy:" in out.stdout and "static_kernels" in out.stdout
    assert "0 broken entries, 3 broken run-time caches" in out.stdout
    assert sorted(os.listdir(files)) == ["static_kernels", "torchair_graph.py"]  # set aside; the busy one kept
    assert len(os.listdir(os.path.join(root, "quarantine"))) == 3
    assert os.listdir(os.path.join(files, "static_kernels")) == ["k.bin"]

    writing.after_run()  # its first run returns: sealed
    again = cli("validate", root)
    assert again.returncode == 0 and "0 broken entries" in again.stdout, again.stdout
    fresh = rc.prepare(files, "ge_cache")  # GE rebuilds the one set aside
    assert fresh is not None and fresh.writer and os.listdir(fresh.path) == []
    fresh._release()
