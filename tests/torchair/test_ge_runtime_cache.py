"""GE's run-time cache (``ge_cache=True``) is sealed after GE writes it and verified before
GE reads it; sealed caches travel in bundles and through the remote.

The executor shim stands in for GE: at ``load`` it reads the compiled model cached in the
directory it is pointed at (recording the bytes it read), else writes one. A cold process
builds one cache; copies of it are tampered with (a byte flipped in the .om, an extra file,
a missing file, a symlink, a foreign owner, no seal, an altered seal) and one fresh warm
process runs over all of them: GE must never read the tampered bytes, every call succeeds,
the entry itself still hits, and GE's rebuilt cache is sealed again (a third process finds
every cache verified and reads it).
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest

from tests.torchair_harness.run import run_script

pytestmark = pytest.mark.torchair

TIMEOUT = 300
OM = "tcb_shim_ge_cache.om"

#: one process over several cache dirs (CACHES: JSON list); a report per dir
RUN = r"""
import json, os, sys
import torch, torchair
import torchair_cached_backend as tcb
from tests.torchair_harness import executor_shim

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x).relu() + x

model = Model()
report = {}
for cache in json.loads(os.environ["CACHES"]):
    torch._dynamo.reset()
    start, s0 = len(executor_shim.LOADS), tcb.stats().as_dict()
    opts = {"compiler": "torchair", "cache_dir": cache, "ge_cache": True}
    if os.environ.get("REMOTE"):
        opts["remote"] = os.environ["REMOTE"]
    compiled = torch.compile(model, backend="npu_cached", options=opts)
    with torch.no_grad():
        out = compiled(torch.ones(2, 4))
        out = compiled(torch.ones(2, 4))
    s1 = tcb.stats().as_dict()
    report[cache] = {"shape": list(out.shape),
                     "reads": [l["ge_cache_read"] for l in executor_shim.LOADS[start:]],
                     "dirs": [l["options"].get("ge.graph_compiler_cache_dir") for l in executor_shim.LOADS[start:]],
                     **{k: s1.get(k, 0) - s0.get(k, 0) for k in ("hits", "misses", "runtime_caches_set_aside", "remote_hits")}}
