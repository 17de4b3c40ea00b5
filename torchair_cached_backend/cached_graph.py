"""The callable Dynamo installs for one graph served by ``npu_cached``: defined in
``graph_load`` (a warm load imports that module, and so no module for this class),
re-exported here for the backend, the capture and the DDP split graph."""

from __future__ import annotations

from .graph_load import CachedGraph

__all__ = ["CachedGraph"]
