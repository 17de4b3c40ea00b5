"""Layered stores: a read-only base -> the local writable cache -> a remote.

A hit in any layer serves: a local miss asks the base (a cache baked into an
image), then the remote; what either returns is verified, written into the local
cache and loaded from there as any local entry (if the local cache cannot be
written, a base entry is served in place). New compiles are published to the
local cache and then to the remote; the base is never written.

Layers belong to a cache root: options ``base_dir`` / ``remote`` (or
``$TORCHAIR_CACHE_REMOTE``) attach them to the roots an options object uses
(``cache_dir`` and ``graph_dir``), for the whole process. The :class:`Store`
facade calls three hooks: :func:`fill` after a local miss, :func:`published`
after a local publish, :func:`fleet_lock` inside its per-key lock. With no layer
configured each costs a dict lookup and an environment read.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .logs import log
from .stats import record

if TYPE_CHECKING:
    from .remote import RedisRemote
    from .store import Store
    from .store_layout import Entry


class Layers:
    """The layers of one cache root."""

    __slots__ = ("base_dir", "remote_url", "namespace")

    def __init__(self, base_dir: str | None, remote_url: str | None, namespace: str = "") -> None:
        self.base_dir = base_dir
        self.remote_url = remote_url
        #: separates programs of other ranks on the remote (cache_compile keeps programs per rank)
        self.namespace = namespace

    def remote(self) -> RedisRemote | None:
        if not self.remote_url:
            return None
        from .remote import remote_for

        return remote_for(self.remote_url)

    def __repr__(self) -> str:
        return f"Layers(base_dir={self.base_dir!r}, remote={self.remote_url is not None}, namespace={self.namespace!r})"


_BY_ROOT: dict[str, Layers] = {}
_state = threading.local()


def configure(root: str, *, base_dir: str | None = None, remote: str | None = None, namespace: str = "") -> None:
    """Attach layers to the cache root ``root`` for this process."""
    root = os.path.abspath(root)
    if base_dir is not None and os.path.abspath(base_dir) == root:
        base_dir = None  # a root is not its own base
    _BY_ROOT[root] = Layers(base_dir, remote, namespace)


def configure_from_options(options: Any) -> None:
    """Attach an options object's ``base_dir`` / ``remote`` to the roots it uses."""
    remote = getattr(options, "remote", None)
    base = getattr(options, "base_dir", None)
    if remote is None and base is None:
        return
    ranks = [getattr(options, n, None) for n in ("global_rank", "tp_rank", "pp_rank")]
    namespace = "" if all(r is None for r in ranks) else "r" + "-".join("x" if r is None else str(r) for r in ranks) + ":"
    configure(options.cache_dir, base_dir=base, remote=remote, namespace=namespace)
    if options.graph_dir:
        configure(options.graph_dir, base_dir=base, remote=remote)


def layers_of(root: str) -> Layers | None:
    found = _BY_ROOT.get(root)
    if found is not None:
        return found
    url = os.environ.get("TORCHAIR_CACHE_REMOTE")
    return Layers(None, url) if url else None


def _remote_key(layers: Layers, kind: str, key: str) -> str:
    return f"{layers.namespace}{key}" if kind == "programs" else key


@contextlib.contextmanager
def _filling() -> Iterator[None]:
    """While an entry fetched from a layer is written locally: not republished."""
    _state.filling = True
    try:
        yield
    finally:
        _state.filling = False


def fill(store: Store, key: str) -> Entry | None:
    """After a local miss: the entry from the base, else from the remote, written into the
    local cache and read back from it (verified, as any local entry). None: no layer has it."""
    layers = layers_of(store.root)
    if layers is None:
        return None
    if layers.base_dir:
        entry = _from_base(store, layers.base_dir, key)
        if entry is not None:
            return entry
    remote = layers.remote()
    if remote is None:
        return None
    got = remote.get(store.kind, _remote_key(layers, store.kind, key))
    if got is None:
        return None
    manifest, files = got
    entry = _write_local(store, key, files, manifest)
    if entry is not None and store.kind == "graphs" and entry.manifest.get("compiler") == "torchair":
        _fill_runtime(remote, store.kind, _remote_key(layers, store.kind, key), entry.files_dir)
    if entry is not None:
        record(remote_hits=1)
        log.info("npu_cached: %s/%s fetched from the remote cache (%d bytes)", store.kind, key[:12],
                 sum(len(v) for v in files.values()))
    return entry


