"""What the running environment is: versions that invalidate a cache, and whether an NPU is here.

Everything is looked up lazily and memoized; importing this module imports no
torch_npu/torchair, and reading versions never imports them either (package
metadata is enough), so the warm path stays light.
"""

from __future__ import annotations

import functools
import os
import platform
import sys


def _dist_version(name: str) -> str | None:
    from importlib import metadata  # ~3 ms to import: only when a package is really there

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _installed(module: str) -> bool:
    """Cheap presence test (a path-finder lookup); metadata scans cost milliseconds. A bare
    directory of that name on ``sys.path`` (a namespace package: a checkout's ``tests/torchair``,
    a working directory) is no install: torch_npu and torchair are regular packages."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


@functools.cache
def torch_version() -> str:
    import torch

    return str(torch.__version__)


@functools.cache
def torch_npu_version() -> str | None:
    mod = sys.modules.get("torch_npu")
    if mod is not None and getattr(mod, "__version__", None):
        return str(mod.__version__)
    if mod is None and not _installed("torch_npu"):
        return None
    return _dist_version("torch-npu") or _dist_version("torch_npu")


@functools.cache
def torchair_version() -> str | None:
    """torchair ships inside torch_npu; a standalone install has its own metadata."""
    mod = sys.modules.get("torchair")
    if mod is not None and getattr(mod, "__version__", None):
        return str(mod.__version__)
    if mod is None and not _installed("torchair"):
        return torch_npu_version()
    return _dist_version("torchair") or torch_npu_version()


def _read_version_file(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition("=")
                if key.strip() in ("Version", "version") and value.strip():
                    return value.strip()
    except OSError:
        return None
    return None


@functools.cache
def cann_version() -> str | None:
    """The CANN toolkit version, from ``$ASCEND_HOME_PATH`` (or the usual install
    roots); ``TCB_CANN_VERSION`` overrides it (tests, containers)."""
    override = os.environ.get("TCB_CANN_VERSION")
    if override:
        return override
    roots = [os.environ.get(v) for v in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")]
    roots += ["/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann"]
    for root in filter(None, roots):
        for rel in ("version.cfg", "version.info", "compiler/version.info", "../version.info"):
            found = _read_version_file(os.path.join(root, rel))
            if found:
                return found
    return None


def environment_factors() -> dict[str, str | None]:
    """Versions that make a compiled artifact invalid when they change."""
    return {
        "python": "{}.{}".format(*sys.version_info[:2]),
        "machine": platform.machine(),
        "torch": torch_version(),
        "torch_npu": torch_npu_version(),
        "torchair": torchair_version(),
        "cann": cann_version(),
    }


@functools.cache
def torchair_importable() -> bool:
    try:
        import torchair  # noqa: F401
    except Exception:  # torchair raises more than ImportError when CANN is absent
        return False
    return True


@functools.cache
def npu_available() -> bool:
    """True only where torch_npu imports *and* reports a device."""
    if "torch_npu" not in sys.modules and not _installed("torch_npu"):
        return False
    try:
        import torch
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available()) and torchair_importable()
    except Exception:
        return False
