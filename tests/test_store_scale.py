"""Issue 14, scale: maintenance is linear and a new graph's store cost does not grow with
the cache (counted operations, not timings: those are in benchmarks/store_scale.py)."""

from __future__ import annotations

import torch

from torchair_cached_backend import backend, cli, inventory, prune
from torchair_cached_backend.compilers import get_compiler
from torchair_cached_backend.compilers.base import Artifact, CompileResult
from torchair_cached_backend.options import parse_options
from torchair_cached_backend.store import Store

N = 30


def _cache(tmp_path) -> Store:
    store = Store(str(tmp_path / "cache"), "graphs")
    for i in range(N):
        store.save(f"k{i:03d}", {"blob": b"x" * 100}, {"identity": "same-graph", "versions": {"torch": str(i)}})
    return store


def test_validate_sweeps_each_store_once_not_once_per_entry(tmp_path, monkeypatch, capsys):
    store = _cache(tmp_path)
    calls = []
    real = Store.sweep
    monkeypatch.setattr(Store, "sweep", lambda self, *a: calls.append(self.kind) or real(self, *a))
    assert cli.main(["validate", store.root]) == 0
    assert len(calls) == 1, len(calls)


def test_a_new_graph_reads_no_other_entry(tmp_path, monkeypatch):
    store = _cache(tmp_path)
    reads = []
    for name in ("keys", "read_manifest", "read_verified", "load"):
        real = getattr(Store, name)
        monkeypatch.setattr(Store, name, lambda self, *a, _r=real, _n=name: reads.append(_n) or _r(self, *a))
    served = backend._compile_and_store(
        store, "new", {"environment": {"torch": "new"}}, torch.fx.symbolic_trace(lambda x: x + 1), [],
        get_compiler("eager"), parse_options({"cache_dir": store.root}),
        lambda *a: CompileResult(lambda x: x, Artifact({"blob": b"y"}, {})),
    )
    assert served.cached  # stored beside the other versions' entries of the same graph
    assert reads == [], reads  # without reading (or quarantining) any of them
    assert len(store.keys()) == N + 1  # the other versions' entries are all still there


def test_max_size_scans_the_cache_only_when_needed(tmp_path, monkeypatch):
    store = _cache(tmp_path)
    scans = []
    real = inventory.find_entries
    monkeypatch.setattr(prune, "find_entries", lambda path: scans.append(path) or real(path))
    for i in range(20):
        store.save(f"new{i}", {"blob": b"y" * 100}, {})
        backend._bound_size(store, 1 << 30, f"new{i}")  # what the backend runs after each store
    assert len(scans) == 1, len(scans)  # one count at the first store, then the ledger
    store.save("big", {"blob": b"z" * (1 << 20)}, {})
    backend._bound_size(store, 1 << 20, "big")  # over max_size: now it scans and prunes
    assert len(scans) == 2 and store.keys() == ["big"]