def _fill_runtime(remote: RedisRemote, kind: str, rkey: str, files_dir: str) -> None:
    """The graph's sealed run-time caches (GE's compiled model...) from the remote, verified
    against their seals, into the entry just fetched (an entry without them is complete:
    GE rebuilds them)."""
    from . import runtime_cache

    for subdir, (seal_raw, data) in remote.get_runtime(kind, rkey, runtime_cache.SUBDIRS).items():
        runtime_cache.install(files_dir, subdir, seal_raw, data)


def _from_base(store: Store, base_dir: str, key: str) -> Entry | None:
    from .store import BrokenEntry, Store

    base = Store(base_dir, store.kind)
    try:
        entry = base.read_verified(key)  # never writes: no touch, no quarantine
    except BrokenEntry as exc:
        log.warning("npu_cached: base cache entry %s/%s is broken (%s); skipped", store.kind, key[:12], exc)
        return None
    except Exception as exc:  # noqa: BLE001 - a base we cannot read is a miss
        log.warning("npu_cached: base cache %s is not readable (%s); skipped", base_dir, exc)
        return None
    if entry is None:
        return None
    record(base_hits=1)
    fields = {k: v for k, v in entry.manifest.items() if k not in ("key", "kind", "files", "created", "last_used")}
    local = _write_local(store, key, entry.files, fields)
    if local is not None and store.kind == "graphs" and entry.manifest.get("compiler") == "torchair":
        # the base's sealed GE caches come along, verified
        from . import runtime_cache

        carried, notes = runtime_cache.collect(entry.files_dir)
        for note in notes:
            log.info("npu_cached: base cache entry %s/%s: run-time cache %s", store.kind, key[:12], note)
        for subdir, (seal_raw, data) in carried.items():
            runtime_cache.install(local.files_dir, subdir, seal_raw, data)
    return local if local is not None else entry  # a read-only local cache: served from the base in place


def _write_local(store: Store, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> Entry | None:
    with _filling():
        if store.save(key, files, manifest) is None:
            return None
    return store.load_local(key)


def published(store: Store, key: str, files: dict[str, bytes], manifest: dict[str, Any], *, replace: bool) -> None:
    """After a local publish: the same entry to the remote (programs merged there)."""
    if getattr(_state, "filling", False):
        return
    layers = layers_of(store.root)
    remote = layers.remote() if layers is not None else None
    if remote is None:
        return
    rkey = _remote_key(layers, store.kind, key)
    if store.kind == "programs":
        remote.merge(store.kind, rkey, files, manifest, merge_program_manifests)
    else:
        remote.put(store.kind, rkey, files, manifest)


def merge_program_manifests(
    old: dict[str, Any] | None, old_files: dict[str, bytes], new: dict[str, Any], new_files: dict[str, bytes]
) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Program entries merged as the bypass merges them locally (no variant is lost)."""
    from .bypass.program import merge_programs

    program, files = merge_programs((old or {}).get("program"), old_files, new.get("program") or {}, new_files)
    return dict(new, program=program), files


@contextlib.contextmanager
def fleet_lock(store: Store, key: str, wait: float) -> Iterator[None]:
    """Inside the local per-key lock: the remote's compile lock of a graph, so one node of the
    fleet compiles it while the others wait (bounded) and then load its result."""
    layers = layers_of(store.root)
    remote = layers.remote() if layers is not None and store.kind == "graphs" else None
    if remote is None:
        yield
        return
    with remote.compile_lock(store.kind, key, wait):
        yield
