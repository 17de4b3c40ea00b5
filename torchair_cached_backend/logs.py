"""The package logger, and a warn-once helper so repeated graphs don't flood logs."""

from __future__ import annotations

import logging
import threading

# No NullHandler on purpose: with logging unconfigured, WARNINGs (a broken entry
# set aside, an uncached graph) still reach stderr through logging's last
# resort, while INFO hit/miss lines stay quiet until the user asks for them.
log = logging.getLogger("torchair_cached_backend")

_once: set[str] = set()
_once_lock = threading.Lock()


def warn_once(key: str, msg: str, *args: object) -> None:
    with _once_lock:
        if key in _once:
            return
        _once.add(key)
    log.warning(msg, *args)
