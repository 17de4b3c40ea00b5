"""The on-disk store: atomic entries, checksums, quarantine, ownership and symlink refusal,
paths derived by our code (never a manifest's), readers racing writers, and storage faults
that are misses / no-ops instead of errors (real read-only and full filesystems: test_faults.py)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
from subprocess_helpers import REPO

from torchair_cached_backend import fs_security as fs
from torchair_cached_backend import reset_stats, stats
from torchair_cached_backend.fs_security import CacheSecurityError
from torchair_cached_backend.store import BrokenEntry, Store


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


def _set_aside_and_rebuilt(store, key, caplog, match):
    """A planted entry: never read, reported (naming what is wrong), moved to quarantine/, and the key
    free for the rebuild; the user's call is served (it is a miss), never failed."""
    with caplog.at_level("WARNING", logger="torchair_cached_backend"):
        assert store.load(key) is None
    assert match in caplog.text and "planted" in caplog.text, caplog.text
    assert os.listdir(os.path.join(store.root, "quarantine"))
    assert store.save(key, {"a.bin": b"rebuilt"}, {}) is not None
    assert store.load(key).files == {"a.bin": b"rebuilt"}


def test_symlinked_blob_is_never_read_and_set_aside(tmp_path, caplog):
    store = _entry(tmp_path)
    blob = os.path.join(store.entry_path("k1"), "files", "a.bin")
    target = tmp_path / "payload"
    target.write_bytes(b"hello" * 100)
    os.remove(blob)
    os.symlink(target, blob)
    _set_aside_and_rebuilt(store, "k1", caplog, "not a regular file")
    assert target.read_bytes() == b"hello" * 100  # what the link pointed at is left alone


@pytest.mark.parametrize("where", ["manifest.json", "files/a.bin"])
@pytest.mark.parametrize("what", ["fifo", "directory"])
def test_a_fifo_or_directory_where_a_file_belongs_never_hangs_and_is_set_aside(tmp_path, caplog, where, what):
    # a FIFO held open() until a writer came: the user's start hung for ever (found by a probe)
    store = _entry(tmp_path)
    path = os.path.join(store.entry_path("k1"), where)
    os.remove(path)
    os.mkfifo(path) if what == "fifo" else os.mkdir(path)
    _set_aside_and_rebuilt(store, "k1", caplog, "not a regular file")


def test_an_entry_of_another_user_is_set_aside(tmp_path, caplog):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a file to another user")
    store = _entry(tmp_path)
    os.chown(os.path.join(store.entry_path("k1"), "files", "a.bin"), 12345, 12345)
    _set_aside_and_rebuilt(store, "k1", caplog, "owned by uid 12345")


