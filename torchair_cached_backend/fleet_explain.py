"""``torchair-cache explain --here SOURCE``: why does this machine miss a cache built elsewhere?

For every graph entry of SOURCE (a cache dir, a bundle, or a ``redis://`` remote)
the machine-dependent key factors it was built under (format, the inner
compiler's factors: ISA, codegen env vars, config...; versions) are compared
with what this process computes for the same compiler; each differing factor is
listed. Reads only: nothing is extracted, written or loaded.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator
from typing import Any

#: the top-level factors that come from the machine / process (the rest: the graph, its inputs, options)
MACHINE_FACTORS = ("format", "compiler", "compiler_factors", "environment")
_MAX_MANIFEST = 16 << 20


def graph_manifests(source: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, manifest) of every graph entry in ``source``."""
    if source.startswith(("redis://", "rediss://", "unix://")):
        from .remote import RedisRemote

        remote = RedisRemote(source)
        for key in remote.keys("graphs"):
            manifest = remote.read_manifest("graphs", key)
            if manifest is not None:
                yield f"graphs/{key[:16]}", manifest
        return
    if os.path.isfile(source):
        yield from _bundle_manifests(source)
        return
    from .inventory import find_entries

    for item in find_entries(source):
        if item.store.kind != "graphs":
            continue
        manifest = item.store.read_manifest(item.key)
        if manifest is not None:
            yield f"graphs/{item.key[:16]}", manifest


def _bundle_manifests(bundle: str) -> Iterator[tuple[str, dict[str, Any]]]:
    from .store_layout import loads_bounded

    with tarfile.open(bundle, "r:*") as tar:
        for member in tar:
            parts = member.name.split("/")
            if (len(parts) >= 4 and parts[-1] == "manifest.json" and parts[-3] == "graphs" and member.isfile()
                    and member.size <= _MAX_MANIFEST):
                f = tar.extractfile(member)
                if f is None:
                    continue
                manifest = loads_bounded(f.read())
                if isinstance(manifest, dict):
                    yield f"graphs/{parts[-2][:16]}", manifest


def here_factors(compiler: str) -> dict[str, Any]:
    """This process's machine factors for ``compiler`` (default options)."""
    from .compilers import get_compiler
    from .key import context_factors
    from .options import parse_options

    factors = context_factors(get_compiler(compiler), parse_options({"compiler": compiler}))
    return {k: factors[k] for k in MACHINE_FACTORS if k in factors}


def explain_here(source: str) -> list[str]:
    """Readable lines: per entry, the factors that differ from this process (or that none do)."""
    from .key import explain_difference

    lines: list[str] = []
    cache: dict[str, dict[str, Any] | str] = {}
    for label, manifest in graph_manifests(source):
        factors = manifest.get("factors") or {}
        compiler = str(factors.get("compiler") or manifest.get("compiler") or "?")
        if compiler not in cache:
            try:
                cache[compiler] = here_factors(compiler)
            except Exception as exc:  # noqa: BLE001 - e.g. torchair not importable here
                cache[compiler] = f"cannot compute this process's factors for {compiler}: {exc}"
        here = cache[compiler]
        if isinstance(here, str):
            lines.append(f"{label} ({compiler}): {here}")
            continue
        stored = {k: factors.get(k) for k in MACHINE_FACTORS}
        diffs = explain_difference(stored, here)
        if diffs:
            lines.append(f"{label} ({compiler}): misses here:")
            lines += [f"  {d}" for d in diffs]
        else:
            lines.append(f"{label} ({compiler}): matches this process (a miss would come from the graph, its inputs "
                         "or the options)")
    if not lines:
        lines.append(f"no graph entries in {source}")
    return lines
