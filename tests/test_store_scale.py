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


def _programs(tmp_path, n: int) -> str:
    """A program store with one real entry (a function ``f`` compiled) and ``n`` programs of other
    functions (that entry under other keys: other prefixes)."""
    import os
    import shutil

    d = str(tmp_path / "programs_cache")
    f = torch.compile(_double, backend="npu_cached", options={"cache_dir": d, "compiler": "eager"})
    f(torch.ones(3))
    root = os.path.join(d, "programs")
    (real,) = os.listdir(root)
    for i in range(n):
        shutil.copytree(os.path.join(root, real), os.path.join(root, f"{i:064x}"))
    return d


def _double(x):
    return x * 2


def _triple(x):
    return x * 3


def test_a_program_miss_reads_no_other_functions_manifest(tmp_path, monkeypatch):
    # a warm start's misses (the backend route looks up every frame the replayed code calls: config
    # getters with no program) read every program's manifest to explain themselves: 0.37 s per miss at
    # 2000 programs. The key's prefix names the function: a miss reads only its own function's entries
    from torchair_cached_backend import CacheMiss, load

    d = _programs(tmp_path, N)
    reads = []
    real = Store.read_manifest
    monkeypatch.setattr(Store, "read_manifest", lambda self, k: reads.append(k) or real(self, k))
    try:
        load(_triple, d, compiler="eager", fallback=False)
        raise AssertionError("a function with no program loaded")
    except CacheMiss as miss:
        assert "no cached program" in str(miss), miss
    assert reads == [], reads


def test_a_program_miss_still_finds_an_edited_version(tmp_path):
    # the other half: an entry of the same function with other code is found (by its prefix) and set aside
    import os

    from torchair_cached_backend import CacheMiss, load

    d = _programs(tmp_path, 0)
    global _double
    kept = _double

    def _double(x):  # noqa: F811  (the same function, edited)
        return x * 2 + 0

    try:
        load(_double, d, compiler="eager", fallback=False)
        raise AssertionError("an edited function loaded its old program")
    except CacheMiss as miss:
        assert "is stale" in str(miss) and "was edited" in str(miss), miss
    finally:
        _double = kept
    assert os.listdir(os.path.join(d, "programs")) == []  # the stale entry set aside


def _quadruple(x):
    return x * 4


def _miss(fn, d: str) -> str:
    from torchair_cached_backend import CacheMiss, load

    try:
        load(fn, d, compiler="eager", fallback=False)
    except CacheMiss as miss:
        return str(miss)
    raise AssertionError(f"{fn.__name__} loaded a program")


def _age(path: str, seconds: float = 60.0) -> None:
    import os
    import time

    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_processs_program_misses_list_the_store_once(tmp_path, monkeypatch):
    # each miss listed the whole store to find its function's entries: ~7 ms per miss at 10 000
    # programs, once for every frame under a replay that has no program (BERT's config getters).
    # One listing now serves the process's misses while the directory is unchanged
    import os

    d = _programs(tmp_path, N)
    _age(os.path.join(d, "programs"))
    listings = []
    real = Store.keys
    monkeypatch.setattr(Store, "keys", lambda self: listings.append(self.kind) or real(self))
    for fn in (_triple, _quadruple, _triple):
        assert "no cached program" in _miss(fn, d)
    assert listings == ["programs"], listings


def test_a_listing_taken_right_after_a_change_is_not_reused(tmp_path, monkeypatch):
    # an entry added within the same timestamp tick as the listing would leave the directory's
    # mtime unchanged: a directory changed in the last seconds is listed again
    d = _programs(tmp_path, N)  # just written
    listings = []
    real = Store.keys
    monkeypatch.setattr(Store, "keys", lambda self: listings.append(self.kind) or real(self))
    for fn in (_triple, _quadruple):
        assert "no cached program" in _miss(fn, d)
    assert listings == ["programs", "programs"], listings


def test_a_program_stored_after_the_listing_is_found_by_a_later_miss(tmp_path):
    # the listing is reused only while the directory is the one listed: an older version of a
    # function published meanwhile (by another process) is still found, and set aside, as stale
    import os
    import shutil

    d = _programs(tmp_path, 0)
    root = os.path.join(d, "programs")
    (entry,) = os.listdir(root)
    parked = str(tmp_path / "parked")
    shutil.move(os.path.join(root, entry), parked)
    _age(root)
    assert "no cached program" in _miss(_triple, d)  # the process's listing: an empty store
    shutil.move(parked, os.path.join(root, entry))  # _double's program arrives
    global _double
    kept = _double

    def _double(x):  # noqa: F811  (the same function, edited)
        return x * 2 + 0

    try:
        text = _miss(_double, d)
    finally:
        _double = kept
    assert "is stale" in text and "was edited" in text, text
    assert os.listdir(root) == []
