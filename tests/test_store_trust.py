"""Issue 14, trust boundary: only verified bytes run, the root is held by fd (a path
swapped for a symlink changes nothing), a group/other-writable root is refused, and an
empty signing key is an error. Cross-process behaviour runs in fresh interpreters."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from subprocess_helpers import run_python

from torchair_cached_backend import cli
from torchair_cached_backend.fs_security import CacheSecurityError
from torchair_cached_backend.store import Store

FILL = """
import torch
import torchair_cached_backend as tcb
from child_helpers import same
class A(torch.nn.Module):
    def forward(self, x):
        return x.sin() * 2 + 1
class B(torch.nn.Module):
    def forward(self, x):
        return x.cos() - 3
x = torch.arange(6.0).reshape(2, 3)
ok = True
for m in (A(), B())[:MODELS]:
    f = torch.compile(m, backend="npu_cached", options={"cache_dir": CACHE, "compiler": COMPILER})
    with torch.no_grad():
        ok = ok and same(f(x), m(x))
emit({"ok": ok, "misses": tcb.stats().misses})
"""


def _fill(cache: str, compiler: str, models: int) -> None:
    out = run_python(f"CACHE, COMPILER, MODELS = {cache!r}, {compiler!r}, {models}\n" + FILL)
    assert out["ok"] and out["misses"] == models, out


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("inductor") / "cache")
    _fill(cache, "inductor", 1)
    return cache


def test_inductor_loader_runs_only_the_verified_bytes(inductor_cache, tmp_path):
    """Files swapped in the entry after the store verified it (wrapper bytecode, source,
    kernel .so) are never executed nor dlopened: the loader uses the verified bytes."""
    cache = str(tmp_path / "cache")
    shutil.copytree(inductor_cache, cache)
    marker = str(tmp_path / "foreign_code_ran")
    out = run_python(f"""
        import marshal, os, torch
        import torchair_cached_backend as tcb
        from torchair_cached_backend import store_backend
        from child_helpers import same
        MARKER = {marker!r}
        def swap(store, key):  # runs right after the checksums passed, before the bytes are used
            if store.kind != "graphs":
                return
            files = os.path.join(store.entry_path(key), "files")
            evil = f"open({{MARKER!r}}, 'w').close()\\ndef call(args):\\n    return [args[0]]\\n"
            for name in os.listdir(files):
                path = os.path.join(files, name)
                if name == "wrapper.py.marshal":
                    data = marshal.dumps(compile(evil, "evil", "exec"))
                elif name == "wrapper.py":
                    data = evil.encode()
                elif name.endswith(".so"):
                    data = b"\\x7fELF not a kernel"
                else:
                    continue
                with open(path, "wb") as f:
                    f.write(data)
        store_backend.AFTER_VERIFY.append(swap)
        class A(torch.nn.Module):
            def forward(self, x):
                return x.sin() * 2 + 1
        x = torch.arange(6.0).reshape(2, 3)
        f = torch.compile(A(), backend="npu_cached", options={{"cache_dir": {cache!r}, "compiler": "inductor"}})
        with torch.no_grad():
            y = f(x)
        s = tcb.stats()
        emit({{"ok": same(y, A()(x)), "hits": s.hits, "misses": s.misses, "quarantined": s.quarantined,
               "marker": os.path.exists(MARKER)}})
    """)
    assert not out["marker"], "code swapped in after verification ran"
    assert out["ok"] and out["hits"] == 1 and out["misses"] == 0 and out["quarantined"] == 0, out


@pytest.fixture(scope="module")
def eager_cache(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("eager") / "cache")
    _fill(cache, "eager", 2)
    return cache


def _poison(cache: str, marker: str) -> None:
    """Make every graph entry of ``cache`` run ``open(marker)`` (checksums fixed up: what an
    attacker who can build the content-derived key would plant)."""
    import hashlib

    gdir = os.path.join(cache, "graphs")
    for key in os.listdir(gdir):
        entry = os.path.join(gdir, key)
        manifest = json.load(open(os.path.join(entry, "manifest.json")))
        src = os.path.join(entry, "files", "graph.py")
        data = f"open({marker!r}, 'w').close()\n".encode() + open(src, "rb").read()
        open(src, "wb").write(data)
        os.remove(os.path.join(entry, "files", "graph.py.marshal"))
        manifest["files"].pop("graph.py.marshal")
        manifest["files"]["graph.py"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        open(os.path.join(entry, "manifest.json"), "w").write(json.dumps(manifest))


def test_root_swapped_for_a_symlink_mid_run_changes_nothing(eager_cache, tmp_path):
    """A world-writable parent (a shared /scratch): after the victim's first call, the root's
    path becomes a symlink to a planted copy. The victim keeps using its own root (held by fd):
    no foreign code, no CacheSecurityError, none of its entries quarantined."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o777)
    cache = str(scratch / "cache")
    shutil.copytree(eager_cache, cache)
    marker = str(tmp_path / "foreign_code_ran")
    planted = str(tmp_path / "planted")
    shutil.copytree(eager_cache, planted)
    _poison(planted, marker)
    out = run_python(f"""
        import os, torch
        import torchair_cached_backend as tcb
        from child_helpers import same
        class A(torch.nn.Module):
            def forward(self, x):
                return x.sin() * 2 + 1
        class B(torch.nn.Module):
            def forward(self, x):
                return x.cos() - 3
        x = torch.arange(6.0).reshape(2, 3)
        opts = {{"cache_dir": {cache!r}, "compiler": "eager"}}
        results = []
        with torch.no_grad():
            results.append(same(torch.compile(A(), backend="npu_cached", options=opts)(x), A()(x)))
            os.rename({cache!r}, {cache!r} + ".moved")  # the swap: the path now leads to the planted copy
            os.symlink({planted!r}, {cache!r})
            try:
                results.append(same(torch.compile(B(), backend="npu_cached", options=opts)(x), B()(x)))
                error = None
            except Exception as exc:
                error = f"{{type(exc).__name__}}: {{exc}}"
        s = tcb.stats()
        emit({{"results": results, "error": error, "hits": s.hits, "quarantined": s.quarantined,
               "marker": os.path.exists({marker!r})}})
    """)
    assert not out["marker"], "the planted entry ran"
    assert out["error"] is None, out["error"]
    assert out["results"] == [True, True] and out["hits"] == 2 and out["quarantined"] == 0, out
    for where in (cache + ".moved", planted):
        assert not os.path.exists(os.path.join(where, "quarantine")), where


