"""Bundles: pack a cache on one machine, unpack it on another, replay without Dynamo;
and every way a hostile or damaged bundle is refused before anything is written."""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
from subprocess_helpers import REPO, run_python

from torchair_cached_backend import cli
from torchair_cached_backend.bundle import BUNDLE_MANIFEST, SIGNATURE, BundleError, Limits, pack, unpack, verify
from torchair_cached_backend.store import Store

# ---------------------------------------------------------------------------
# a bundle made by pack, and hostile variants of it (no torch needed)
# ---------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path):
    """A cache_compile-like tree: graphs at the model level, a program per function."""
    root = tmp_path / "cache"
    Store(str(root / "M_dynamic_ab12"), "graphs").save("g1", {"graph.py": b"print(1)\n", "k.so": b"\x7fELF" * 64}, {})
    Store(str(root / "M_dynamic_ab12" / "prompt"), "programs").save("p1", {"f0.code": b"code"}, {"versions": {"torch": "x"}})
    Store(str(root), "graphs").save("g2", {"graph.py": b"print(2)\n"}, {})
    return str(root)


def _members(bundle: str) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(bundle) as tar:
        return [(m, tar.extractfile(m).read() if m.isreg() else None) for m in tar.getmembers()]


def _write(bundle: str, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> str:
    with tarfile.open(bundle, "w") as tar:
        for info, data in members:
            info = copy.copy(info)
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return bundle


def _info(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, size, linkname
    return info


def test_pack_unpack_verify_round_trip(cache, tmp_path):
    bundle = str(tmp_path / "c.tar.xz")
    out = pack(cache, bundle)
    assert out["entries"] == 3 and out["skipped_broken"] == [] and not out["signed"]
    assert tarfile.open(bundle).getnames()[-1] == BUNDLE_MANIFEST
    assert verify(bundle)["entries"] == 3
    target = tmp_path / "elsewhere"
    summary = unpack(bundle, str(target))
    assert (summary["published"], summary["kept"]) == (3, 0)
    entry = Store(str(target / "M_dynamic_ab12"), "graphs").load("g1")
    assert entry.files["k.so"] == b"\x7fELF" * 64
    assert Store(str(target / "M_dynamic_ab12" / "prompt"), "programs").load("p1").manifest["versions"] == {"torch": "x"}
    assert os.path.isfile(target / "CACHEDIR.TAG") and os.path.isfile(target / "M_dynamic_ab12" / "CACHEDIR.TAG")
    assert not [p for p in target.rglob(".tmp-*")]
    assert unpack(bundle, str(target))["kept"] == 3  # intact entries already there are kept


def test_broken_entries_are_not_packed(cache, tmp_path):
    blob = os.path.join(Store(cache, "graphs").entry_path("g2"), "files", "graph.py")
    with open(blob, "ab") as f:
        f.write(b"# flipped")
    out = pack(cache, str(tmp_path / "c.tar"))
    assert out["entries"] == 2 and len(out["skipped_broken"]) == 1 and "g2" in out["skipped_broken"][0]


HOSTILE = {
    "absolute path": (lambda m: m + [(_info("/etc/cron.d/x", size=1), b"x")], "absolute path"),
    "dot-dot": (lambda m: m + [(_info("cache/../../x", size=1), b"x")], "'..'"),
    "symlink": (lambda m: m + [(_info("cache/graphs/l", tarfile.SYMTYPE, linkname="/etc/passwd"), None)], "symlink"),
    "hard link": (lambda m: m + [(_info("cache/graphs/h", tarfile.LNKTYPE, linkname="/etc/passwd"), None)], "hard link"),
    "device": (lambda m: m + [(_info("cache/graphs/d", tarfile.CHRTYPE), None)], "device file"),
    "fifo": (lambda m: m + [(_info("cache/graphs/p", tarfile.FIFOTYPE), None)], "fifo"),
    "directory": (lambda m: m + [(_info("cache/graphs", tarfile.DIRTYPE), None)], "directory"),
    "extra member": (lambda m: m + [(_info("cache/graphs/g9/files/evil.so", size=4), b"evil")], "not in its manifest"),
    "duplicate member": (lambda m: m + [m[0]], "appears twice"),
    "missing member": (lambda m: m[1:], "lacks"),
    "no manifest": (lambda m: [x for x in m if x[0].name != BUNDLE_MANIFEST], "no torchair-bundle.json"),
    "altered blob": (lambda m: [(i, d.replace(b"print(1)", b"print(7)") if d else d) for i, d in m], "sha256"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_bundle_is_refused_and_nothing_is_written(cache, tmp_path, case):
    good = str(tmp_path / "good.tar")
    pack(cache, good)
    change, message = HOSTILE[case]
    bad = _write(str(tmp_path / "bad.tar"), change(_members(good)))
    target = tmp_path / "target"
    with pytest.raises(BundleError, match=message.replace("(", r"\(").replace(".", r"\.")):
        unpack(bad, str(target))
    assert not target.exists(), list(target.rglob("*"))
    with pytest.raises(BundleError):
        verify(bad)


@pytest.mark.parametrize("limit,message", [
    (Limits(max_member_size=100), "over the limit"),
    (Limits(max_total_size=300), "unpacks to"),
    (Limits(max_members=3), "more than 3 members"),
])
def test_size_and_count_limits(cache, tmp_path, limit, message):
    bundle = str(tmp_path / "c.tar.gz")
    pack(cache, bundle)
    with pytest.raises(BundleError, match=message):
        unpack(bundle, str(tmp_path / "target"), limits=limit)
    assert not (tmp_path / "target").exists()


def test_signing(cache, tmp_path, monkeypatch):
    signed, unsigned = str(tmp_path / "s.tar"), str(tmp_path / "u.tar")
    pack(cache, unsigned)
    monkeypatch.setenv("TORCHAIR_CACHE_KEY", "fleet-secret")
    assert pack(cache, signed)["signed"]
    assert SIGNATURE in tarfile.open(signed).getnames()
    assert verify(signed)["signature"] == "verified"
    assert unpack(signed, str(tmp_path / "ok"))["published"] == 3
    with pytest.raises(BundleError, match="not signed"):
        unpack(unsigned, str(tmp_path / "t1"))
    members = _members(signed)  # altered manifest, original signature
    altered = [(i, d.replace(b'"g2"', b'"g3"').replace(b"/g2/", b"/g3/") if i.name == BUNDLE_MANIFEST else d)
               for i, d in members]
    altered = [(copy.copy(i), d) for i, d in altered]
    for info, _ in altered:
        info.name = info.name.replace("/g2/", "/g3/")
    with pytest.raises(BundleError, match="signature does not match"):
        unpack(_write(str(tmp_path / "a.tar"), altered), str(tmp_path / "t2"))
    monkeypatch.setenv("TORCHAIR_CACHE_KEY", "another-key")
    with pytest.raises(BundleError, match="signature does not match"):
        unpack(signed, str(tmp_path / "t3"))
    for d in ("t1", "t2", "t3"):
        assert not (tmp_path / d).exists()
    monkeypatch.delenv("TORCHAIR_CACHE_KEY")
    assert verify(signed)["signature"] == "not checked"


def test_cli_pack_ls_verify_unpack(cache, tmp_path, capsys):
    bundle = str(tmp_path / "c.tgz")
    assert cli.main(["pack", cache, bundle]) == 0
    assert cli.main(["ls", bundle]) == 0
    listing = capsys.readouterr().out
    assert "M_dynamic_ab12/graphs" in listing and "3 entries" in listing
    assert cli.main(["verify", bundle]) == 0
    assert cli.main(["unpack", bundle, str(tmp_path / "t")]) == 0
    assert "3 entries published" in capsys.readouterr().out
    _write(str(tmp_path / "bad.tar"), _members(bundle) + [(_info("/abs", size=1), b"x")])
    assert cli.main(["unpack", str(tmp_path / "bad.tar"), str(tmp_path / "t2")]) == 2
    assert "absolute path" in capsys.readouterr().err and not (tmp_path / "t2").exists()


# ---------------------------------------------------------------------------
# a bundle made on one machine serves bypass warm starts on another
# ---------------------------------------------------------------------------

COLD = """
import torch, torchair_cached_backend as tcb
from child_helpers import same, stats
from models import build
res = {}
with torch.no_grad():
    for name in NAMES:
        m, x = build(name)
        c = torch.compile(m, backend="npu_cached", options={"cache_dir": os.path.join(ROOT, name), "compiler": COMPILER})
        res[name] = same(c(x), m(x))
emit({"same": res, "stats": stats()})
"""

WARM = """
import torch, torchair_cached_backend as tcb
from child_helpers import same, stats
from models import build
res = {}
with torch.no_grad():
    for name in NAMES:
        m, x = build(name)
        f = tcb.load(m, os.path.join(ROOT, name), compiler=COMPILER, fallback=False)
        res[name] = same(f(x), m(x))
emit({"same": res, "stats": stats(), "dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules,
      "inductor_dir": os.listdir(os.environ["TORCHINDUCTOR_CACHE_DIR"])})
"""


def _round_trip(run, tmp_path, names, compiler):
    built, shipped = str(tmp_path / "built"), str(tmp_path / "shipped")
    head = f"import os, sys\nROOT, NAMES, COMPILER = {built!r}, {names!r}, {compiler!r}\n"
    cold = run(head + COLD, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-build")})
    assert all(cold["same"].values()) and cold["stats"]["misses"] == len(names), cold
    bundle = str(tmp_path / "cache.tar.gz")
    env = dict(os.environ, PYTHONPATH=REPO, TORCHAIR_CACHE_KEY="fleet-secret")
    proc = subprocess.run([sys.executable, "-m", "torchair_cached_backend", "pack", built, bundle], env=env,
                          capture_output=True, text=True)  # the console entry point, signed
    assert proc.returncode == 0 and "signed" in proc.stdout, proc.stderr
    assert unpack(bundle, shipped, key="fleet-secret")["published"] == 2 * len(names)  # a graph and a program each
    (tmp_path / "inductor-empty").mkdir()
    head = head.replace(repr(built), repr(shipped))
    return run(head + WARM, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-empty")})


def test_bundle_replays_elsewhere_without_dynamo(run, tmp_path):
    names = ["mlp", "helper"]
    warm = _round_trip(run, tmp_path, names, "eager")
    assert all(warm["same"].values()), warm
    s = warm["stats"]
    assert (s["bypass_loads"], s["hits"], s["misses"]) == (len(names), len(names), 0), s
    assert not warm["dynamo"]


@pytest.fixture(scope="module")
def inductor_shipped(tmp_path_factory):
    """An Inductor-compiled MLP cache, packed, unpacked elsewhere and warm-started there."""
    tmp = tmp_path_factory.mktemp("inductor")
    return tmp, _round_trip(run_python, tmp, ["mlp"], "inductor")


@pytest.mark.slow
def test_bundle_carries_inductor_kernels(inductor_shipped):
    _, warm = inductor_shipped
    assert warm["same"]["mlp"] and warm["stats"]["bypass_loads"] == 1 and warm["stats"]["misses"] == 0, warm
    assert not warm["dynamo"] and not warm["inductor"] and warm["inductor_dir"] == []


@pytest.mark.slow
def test_a_manifest_cannot_point_a_kernel_outside_the_cache(inductor_shipped, run):
    """Paths come from our code, never from a manifest: a kernel named by an absolute path
    outside the cache (not in the entry's checksummed file list) must never be dlopened."""
    tmp_path, _ = inductor_shipped
    tampered = tmp_path / "tampered"
    shutil.copytree(tmp_path / "shipped", tampered)
    (manifest_path,) = (tampered / "mlp" / "graphs").glob("*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    kernels = manifest["meta"]["kernels"]
    assert kernels, "the MLP graph should bundle at least one C++ kernel"
    evil = tmp_path / "outside" / "evil.so"
    evil.parent.mkdir()
    for name, (fname, _digest) in kernels.items():
        shutil.copy(manifest_path.parent / "files" / fname, evil)  # a working kernel, so only a refusal stops it
        kernels[name][0] = str(evil)
    manifest_path.write_text(json.dumps(manifest))
    out = run(
        f"""
        import torch, torchair_cached_backend as tcb
        from child_helpers import stats
        from models import build
        from torchair_cached_backend.bypass.loader import CacheMiss
        m, x = build("mlp")
        try:
            with torch.no_grad():
                tcb.load(m, {str(tampered / "mlp")!r}, compiler="inductor", fallback=False)(x)
            refused = False
        except CacheMiss:
            refused = True
        emit({{"refused": refused, "mapped": {str(evil)!r} in open("/proc/self/maps").read(), "stats": stats()}})
        """,
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-empty")},
    )
    assert not out["mapped"], "a .so named by the manifest, outside the checksummed files, was dlopened"
    assert out["refused"] and out["stats"]["quarantined"] == 1, out
