"""What the loads of one cached program share in a process: the layers of a model.

Dynamo compiles a graph-breaking layer's forward once per layer index (``self.layer_idx``
is a constant to it), so the program of ``LlamaAttention.forward`` holds a variant per
layer, and every layer loads that same program to find its own. Without sharing, each
of N layers read, verified, decoded and checked all N variants: O(N^2) work at every
warm start (8 layers: ~12 ms a layer). A :class:`SharedLoad` keeps, for the loads of one
program, the verified entry, the decoded frame code, the root frames' checks (built for
the same function), the loaded graphs (a graph key names one compiled artifact: Dynamo,
too, runs one compiled graph for every layer its guards admit) and which frames are stale;
each layer then only evaluates its own load-time guards. Callees of a shared program share
theirs too (:meth:`SharedLoad.child`): every layer's attention, installed by its layer's replay.

The entry is reused only while its manifest on disk is the one read (same inode, size and
mtime: a writer or a last-used refresh renames a new manifest in), so a program that gains
a variant is read again; what is reused is bytes that were verified when read. Decoded
code and checks are kept by blob name, which is content-derived (a frame's id digests its
code, guards and constants), so a name never stands for two contents.
"""

from __future__ import annotations

import os
from typing import Any

from ..store_layout import MANIFEST


class SharedLoad:
    """The shared parts of one program's loads (see the module docstring)."""

    __slots__ = ("key", "stamp", "entry", "codes", "checks", "graphs", "stale", "children")

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.key = ""
        self.stamp: tuple[int, int, int, int] | None = None
        self.entry: Any = None
        self.codes: dict[str, Any] = {}
        self.checks: dict[tuple[str, int], Any] = {}
        self.graphs: dict[str, Any] = {}
        self.stale: dict[str, list[str]] = {}
        self.children: dict[str, SharedLoad] = {}

    def child(self, name: str) -> SharedLoad:
        """What the loads of the callee ``name`` (``self_attn.forward``) of this program share:
        each layer's replay installs its own attention's, and those load one program too."""
        found = self.children.get(name)
        if found is None:
            found = self.children[name] = SharedLoad()
        return found

    def load(self, store: Any, key: str) -> Any:
        """The verified entry ``key`` of ``store`` (as ``store.load``), read again only if
        its manifest changed since it was read here (then nothing decoded from it is kept)."""
        stamp = _stamp(store, key)
        if stamp is not None and self.entry is not None and self.key == key and self.stamp == stamp:
            return self.entry
        entry = store.load(key)
        self._reset()  # another entry: nothing decoded from the old one stays
        if entry is not None and stamp is not None and _stamp(store, key) == stamp:
            self.key, self.stamp, self.entry = key, stamp, entry
        return entry


def _stamp(store: Any, key: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(os.path.join(store.dir, key, MANIFEST))
    except (OSError, AttributeError, TypeError):
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
