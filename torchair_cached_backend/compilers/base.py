"""The narrow protocol every inner compiler implements: hash, compile, load.

The backend never looks inside an artifact; it only stores the files and the
JSON metadata an inner compiler hands it, and gives them back on a hit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # keep torch.fx out of import time
    import torch

    from ..options import BackendOptions


@dataclasses.dataclass
class Artifact:
    """What an inner compiler stores for one graph.

    ``files`` are opaque blobs (name -> bytes), checksummed by the store.
    ``meta`` must be JSON-serializable; it is written into the manifest.
    """

    files: dict[str, bytes]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: set by the store on load: the directory holding ``files`` on disk, already
    #: verified against their checksums (a compiler may dlopen/exec them in place)
    root: str | None = None


@dataclasses.dataclass
class CompileResult:
    """``fn`` serves the cold process; ``artifact`` is what a warm process loads.

    ``artifact`` is None when the graph cannot be cached (e.g. it needs autograd);
    ``reason`` then says why, for the log.
    """

    fn: Callable[..., Any]
    artifact: Artifact | None
    reason: str = ""


class InnerCompiler(Protocol):
    """One inner compiler (inductor, eager, torchair)."""

    #: stable name used in keys, manifests and the ``compiler`` option
    name: str

    def hash_factors(self, options: BackendOptions) -> dict[str, Any]:
        """JSON-able description of everything *besides the graph and its inputs*
        that changes this compiler's output (its version, config, options)."""
        ...

    def compile(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
        options: BackendOptions,
    ) -> CompileResult:
        """Compile ``gm`` (a Dynamo graph) and return a callable plus its artifact."""
        ...

    def load(self, artifact: Artifact, options: BackendOptions) -> Callable[..., Any]:
        """Rebuild the callable from a stored artifact, without compiling.

        The callable takes the graph's flat inputs (as Dynamo passes them) and
        returns what the graph returns (a tuple or list).
        """
        ...
