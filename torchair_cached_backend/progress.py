"""Progress of long cache work (prebuild): a bar on a terminal, log lines elsewhere.

The bar is tqdm's when tqdm is installed (it comes with transformers and
huggingface_hub), else one redrawn line. Never imported on the warm path.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from .logs import log


class Progress:
    """``<what> i of n, elapsed`` for ``total`` steps; ``step(note)`` after each one."""

    def __init__(self, total: int, what: str, *, stream: TextIO | None = None, bar: bool | None = None) -> None:
        self.total = total
        self.what = what
        self.done = 0
        self.t0 = time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr
        if bar is None:
            bar = bool(getattr(self.stream, "isatty", lambda: False)())
        self._tqdm: Any = None
        self._bar = bar
        if bar:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._tqdm = tqdm(total=total, desc=what, unit="input", file=self.stream, leave=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def step(self, note: str = "") -> None:
        self.done += 1
        line = f"{self.what} {self.done} of {self.total}, {self.elapsed:.1f}s elapsed" + (f", {note}" if note else "")
        log.info("%s", line)
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(note, refresh=False)
            self._tqdm.update(1)
        elif self._bar:
            width = 24
            filled = width * self.done // max(self.total, 1)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {line}")
            self.stream.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._bar:
            self.stream.write("\n")
            self.stream.flush()
