"""The narrow protocol every inner compiler implements: hash, compile, load.

The backend never looks inside an artifact; it only stores the files and the
JSON metadata an inner compiler hands it, and gives them back on a hit. What a warm
load needs of it, :class:`Artifact`, lives in the ``compilers`` package (re-exported
here): a warm start never imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from . import Artifact  # noqa: F401  (re-exported: the compilers' artifact, defined with the warm side)

if TYPE_CHECKING:  # keep torch.fx out of import time
    import torch

    from ..options import BackendOptions


# A plain slotted class, not a dataclass: a @dataclass costs ~0.5 ms at import.
class CompileResult:
    """``fn`` serves the cold process; ``artifact`` is what a warm process loads.

    ``artifact`` is None when the graph cannot be cached (e.g. a training graph whose
    outputs alias its inputs); ``reason`` then says why, for the log and
    ``stats().uncached_reasons``.
    """

    __slots__ = ("fn", "artifact", "reason")

    def __init__(self, fn: Callable[..., Any], artifact: Artifact | None, reason: str = "") -> None:
        self.fn = fn
        self.artifact = artifact
        self.reason = reason

    def __repr__(self) -> str:
        return f"CompileResult(fn={self.fn!r}, artifact={self.artifact!r}, reason={self.reason!r})"


class InnerCompiler(Protocol):
    """One inner compiler (inductor, eager, torchair).

    Optionally also ``registry_factors(options) -> dict``: key factors read from
    process-wide registries that cost too much to scan at every warm load (torchair's
    user GE converters); the graph key holds them, and the compiler's ``load``
    re-checks the entries its artifact used instead.

    Training graphs (grad mode on, an input requires grad) go to the optional
    ``compile_training(gm, example_inputs, options) -> CompileResult``, same contract as
    :meth:`compile`: the compiler runs AOTAutograd with its own partitioner and stores
    the forward and the backward in ONE artifact whose ``meta["training"]`` is the plan
    of :func:`.autograd_runtime.describe`; its ``load`` rebuilds both parts and returns
    :func:`.autograd_runtime.build`'s differentiable callable (the cold process runs the
    same callable). A compiler without ``compile_training`` has its training graphs
    compiled uncached, with one log line. Optionally ``partitioner``: the name of the
    partitioner it uses, a key factor of training graphs.
    """

    #: stable name used in keys, manifests and the ``compiler`` option
    name: str

    def hash_factors(self, options: BackendOptions) -> dict[str, Any]:
        """JSON-able description of everything *besides the graph and its inputs*
        that changes this compiler's output (its version, config, options, the
        process state it compiles in). Cheap (it runs at every warm load), and
        never imports Dynamo or Inductor."""
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
