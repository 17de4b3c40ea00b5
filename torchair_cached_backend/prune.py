"""Bound a cache's size: quarantined entries go first, then least recently used ones.

"Used" is the manifest's ``last_used`` (refreshed at most hourly by a hit). An
entry being read (a reader holds a shared flock on it) or compiled (its key's
lock is held) is never removed: pruning takes both locks without waiting and
skips the entry when either is held. Leftovers of writers that died
(``.tmp-*``/``.trash-*``) are swept too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable

from . import fs_security as fs
from . import store_ledger as ledger
from . import store_locks as locks
from .inventory import cache_roots, disk_size, find_entries
from .logs import log, warn_once
from .store import KINDS, QUARANTINE_DIR, BrokenEntry, Store


class PruneReport:
    """What :func:`prune` found and did (sizes in bytes)."""

    __slots__ = ("size_before", "size_after", "removed", "busy", "refused", "max_size")

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.size_before = 0
        self.size_after = 0
        self.removed: list[str] = []  # "graphs/<key>" or "quarantine/<name>"
        self.busy: list[str] = []  # entries skipped because they were being read or compiled
        self.refused: list[str] = []  # entries skipped because they are a symlink or another user's

    def __repr__(self) -> str:
        return (f"PruneReport(max_size={self.max_size}, size_before={self.size_before}, size_after={self.size_after}, "
                f"removed={len(self.removed)}, busy={len(self.busy)})")


def _last_used(located) -> float:
    try:
        manifest = located.store.read_manifest(located.key) or {}
        return float(manifest.get("last_used", manifest.get("created", 0)))
    except (BrokenEntry, OSError, TypeError, ValueError):
        return 0.0  # a broken manifest: first to go


def _lock_files(roots: list[str], live: set[tuple[str, str]], dry_run: bool) -> int:
    """Bytes of the lock files of live entries; lock files whose entry is gone are
    deleted (when nobody holds them) and not counted."""
    total = 0
    for root in roots:
        store = Store(root, KINDS[0])
        try:
            dfd = store.backend.locks_fd(create=False)
        except (OSError, fs.CacheSecurityError):
            continue
        if dfd is None:
            continue
        try:
            for name in os.listdir(dfd):
                if not name.endswith(".lock") or name.startswith(ledger.LEDGER):
                    continue
                if (root, name) in live:
                    with contextlib.suppress(OSError):
                        total += os.stat(name, dir_fd=dfd, follow_symlinks=False).st_size
                    continue
                if dry_run:
                    continue
                held = locks.try_acquire(dfd, name)
                if isinstance(held, locks.KeyLock):
                    held.unlink()
                    held.release()
        finally:
            os.close(dfd)
    return total


def prune(path: str, max_size: int, *, dry_run: bool = False, keep: Iterable[str] = (),
          stale_tmp_age_s: float = 3600.0) -> PruneReport:
    """Delete entries under ``path`` (any level of a cache tree) until it holds at
    most ``max_size`` bytes; ``keep`` names keys never removed (the one just stored)."""
    report = PruneReport(max_size)
    keep = set(keep)
    entries = find_entries(path)
    roots = sorted({e.store.root for e in entries} | set(cache_roots(path)))
    if not dry_run:
        for store in {(e.store.root, e.store.kind): e.store for e in entries}.values():
            store.sweep(stale_tmp_age_s)
    quarantined = []
    for root in roots:
        qdir = os.path.join(root, QUARANTINE_DIR)
        try:
            names = os.listdir(qdir)
        except OSError:
            continue
        for name in names:
            item = os.path.join(qdir, name)
            try:
                mtime = os.lstat(item).st_mtime
            except OSError:
                continue
            quarantined.append((mtime, item, disk_size(item) if os.path.isdir(item) else os.lstat(item).st_size))
    sized = [(_last_used(e), e, disk_size(e.path)) for e in entries]
    live = {(e.store.root, f"{e.store.kind}-{e.key[:32]}.lock") for e in entries}
    total = sum(s for _, _, s in sized) + sum(s for _, _, s in quarantined)
    total += _lock_files(roots, live, dry_run)
    report.size_before = total
    for _, item, size in sorted(quarantined, key=lambda q: q[0]):
        if total <= max_size:
            break
        if not dry_run:
            if os.path.isdir(item):
                shutil.rmtree(item, ignore_errors=True)
            else:
                os.remove(item)
        total -= size
        report.removed.append(f"{QUARANTINE_DIR}/{os.path.basename(item)}")
    for _, located, size in sorted(sized, key=lambda s: s[0]):
        if total <= max_size:
            break
        if located.key in keep:
            continue
        name = f"{located.store.kind}/{located.key}"
        try:
            removed = dry_run or located.store.remove_if_idle(located.key)
        except fs.CacheSecurityError as exc:  # one foreign or planted entry: report it, skip it, go on
            report.refused.append(name)
            warn_once(f"prune-refused:{located.path}", "npu_cached: prune skipped %s: %s", located.path, exc)
            continue
        if removed:
            total -= size
            report.removed.append(name)
        else:
            report.busy.append(name)
    report.size_after = total
    if report.removed and not dry_run:
        log.info("npu_cached: pruned %d entries under %s (%d -> %d bytes, max %d)", len(report.removed), path,
                 report.size_before, report.size_after, max_size)
    return report


# ---------------------------------------------------------------------------
# max_size after each store: a size ledger instead of a scan per graph
# ---------------------------------------------------------------------------


def bound(store: Store, max_size: int, just_stored: str) -> PruneReport | None:
    """Apply ``max_size`` after ``just_stored`` was saved, at a cost independent of the
    cache's size: every publish adds its bytes to the root's size ledger
    (``store_ledger``), and the cache is scanned and pruned only when the ledger says it
    is over ``max_size`` or is due for a re-count. Returns the prune report, or None
    when no scan was needed."""
    total = ledger.total_if_fresh(store.backend)
    if total is not None and total <= max_size:
        return None
    report = prune(store.root, max_size, keep=(just_stored,))
    ledger.reset(store.backend, report.size_after)
    return report