def test_symlink_above_root_is_fine(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    store = Store(str(tmp_path / "link" / "c"), "graphs")
    store.save("k", {"f": b"x"}, {})
    assert store.load("k").files["f"] == b"x"
    assert json.loads(open(os.path.join(store.entry_path("k"), "manifest.json")).read())["key"] == "k"


# ---------------------------------------------------------------------------
# paths come from our code, never from a manifest
# ---------------------------------------------------------------------------


def _rewrite_manifest(store, key, change):
    path = os.path.join(store.entry_path(key), "manifest.json")
    manifest = json.loads(open(path).read())
    change(manifest)
    open(path, "w").write(json.dumps(manifest))


def test_blob_name_escaping_the_entry_is_never_read(tmp_path, caplog):
    store = _entry(tmp_path)
    outside = tmp_path / "outside-secret"
    outside.write_bytes(b"secret")
    # ../../../../<tmp>/outside-secret from files/, with a matching size and checksum
    rel = os.path.relpath(outside, os.path.join(store.entry_path("k1"), "files"))
    assert rel.startswith("../")
    sha = hashlib.sha256(b"secret").hexdigest()
    _rewrite_manifest(store, "k1", lambda m: m["files"].update({rel: {"size": 6, "sha256": sha}}))
    with caplog.at_level("WARNING", logger="torchair_cached_backend"):
        assert store.load("k1") is None
    assert "not a plain file name" in caplog.text
    assert os.listdir(os.path.join(store.root, "quarantine"))


@pytest.mark.parametrize("name", ["/etc/hostname", ".hidden", "a/b", "..", ""])
def test_save_refuses_blob_names_that_are_not_plain(tmp_path, name):
    with pytest.raises(ValueError, match="invalid blob name"):
        Store(str(tmp_path / "c"), "graphs").save("k", {name: b"x"}, {})


def test_symlinked_files_dir_is_never_read_and_set_aside(tmp_path, caplog):
    store = _entry(tmp_path)
    files = os.path.join(store.entry_path("k1"), "files")
    copy = tmp_path / "planted"
    shutil.copytree(files, copy)  # same bytes, same checksums: only the symlink is wrong
    shutil.rmtree(files)
    os.symlink(copy, files)
    _set_aside_and_rebuilt(store, "k1", caplog, "symlink")


def test_symlinked_entry_dir_is_never_read_and_set_aside(tmp_path, caplog):
    store = _entry(tmp_path)
    real = tmp_path / "real-entry"
    os.rename(store.entry_path("k1"), real)
    os.symlink(real, store.entry_path("k1"))
    _set_aside_and_rebuilt(store, "k1", caplog, "symlink")
    assert os.path.isdir(real / "files")  # the link's target is left alone


def test_path_of_serves_only_checksummed_files(tmp_path):
    store = _entry(tmp_path)
    entry = store.load("k1")
    assert open(entry.path_of("a.bin"), "rb").read() == b"hello" * 100
    open(os.path.join(entry.files_dir, "extra.so"), "wb").write(b"not in the manifest")
    for name in ("extra.so", "/usr/lib/libc.so.6", "../manifest.json"):
        with pytest.raises(BrokenEntry, match="no checksummed file"):
            entry.path_of(name)


# ---------------------------------------------------------------------------
# a reader racing a writer that replaces the entry
# ---------------------------------------------------------------------------

REPLACER = textwrap.dedent(
    """
    import sys, time
    from torchair_cached_backend.store import Store
    store = Store(sys.argv[1], "programs")
    deadline = time.time() + float(sys.argv[2])
    i = 0
    while time.time() < deadline:
        i += 1
        blob = bytes([i % 251]) * (8 << 20)
        store.replace("k", {"a.bin": blob, "b.bin": str(i).encode()}, {"generation": i})
    print(i)
    """
)


def test_reader_never_quarantines_an_entry_replaced_under_it(tmp_path):
    store = Store(str(tmp_path / "c"), "programs")
    store.save("k", {"a.bin": bytes([0]) * (8 << 20), "b.bin": b"0"}, {"generation": 0})
    writer = subprocess.Popen([sys.executable, "-c", REPLACER, store.root, "4"], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=REPO))
    loads = misses = 0
    while writer.poll() is None:
        entry = store.load("k")
        if entry is None:
            misses += 1  # between the old entry's unpublish and the new one's publish
            continue
        loads += 1
        generation = entry.manifest["generation"]
        assert entry.files["b.bin"] == str(generation).encode()  # one entry's blobs, never a mix
        assert entry.files["a.bin"][:1] == bytes([generation % 251])
    replaced = int(writer.communicate()[0])
    assert writer.returncode == 0 and replaced > 5 and loads > 5, (replaced, loads, misses)
    assert not os.path.exists(os.path.join(store.root, "quarantine")), os.listdir(os.path.join(store.root, "quarantine"))


# ---------------------------------------------------------------------------
# storage faults are misses and no-ops, never errors
# ---------------------------------------------------------------------------


@pytest.fixture
def fresh_stats():
    from torchair_cached_backend import logs
    from torchair_cached_backend import store as store_mod

    reset_stats()
    logs._once.clear()
    store_mod._UNWRITABLE.clear()
    yield
    store_mod._UNWRITABLE.clear()


def _raise_on(monkeypatch, target, name, code, *, calls=1):
    real = getattr(target, name)
    state = {"left": calls}

    def failing(*args, **kwargs):
        if state["left"]:
            state["left"] -= 1
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_write_fault_publishes_nothing_and_warns_once(tmp_path, monkeypatch, caplog, fresh_stats, code):
    store = Store(str(tmp_path / "c"), "graphs")
    _raise_on(monkeypatch, fs, "write_at", code, calls=2)
    with caplog.at_level("WARNING", logger="torchair_cached_backend"):
        assert store.save("k", {"a": b"x", "b": b"y"}, {}) is None
        assert store.save("k2", {"a": b"x"}, {}) is None
    assert stats().storage_faults == 2
    assert len(caplog.records) == 1, caplog.text  # one warning per cause
    assert ("I/O error" if code == errno.EIO else "is full") in caplog.text
    assert store.keys() == [] and not [n for n in os.listdir(store.dir) if n.startswith(".tmp")]
    assert store.save("k", {"a": b"x"}, {}) is not None  # the fault passed: caching resumes