def test_group_or_other_writable_root_is_refused_with_the_fix(tmp_path):
    root = tmp_path / "c"
    Store(str(root), "graphs").save("k", {"a": b"x"}, {})
    from torchair_cached_backend import store_backend

    for mode in (0o770, 0o707):
        os.chmod(root, mode)
        store_backend.forget_root(str(root))  # a new process: the root is opened again
        with pytest.raises(CacheSecurityError, match=f"chmod 700 {root}"):
            Store(str(root), "graphs").load("k")
    os.chmod(root, 0o700)
    store_backend.forget_root(str(root))
    assert Store(str(root), "graphs").load("k").files == {"a": b"x"}


def test_a_set_but_empty_signing_key_is_an_error(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    Store(str(cache), "graphs").save("g1", {"graph.py": b"print(1)\n"}, {})
    bundle = str(tmp_path / "b.tar")
    monkeypatch.delenv("TORCHAIR_CACHE_KEY", raising=False)
    assert cli.main(["pack", str(cache), bundle]) == 0  # unsigned
    monkeypatch.setenv("TORCHAIR_CACHE_KEY", "")  # KEY=$SECRET with $SECRET unset
    target = tmp_path / "target"
    for argv in (["unpack", bundle, str(target)], ["verify", bundle], ["pack", str(cache), str(tmp_path / "c.tar")]):
        capsys.readouterr()
        assert cli.main(argv) == 2, argv
        assert "TORCHAIR_CACHE_KEY is set but empty" in capsys.readouterr().err
    assert not target.exists() and not (tmp_path / "c.tar").exists()


#: a warm start of model A over ``CACHE`` on ``ROUTE`` (the backend route or load()), in a fresh process
WARM_A = """
import os, torch
import torchair_cached_backend as tcb
from child_helpers import same
class A(torch.nn.Module):
    def forward(self, x):
        return x.sin() * 2 + 1
x = torch.arange(6.0).reshape(2, 3)
try:
    with torch.no_grad():
        if ROUTE == "load":
            f = tcb.load(A(), CACHE, compiler="eager")
        else:
            f = torch.compile(A(), backend="npu_cached", options={"cache_dir": CACHE, "compiler": "eager"})
        ok, error = same(f(x), A()(x)), None
except Exception as exc:
    ok, error = False, f"{type(exc).__name__}: {exc}"
s = tcb.stats()
emit({"ok": ok, "error": error, "quarantined": s.quarantined, "hits": s.hits, "loads": s.bypass_loads,
      "aside": sorted(os.listdir(os.path.join(CACHE, "quarantine"))) if os.path.isdir(os.path.join(CACHE, "quarantine")) else []})
"""


@pytest.mark.parametrize("route", ["backend", "load"])
@pytest.mark.parametrize("plant", ["fifo as the graph's code", "symlinked program file", "directory as the manifest"])
def test_a_planted_entry_file_never_fails_or_hangs_a_start_and_is_rebuilt(eager_cache, tmp_path, route, plant):
    # found by a probe: a FIFO where an entry's file belongs hung the warm start for ever (open()
    # waited for a writer); a symlink or a directory there raised CacheSecurityError out of the user's
    # call (BackendCompilerFailed on the backend route). Now such an entry is never read, reported,
    # set aside and rebuilt, and the call is served; a third process hits the rebuilt entry
    cache = str(tmp_path / "cache")
    shutil.copytree(eager_cache, cache)
    kind = "programs" if plant.startswith("symlinked program") else "graphs"
    for key in os.listdir(os.path.join(cache, kind)):
        entry = os.path.join(cache, kind, key)
        if plant.startswith("fifo"):
            path = os.path.join(entry, "files", "graph.py.marshal")
            os.remove(path)
            os.mkfifo(path)
        elif plant.startswith("symlinked"):
            name = next(n for n in os.listdir(os.path.join(entry, "files")) if n.endswith(".code"))
            path = os.path.join(entry, "files", name)
            os.rename(path, str(tmp_path / name))
            os.symlink(str(tmp_path / name), path)
        else:
            path = os.path.join(entry, "manifest.json")
            os.remove(path)
            os.mkdir(path)
    script = f"CACHE, ROUTE = {cache!r}, {route!r}\n" + WARM_A
    out = run_python(script, timeout=300)
    assert out["error"] is None and out["ok"], out
    assert out["quarantined"] >= 1 and out["aside"], out
    again = run_python(script, timeout=300)
    assert again["error"] is None and again["ok"] and again["quarantined"] == 0, again
    assert again["hits"] >= 1 or again["loads"] >= 1, again


@pytest.mark.parametrize("route", ["backend", "load"])
def test_entry_files_others_may_write_never_run(eager_cache, tmp_path, route):
    # probe round 9: entry files left writable by others (0666, the root not group/other-writable) were
    # rewritten by another user, blob and checksum alike, and the planted bytes ran in the owner's warm
    # start on both routes, silently. Such an entry is now never read: set aside, rebuilt, the call served
    cache = str(tmp_path / "cache")
    shutil.copytree(eager_cache, cache)
    marker = str(tmp_path / "foreign_code_ran")
    _poison(cache, marker)
    for key in os.listdir(os.path.join(cache, "graphs")):
        entry = os.path.join(cache, "graphs", key)
        for path in [os.path.join(entry, "manifest.json")] + [
                os.path.join(entry, "files", n) for n in os.listdir(os.path.join(entry, "files"))]:
            os.chmod(path, 0o666)
    out = run_python(f"CACHE, ROUTE = {cache!r}, {route!r}\n" + WARM_A)
    assert not os.path.exists(marker), "bytes others could write ran"
    assert out["error"] is None and out["ok"] and out["quarantined"] >= 1, out