print(json.dumps(report))
"""


def _run(caches: list[str], **env: str) -> dict:
    proc = run_script(RUN, timeout=TIMEOUT, shim=True, env={"CACHES": json.dumps(caches), **env})
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1:]
    return json.loads(line)


def _files_dir(cache: str) -> str:
    (files,) = glob.glob(os.path.join(cache, "graphs", "*", "files"))
    return files


def _seal(cache: str) -> dict:
    with open(os.path.join(_files_dir(cache), "ge_cache.seal.json")) as f:
        return json.load(f)


def _om(cache: str) -> str:
    return os.path.join(_files_dir(cache), "ge_cache", OM)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """A cold process's cache (its GE wrote and sealed its model) and the model's bytes."""
    cache = str(tmp_path_factory.mktemp("ge") / "cold")
    (cold,) = _run([cache]).values()
    with open(_om(cache)) as f:
        model = f.read()
    return {"cache": cache, "report": cold, "model": model, "root": os.path.dirname(cache)}


def test_cold_process_seals_what_ge_wrote(built):
    cold, cache = built["report"], built["cache"]
    assert cold["misses"] == 1 and cold["reads"] == [None]  # GE compiled and wrote its model
    assert cold["dirs"] == [os.path.join(_files_dir(cache), "ge_cache")]
    seal = _seal(cache)
    assert seal["cache"] == "ge_cache" and seal["key"] == os.path.basename(os.path.dirname(_files_dir(cache)))
    data = open(_om(cache), "rb").read()
    import hashlib

    assert seal["files"] == {OM: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}


def _flip(path: str) -> str:
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x01
    open(path, "wb").write(bytes(data))
    return data.decode(errors="replace")


def _tamper(case: str, cache: str, outside: str) -> str | None:
    """Tamper with the copy ``cache``; return the bytes GE must never read (None: nothing specific)."""
    om = _om(cache)
    files = _files_dir(cache)
    if case == "flipped":
        return _flip(om)
    if case == "extra":
        with open(os.path.join(files, "ge_cache", "planted.om"), "w") as f:
            f.write("planted")
        return None
    if case == "missing":
        os.remove(om)
        return None
    if case == "symlink":
        target = os.path.join(outside, "evil.om")
        shutil.copy(om, target)
        evil = _flip(target)
        os.remove(om)
        os.symlink(target, om)
        return evil
    if case == "foreign":
        evil = _flip(om)
        os.chown(om, 65534, 65534)
        return evil
    seal_path = os.path.join(files, "ge_cache.seal.json")
    if case == "unsealed":
        if os.path.exists(seal_path):
            os.remove(seal_path)
        return _flip(om)
    if case == "seal_altered":  # the seal re-made for a tampered model, its digest left as it was
        evil = _flip(om)
        import hashlib

        if not os.path.exists(seal_path):
            return evil
        seal = _seal(cache)
        data = open(om, "rb").read()
        seal["files"][OM] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        with open(seal_path, "w") as f:
            json.dump(seal, f, sort_keys=True, separators=(",", ":"))
        return evil
    raise AssertionError(case)


CASES = ("flipped", "extra", "missing", "symlink", "foreign", "unsealed", "seal_altered")


@pytest.fixture(scope="module")
def tampered(built) -> dict:
    """A fresh warm process over a clean copy and one tampered copy per case, then another."""
    root = built["root"]
    outside = os.path.join(root, "outside")
    os.makedirs(outside)
    caches, evil = {}, {}
    for case in ("clean", *CASES):
        if case == "foreign" and os.geteuid() != 0:
            continue  # only root can hand a file to another user
        caches[case] = os.path.join(root, case)
        shutil.copytree(built["cache"], caches[case], symlinks=True)
        if case != "clean":
            evil[case] = _tamper(case, caches[case], outside)
    warm = _run(list(caches.values()))
    again = _run(list(caches.values()))
    return {"caches": caches, "evil": evil, "warm": warm, "again": again}


def test_warm_process_hands_ge_the_verified_model(built, tampered):
    clean = tampered["caches"]["clean"]
    warm = tampered["warm"][clean]
    assert (warm["hits"], warm["misses"], warm["runtime_caches_set_aside"]) == (1, 0, 0), warm
    assert warm["reads"] == [built["model"]]  # GE loaded the cached model, verified
    assert _seal(clean) == _seal(built["cache"])


@pytest.mark.parametrize("case", CASES)
def test_tampered_run_time_cache_is_never_handed_to_ge(case, built, tampered):
    if case not in tampered["caches"]:
        pytest.skip("chown to another user needs root")
    cache, evil = tampered["caches"][case], tampered["evil"][case]
    warm = tampered["warm"][cache]
    # the call succeeded from the entry (a hit), the run-time cache was set aside and GE rebuilt it
    assert warm["shape"] == [2, 4] and (warm["hits"], warm["misses"]) == (1, 0), warm
    assert warm["runtime_caches_set_aside"] == 1, warm
    assert warm["reads"] == [None], warm  # GE read nothing: it compiled into a fresh directory
    assert evil is None or evil not in warm["reads"]
    assert warm["dirs"] == [os.path.join(_files_dir(cache), "ge_cache")]
    (aside,) = glob.glob(os.path.join(cache, "quarantine", "graphs-*-ge_cache-*"))  # kept, never deleted
    assert os.path.lexists(os.path.join(aside, "ge_cache"))
    assert sorted(os.listdir(os.path.join(_files_dir(cache), "ge_cache"))) == [OM]
    # the rebuilt cache was sealed: the next process verifies it and GE reads it
    again = tampered["again"][cache]
    assert (again["runtime_caches_set_aside"], again["hits"]) == (0, 1), again
    assert again["reads"] == [built["model"]], again


def test_bundle_carries_the_sealed_run_time_cache(built, tampered, tmp_path):
    from torchair_cached_backend import bundle

    clean, unsealed = tampered["caches"]["clean"], str(tmp_path / "unsealed")
    shutil.copytree(clean, unsealed, symlinks=True)
    os.remove(os.path.join(_files_dir(unsealed), "ge_cache.seal.json"))
    packed = bundle.pack(clean, str(tmp_path / "b.tar"), key="fleet-secret")  # signed: the seal's sha256 too
    left_out = bundle.pack(unsealed, str(tmp_path / "u.tar"))
    assert packed["runtime_caches"] == 1 and not packed["runtime_caches_left_out"], packed
    assert left_out["runtime_caches"] == 0 and "ge_cache: not sealed" in left_out["runtime_caches_left_out"][0]
    assert bundle.verify(str(tmp_path / "b.tar"), key="fleet-secret")["signature"] == "verified"
    target, target_u = str(tmp_path / "unpacked"), str(tmp_path / "unpacked_u")
    bundle.unpack(str(tmp_path / "b.tar"), target, key="fleet-secret")
    bundle.unpack(str(tmp_path / "u.tar"), target_u)
    assert _seal(target) == _seal(clean)
    assert not os.path.exists(os.path.join(_files_dir(target_u), "ge_cache"))
    res = _run([target, target_u])
    assert res[target]["reads"] == [built["model"]] and res[target]["runtime_caches_set_aside"] == 0, res
    assert res[target_u]["reads"] == [None] and res[target_u]["hits"] == 1, res


def test_remote_carries_the_sealed_run_time_cache(redis_server, tmp_path):
    url = redis_server.url(db=40)
    node_a, node_b = str(tmp_path / "a"), str(tmp_path / "b")
    (a,) = _run([node_a], REMOTE=url).values()
    assert a["misses"] == 1 and a["reads"] == [None], a
    (b,) = _run([node_b], REMOTE=url).values()
    # node b fetched the entry and its sealed GE cache: GE loaded the model node a's GE compiled
    assert b["remote_hits"] >= 1 and (b["misses"], b["runtime_caches_set_aside"]) == (0, 0), b
    assert b["reads"] == [open(_om(node_a)).read()], b
    assert _seal(node_b) == _seal(node_a)
