"""The on-disk store: atomic entries, checksums, quarantine, ownership and symlink refusal."""

from __future__ import annotations

import json
import os
import stat

import pytest

from torchair_cached_backend.fs_security import CacheSecurityError
from torchair_cached_backend.store import Store


def _entry(tmp_path):
    store = Store(str(tmp_path / "c"), "graphs")
    store.save("k1", {"a.bin": b"hello" * 100, "b.txt": b"text"}, {"factors": {"x": 1}})
    return store


def test_roundtrip_modes_and_manifest(tmp_path):
    store = _entry(tmp_path)
    entry = store.load("k1")
    assert entry.files["a.bin"] == b"hello" * 100
    m = entry.manifest
    assert m["files"]["a.bin"]["size"] == 500 and len(m["files"]["a.bin"]["sha256"]) == 64
    assert m["factors"] == {"x": 1} and m["created"] <= m["last_used"]
    path = store.entry_path("k1")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(path, "files", "a.bin")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.join(path, "manifest.json")).st_mode) == 0o600
    assert os.path.exists(os.path.join(store.root, "CACHEDIR.TAG"))
    assert not [n for n in os.listdir(store.dir) if n.startswith(".tmp")]


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete", "manifest"])
def test_damaged_entry_is_quarantined_not_returned(tmp_path, damage, caplog):
    store = _entry(tmp_path)
    blob = os.path.join(store.entry_path("k1"), "files", "a.bin")
    if damage == "corrupt":
        data = bytearray(open(blob, "rb").read())
        data[10] ^= 0xFF
        open(blob, "wb").write(bytes(data))
    elif damage == "truncate":
        open(blob, "r+b").truncate(7)
    elif damage == "delete":
        os.remove(blob)
    else:
        open(os.path.join(store.entry_path("k1"), "manifest.json"), "w").write("{not json")
    with caplog.at_level("WARNING", logger="torchair_cached_backend"):
        assert store.load("k1") is None
    assert "broken" in caplog.text
    assert not os.path.exists(store.entry_path("k1"))
    quarantined = os.listdir(os.path.join(store.root, "quarantine"))
    assert len(quarantined) == 1 and quarantined[0].startswith("graphs-k1")
    store.save("k1", {"a.bin": b"new"}, {})  # rebuilt in place
    assert store.load("k1").files["a.bin"] == b"new"


def test_existing_entry_is_kept_by_a_racing_writer(tmp_path):
    store = _entry(tmp_path)
    store.save("k1", {"a.bin": b"other"}, {})
    assert store.load("k1").files["a.bin"] == b"hello" * 100


def test_foreign_owned_cache_dir_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a directory to another user")
    root = tmp_path / "c"
    root.mkdir()
    os.chown(root, 12345, 12345)
    with pytest.raises(CacheSecurityError, match="owned by uid 12345"):
        Store(str(root), "graphs").load("k1")


def test_symlink_inside_cache_is_refused(tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, root / "graphs")
    with pytest.raises(CacheSecurityError, match="symlink"):
        Store(str(root), "graphs").load("k1")


def test_symlinked_blob_is_refused(tmp_path):
    store = _entry(tmp_path)
    blob = os.path.join(store.entry_path("k1"), "files", "a.bin")
    target = tmp_path / "payload"
    target.write_bytes(b"hello" * 100)
    os.remove(blob)
    os.symlink(target, blob)
    with pytest.raises(CacheSecurityError, match="not a regular file"):
        store.load("k1")


def test_symlink_above_root_is_fine(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    store = Store(str(tmp_path / "link" / "c"), "graphs")
    store.save("k", {"f": b"x"}, {})
    assert store.load("k").files["f"] == b"x"
    assert json.loads(open(os.path.join(store.entry_path("k"), "manifest.json")).read())["key"] == "k"
