"""Find cache entries at any level of a cache tree (for the CLI, prune and bundles).

A *cache root* is a directory holding ``graphs/`` and/or ``programs/``. The
``npu_cached`` backend makes one per ``cache_dir``; ``cache_compile`` makes
``.torchair_cache/<model_info>/[<rank>/]<func>`` (plus ``<model_info>/graphs`` when
ranks share graphs). Any directory of such a tree -- the top, a model, a rank, a
function, a kind dir or one entry -- names the entries below it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from . import fs_security as fs
from .logs import warn_once
from .store import KINDS, LOCKS_DIR, MANIFEST, QUARANTINE_DIR, Store, valid_name

#: how deep below the given directory roots are looked for (the cache_compile layout needs 4)
_MAX_DEPTH = 8


class LookupFailed(LookupError):
    """A key or directory the user named does not resolve; the message says why."""


class Located:
    """One entry: its store, key, and root relative to the directory searched."""

    __slots__ = ("store", "key", "rel_root")

    def __init__(self, store: Store, key: str, rel_root: str) -> None:
        self.store = store
        self.key = key
        self.rel_root = rel_root

    @property
    def path(self) -> str:
        return self.store.entry_path(self.key)

    def __repr__(self) -> str:
        return f"Located({self.store.kind}/{self.key[:16]} in {self.rel_root!r})"


def _is_real_dir(path: str) -> bool:
    try:
        fs.check_dir(path, root=path)
    except (OSError, fs.CacheSecurityError):
        return False
    return True


def is_root(path: str) -> bool:
    return any(_is_real_dir(os.path.join(path, kind)) for kind in KINDS)


def cache_roots(path: str) -> list[str]:
    """Every cache root at or below ``path`` (real directories only, no symlinks followed)."""
    path = os.path.abspath(path)
    found: list[str] = []

    def walk(d: str, depth: int) -> None:
        if is_root(d):
            found.append(d)
        if depth >= _MAX_DEPTH:
            return
        try:
            with os.scandir(d) as it:
                names = sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            return
        for name in names:
            if name in KINDS or name in (LOCKS_DIR, QUARANTINE_DIR) or name.startswith(".tmp-"):
                continue
            walk(os.path.join(d, name), depth + 1)

    if os.path.isdir(path):
        walk(path, 0)
    return found


def find_entries(path: str) -> list[Located]:
    """The entries at or below ``path``, which may be any level of a cache tree
    (including a ``graphs``/``programs`` dir or one entry's directory)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise LookupFailed(f"{path} is not a directory")
    parent, name = os.path.split(path)
    if os.path.isfile(os.path.join(path, MANIFEST)) and os.path.basename(parent) in KINDS:
        store = Store(os.path.dirname(parent), os.path.basename(parent))
        return [Located(store, name, ".")]
    if name in KINDS and not is_root(path):
        return [Located(Store(parent, name), key, ".") for key in Store(parent, name).keys()]
    out: list[Located] = []
    for root in cache_roots(path):
        rel = os.path.relpath(root, path)
        for kind in KINDS:
            if not _is_real_dir(os.path.join(root, kind)):
                continue
            store = Store(root, kind)
            try:
                keys = store.keys()
            except fs.CacheSecurityError as exc:  # one refused root: say so, and go on with the others
                warn_once(f"refused-root:{root}", "torchair-cache: skipped %s: %s", root, exc)
                continue
            out.extend(Located(store, key, rel) for key in keys)
    return out


def iter_files(path: str) -> Iterator[os.DirEntry[str]]:
    """Regular files under ``path``, recursively, never following symlinks."""
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except OSError:
        return
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            yield from iter_files(e.path)
        elif e.is_file(follow_symlinks=False):
            yield e


def disk_size(path: str) -> int:
    """Bytes of the regular files under ``path`` (what pruning frees)."""
    total = 0
    for e in iter_files(path):
        try:
            total += e.stat(follow_symlinks=False).st_size
        except OSError:
            pass
    return total


def resolve_key(entries: list[Located], prefix: str, kind: str | None = "graphs") -> Located:
    """The one entry whose key starts with ``prefix`` (as ``ls`` prints 16 characters)."""
    if not prefix or not valid_name(prefix):
        raise LookupFailed(f"{prefix!r} is not a cache key")
    matches = [e for e in entries if e.key.startswith(prefix) and (kind is None or e.store.kind == kind)]
    distinct = {e.key for e in matches}
    what = f"{kind} entry" if kind else "entry"
    if not matches:
        raise LookupFailed(f"no {what} with a key starting {prefix!r} (see `torchair-cache ls`)")
    if len(distinct) > 1:
        shown = ", ".join(sorted(k[:20] for k in distinct)[:5])
        raise LookupFailed(f"key prefix {prefix!r} is ambiguous: it matches {len(distinct)} {what}s ({shown}); give more characters")
    return matches[0]