def test_read_fault_is_a_miss_not_a_broken_entry(tmp_path, monkeypatch, caplog, fresh_stats):
    store = _entry(tmp_path)
    _raise_on(monkeypatch, fs, "read_at", errno.EIO)
    with caplog.at_level("WARNING", logger="torchair_cached_backend"):
        assert store.load("k1") is None
    assert "I/O error" in caplog.text and stats().storage_faults == 1
    assert not os.path.exists(os.path.join(store.root, "quarantine"))  # an I/O error proves nothing broken
    assert store.load("k1").files["b.txt"] == b"text"


def test_vanished_cache_dir_is_recreated(tmp_path, monkeypatch, fresh_stats):
    store = _entry(tmp_path)
    shutil.rmtree(store.root)  # a cleanup job between two compiles
    assert store.load("k1") is None
    assert store.save("k2", {"a": b"x"}, {}) is not None
    real = fs.write_at

    def vanish_once(dir_fd, name, data):  # and one that strikes in the middle of a save
        if not getattr(vanish_once, "done", False):
            vanish_once.done = True
            shutil.rmtree(store.root)
        return real(dir_fd, name, data)

    monkeypatch.setattr(fs, "write_at", vanish_once)
    assert store.save("k3", {"a": b"y"}, {}) is not None
    assert store.load("k3").files["a"] == b"y" and stats().storage_faults == 0


def test_lock_that_cannot_be_created_degrades_to_no_lock(tmp_path, monkeypatch, caplog, fresh_stats):
    from torchair_cached_backend import store_locks

    store = _entry(tmp_path)
    _raise_on(monkeypatch, store_locks, "_open_lock_file", errno.EACCES)
    with caplog.at_level("WARNING", logger="torchair_cached_backend"):
        with store.lock("k9"):
            ran = True
    assert ran and stats().storage_faults == 1 and "not coordinated" in caplog.text


def test_an_error_inside_the_locked_block_propagates(tmp_path):
    store = _entry(tmp_path)
    with pytest.raises(ZeroDivisionError), store.lock("k1"):
        raise ZeroDivisionError("from the caller")


@pytest.mark.parametrize("what", ["fifo", "another user's file"])
def test_a_planted_lock_file_never_fails_or_hangs_a_compile(tmp_path, caplog, what):
    # a FIFO or another user's file where a key's lock file belongs raised CacheSecurityError out of
    # the compile (the user's cold call); it is now compiled without the cross-process lock, warned, saved
    if what != "fifo" and os.geteuid() != 0:
        pytest.skip("needs root to chown a file to another user")
    store = Store(str(tmp_path / "c"), "graphs")
    store.prepare()
    path = store._lock_path("k1")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if what == "fifo":
        os.mkfifo(path)
    else:
        open(path, "w").close()
        os.chown(path, 12345, 12345)
    with caplog.at_level("WARNING", logger="torchair_cached_backend"):
        with store.lock("k1", timeout=5):
            assert store.save("k1", {"a.bin": b"x"}, {}) is not None
    assert "planted" in caplog.text and "without the cross-process lock" in caplog.text, caplog.text
    assert store.load("k1").files == {"a.bin": b"x"}


@pytest.mark.parametrize("where,mode", [("files/a.bin", 0o666), ("manifest.json", 0o620), ("", 0o777), ("files", 0o770)])
def test_an_entry_others_may_write_is_never_read_and_set_aside(tmp_path, caplog, where, mode):
    # an entry file or directory writable by group/others (the root itself private): another user could
    # rewrite a blob and, the manifest being writable too, its checksum, and the bytes ran (probe round 9)
    store = _entry(tmp_path)
    os.chmod(os.path.join(store.entry_path("k1"), where) if where else store.entry_path("k1"), mode)
    _set_aside_and_rebuilt(store, "k1", caplog, "writable by")
