"""Make the real torchair (from the torch_npu wheel) importable in *this* process.

Use it first thing in a fresh process (``run.run_script`` does this for you)::

    import tests.torchair_harness.bootstrap as bootstrap
    bootstrap.setup(shim=True)          # builds the harness if needed
    import torchair                     # the wheel's torchair, on CPU

What :func:`setup` does, in order:

1. ``build.ensure_built()`` (instant once built; pass ``build=False`` to
   require an existing build instead);
2. ``import torch`` so libtorch*.so are loaded and resolvable by soname;
3. ``ctypes.CDLL(<stub>, RTLD_GLOBAL)`` for every stub library, so the NEEDED
   entries of ``torchair/core/*.so`` resolve to them (no LD_LIBRARY_PATH);
4. puts ``<build>/src/torch_npu/dynamo`` first on ``sys.path``;
5. silences the ~120 harmless ``Failed to import torchair..custom..``
   UserWarnings (no ``torch.ops.npu`` kernels exist on CPU) and sets
   ``CANN_STUB_QUIET=1`` unless the caller chose otherwise;
6. optionally imports torchair and installs the executor shim
   (``shim=True``) and/or the fake ``torch_npu`` (``fake_torch_npu=True``).

Note: importing torchair registers an atexit hook and SIGINT/SIGTERM handlers
that finalize GE and then *ignore* the signal; stop such processes with
SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

from . import build as _build

_state: dict = {}

#: regex (``warnings.filterwarnings`` message) of the harmless converter warnings
CUSTOM_CONVERTER_WARNING = r"Failed to import torchair\._ge_concrete_graph\.ge_converter\.custom\."


def filter_warnings() -> None:
    warnings.filterwarnings("ignore", message=CUSTOM_CONVERTER_WARNING, category=UserWarning)


def setup(
    *,
    shim: bool = False,
    fake_torch_npu: bool = False,
    import_torchair: bool | None = None,
    build: bool = True,
    quiet: bool = True,
) -> _build.HarnessPaths:
    """Prepare the process; idempotent. Returns the harness paths.

    ``import_torchair`` defaults to True when ``shim`` or ``fake_torch_npu``
    is requested (both need it), else False (just make it importable).
    """
    if quiet:
        os.environ.setdefault("CANN_STUB_QUIET", "1")
    filter_warnings()

    paths = _state.get("paths")
    if paths is None:
        paths = _build.ensure_built() if build else _build.paths()
        missing = [str(lib) for lib in paths.stub_libraries() if not lib.is_file()]
        if missing or not paths.torchair_package.is_dir():
            raise RuntimeError(
                f"torchair harness is not built at {paths.build_dir} "
                f"(run: python -m tests.torchair_harness.build); missing: {missing or 'torchair'}"
            )
        import torch  # noqa: F401  - loads libtorch*.so before the stubs' dependants

        handles = [ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL) for lib in paths.stub_libraries()]
        root = str(paths.torchair_parent)
        if root not in sys.path:
            sys.path.insert(0, root)
        _state.update(paths=paths, handles=handles)

    if import_torchair is None:
        import_torchair = shim or fake_torch_npu
    if import_torchair:
        import torchair  # noqa: F401

        expected = str(paths.torchair_package)
        if not os.path.abspath(torchair.__file__).startswith(expected):
            raise RuntimeError(f"imported torchair from {torchair.__file__}, expected under {expected}")
    if shim:
        from . import executor_shim

        executor_shim.install()
    if fake_torch_npu:
        from . import fake_torch_npu as _fake

        _fake.install()
    return paths


def torchair_parent() -> str:
    """Directory that contains the extracted ``torchair`` package (no building)."""
    return str(_build.paths().torchair_parent)
