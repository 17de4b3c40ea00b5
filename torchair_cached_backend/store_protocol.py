"""The storage-backend protocol under :class:`~torchair_cached_backend.store.Store` (what a
remote tier implements; ``store_backend.LocalDir`` is the local one). Apart from
``store_backend`` because building a ``Protocol`` class costs a warm start ~50 us and a
warm load only needs the local directory."""

from __future__ import annotations

from typing import Any, Protocol

from .store_layout import Entry


class StorageBackend(Protocol):
    """Entries of one cache root by (kind, key). A remote tier implements this."""

    root: str

    def writable(self) -> bool:
        """Whether publish/remove may be attempted (found without writing)."""
        ...

    def read(self, kind: str, key: str) -> Entry | None:
        """The verified entry, None if absent. BrokenEntry (with ``identity``) if it
        fails a check, OSError for a fault, CacheSecurityError for a foreign object."""
        ...

    def read_manifest(self, kind: str, key: str) -> dict[str, Any] | None:
        """The parsed, schema-checked manifest only (no blob read)."""
        ...

    def publish(self, kind: str, key: str, files: dict[str, bytes], manifest: dict[str, Any], *,
                replace: bool = False) -> bool:
        """Publish atomically. Without ``replace`` an existing entry wins (True if one
        is there). With ``replace`` the old entry is swapped out only after the new
        one is complete. Raises OSError for a fault (nothing published)."""
        ...

    def keys(self, kind: str) -> list[str]:
        ...

    def remove(self, kind: str, key: str) -> bool:
        """Unpublish then delete; False if absent."""
        ...
