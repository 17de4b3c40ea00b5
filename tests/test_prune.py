"""A bounded cache: LRU pruning that never removes an entry being read or compiled,
the ``max_size`` option applied after each store, and ``torchair-cache prune``."""

from __future__ import annotations

import json
import os
import time

from torchair_cached_backend import cli
from torchair_cached_backend import fs_security as fs
from torchair_cached_backend.inventory import disk_size
from torchair_cached_backend.prune import prune
from torchair_cached_backend.store import Store, _flock, fcntl

KIB = 1024


def _aged(store: Store, key: str, size: int, last_used: float) -> None:
    store.save(key, {"blob": bytes(size)}, {})
    path = os.path.join(store.entry_path(key), "manifest.json")
    manifest = json.loads(open(path).read())
    manifest["last_used"] = last_used
    open(path, "w").write(json.dumps(manifest))


def _tree(tmp_path):
    """Four 16 KiB entries over two roots (a cache_compile-like layout), oldest first: a, b, c, d."""
    now = time.time()
    graphs = Store(str(tmp_path / "cache" / "M_static_1"), "graphs")
    programs = Store(str(tmp_path / "cache" / "M_static_1" / "forward"), "programs")
    for i, (store, key) in enumerate([(graphs, "a"), (programs, "b"), (graphs, "c"), (programs, "d")]):
        _aged(store, key, 16 * KIB, now - 86400 * (10 - i))
    return str(tmp_path / "cache"), graphs, programs


def test_least_recently_used_go_first_quarantine_before_them(tmp_path):
    root, graphs, programs = _tree(tmp_path)
    qdir = tmp_path / "cache" / "M_static_1" / "quarantine" / "graphs-old"
    qdir.mkdir(parents=True)
    (qdir / "blob").write_bytes(bytes(8 * KIB))
    total = prune(root, 1 << 40, dry_run=True).size_before  # entries and quarantine
    assert total == 4 * 16 * KIB + 8 * KIB + sum(disk_size(s.entry_path(k)) - 16 * KIB for s in (graphs, programs)
                                                  for k in s.keys())  # blobs plus their manifests
    dry = prune(root, total - 1, dry_run=True)
    assert dry.removed == ["quarantine/graphs-old"] and os.path.exists(qdir)
    report = prune(root, total - 20 * KIB)  # the quarantine and the oldest entry must go
    assert report.removed == ["quarantine/graphs-old", "graphs/a"], report.removed
    assert graphs.keys() == ["c"] and programs.keys() == ["b", "d"]
    left = sum(disk_size(s.entry_path(k)) for s in (graphs, programs) for k in s.keys())
    assert report.size_after <= total - 20 * KIB and report.size_after == left
    report = prune(root, 0)
    assert graphs.keys() == [] and programs.keys() == [] and report.size_after == 0


def test_entries_being_read_or_compiled_are_never_pruned(tmp_path):
    root, graphs, programs = _tree(tmp_path)
    reading = fs.open_dir(graphs.entry_path("a"), root=graphs.root)  # what Store.load holds while verifying
    assert _flock(reading, fcntl.LOCK_SH)
    try:
        with programs.lock("b"):  # a process compiling/replacing b
            report = prune(root, 0)
    finally:
        os.close(reading)
    assert sorted(report.busy) == ["graphs/a", "programs/b"], report.busy
    assert graphs.keys() == ["a"] and programs.keys() == ["b"]
    assert prune(root, 0).removed == ["graphs/a", "programs/b"]  # once idle, they go


def test_dead_writers_leftovers_are_swept(tmp_path):
    root, graphs, _ = _tree(tmp_path)
    stale = os.path.join(graphs.dir, ".tmp-a-999999-deadbeef")
    os.mkdir(stale)
    open(os.path.join(stale, "half"), "wb").write(b"x")
    prune(root, 1 << 30, stale_tmp_age_s=0)
    assert not os.path.exists(stale) and graphs.keys() == ["a", "c"]


def test_cli_prune(tmp_path, capsys):
    root, graphs, programs = _tree(tmp_path)
    assert cli.main(["prune", root, "--max-size", "40KiB"]) == 0
    out = capsys.readouterr().out
    assert "removed graphs/a" in out and "removed programs/b" in out
    assert prune(root, 1 << 40, dry_run=True).size_before <= 40 * KIB
    assert cli.main(["prune", root, "--max-size", "lots"]) == 2
    assert "a size must be" in capsys.readouterr().err


def test_max_size_option_bounds_the_cache_after_each_store(run, tmp_path):
    cache = str(tmp_path / "cache")
    out = run(
        f"""
        import os, torch
        from torchair_cached_backend.inventory import disk_size
        from child_helpers import same
        sizes, ok = [], []
        fns = [lambda x: x.sin() + 1, lambda x: x.cos() * 2, lambda x: x.tanh() - 3, lambda x: x.exp() / 4]
        with torch.no_grad():
            for i, fn in enumerate(fns):
                c = torch.compile(fn, backend="npu_cached", options={{"cache_dir": {cache!r}, "compiler": "eager",
                                                                      "max_size": "24KiB"}})
                ok.append(same(c(torch.ones(3)), fn(torch.ones(3))))
                sizes.append(disk_size(os.path.join({cache!r}, "graphs")))
        emit({{"ok": ok, "sizes": sizes, "graphs": sorted(os.listdir(os.path.join({cache!r}, "graphs")))}})
        """
    )
    assert all(out["ok"]), out
    assert max(out["sizes"]) <= 24 * KIB, out["sizes"]
    assert 1 <= len(out["graphs"]) < 4, out["graphs"]  # older graphs were pruned, the newest kept
