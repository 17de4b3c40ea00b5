"""Idempotent builder for the "real torchair on CPU" test harness.

Steps (each skipped when its result is already there):

1. ``pip download --no-deps torch-npu==<PIN>`` into ``<build>/wheel`` (the
   registry is reached through pip's ordinary configuration);
2. extract only ``torch_npu/dynamo/torchair/*`` from the wheel with
   :mod:`zipfile` into ``<build>/src`` (so ``<build>/src/torch_npu/dynamo`` is
   the directory to put on ``sys.path``);
3. build the CANN stand-in libraries with gcc (:mod:`gen_stubs`) into
   ``<build>/stubs``;
4. write ``<build>/stamp.json``.  While the stamp matches (same pin, same
   interpreter / torch, same stub sources) :func:`ensure_built` returns at once.

``<build>`` is ``$TCB_TORCHAIR_BUILD`` or ``build/torchair-cpu`` at the repo
root (git-ignored).  A pre-downloaded wheel can be supplied with
``$TCB_TORCHAIR_WHEEL`` (path to the .whl) for offline machines.

Missing prerequisites raise :class:`PrerequisiteMissing` (``.kind`` is
``"toolchain"``, ``"registry"`` or ``"platform"``) so that the pytest
fixture can tell "this machine cannot build the harness" from a real failure.

CLI: ``python -m tests.torchair_harness.build [--force]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

try:  # works both as package module and as a plain script
    from . import gen_stubs
except ImportError:  # pragma: no cover - script mode
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gen_stubs  # type: ignore[no-redef]

TORCH_NPU_VERSION = "2.14.0"
TORCHAIR_PREFIX = "torch_npu/dynamo/torchair/"
HARNESS_DIR = Path(__file__).resolve().parent
REPO_ROOT = HARNESS_DIR.parent.parent
STAMP_FORMAT = 1
REQUIRED_TOOLS = ("gcc", "g++", "readelf")
#: pure-python runtime deps of torchair's code paths that the harness uses
RUNTIME_MODULES = {"google.protobuf": "protobuf", "yaml": "pyyaml", "packaging": "packaging"}


class PrerequisiteMissing(RuntimeError):
    """The machine lacks something the harness cannot provide by itself."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class BuildError(RuntimeError):
    """Building went wrong although the prerequisites are present (a real failure)."""


@dataclasses.dataclass(frozen=True)
class HarnessPaths:
    build_dir: Path

    @property
    def wheel_dir(self) -> Path:
        return self.build_dir / "wheel"

    @property
    def src_dir(self) -> Path:
        return self.build_dir / "src"

    @property
    def torchair_parent(self) -> Path:
        """Directory to put on ``sys.path`` (it contains ``torchair/``)."""
        return self.src_dir / "torch_npu" / "dynamo"

    @property
    def torchair_package(self) -> Path:
        return self.torchair_parent / "torchair"

    @property
    def stubs_dir(self) -> Path:
        return self.build_dir / "stubs"

    @property
    def stamp(self) -> Path:
        return self.build_dir / "stamp.json"

    def stub_libraries(self) -> list[Path]:
        return [self.stubs_dir / name for name in gen_stubs.ALL_SONAMES]


def build_dir() -> Path:
    env = os.environ.get("TCB_TORCHAIR_BUILD")
    return Path(env).expanduser().resolve() if env else REPO_ROOT / "build" / "torchair-cpu"


def paths() -> HarnessPaths:
    return HarnessPaths(build_dir())


def _log(msg: str) -> None:
    print(f"[torchair-harness] {msg}", file=sys.stderr, flush=True)


def _expected_stamp() -> dict:
    digest = hashlib.sha256()
    for name in ("gen_stubs.py", "manual_stub.cpp"):
        digest.update((HARNESS_DIR / name).read_bytes())
    spec_torch = _torch_version()
    return {
        "format": STAMP_FORMAT,
        "torch_npu": TORCH_NPU_VERSION,
        "python": sys.implementation.cache_tag,
        "machine": platform.machine(),
        "torch": spec_torch,
        "stub_sources": digest.hexdigest(),
    }


def _torch_version() -> str:
    # read the version without importing torch (keeps the fast path fast)
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001
        return "unknown"


def _stamp_ok(p: HarnessPaths) -> bool:
    try:
        stamp = json.loads(p.stamp.read_text())
    except (OSError, ValueError):
        return False
    if {k: stamp.get(k) for k in _expected_stamp()} != _expected_stamp():
        return False
    return (p.torchair_package / "__init__.py").is_file() and all(lib.is_file() for lib in p.stub_libraries())


def check_prerequisites() -> None:
    """Raise :class:`PrerequisiteMissing` for a missing toolchain or python module."""
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        raise PrerequisiteMissing(
            "toolchain",
            f"the torchair CPU harness needs {', '.join(REQUIRED_TOOLS)} on PATH to build CANN stub "
            f"libraries; missing: {', '.join(missing)} (Debian/Ubuntu: apt-get install gcc g++ binutils)",
        )
    if sys.platform != "linux":
        raise PrerequisiteMissing("platform", f"the torchair CPU harness only works on Linux, not {sys.platform}")
    import importlib.util

    absent = [
        pkg
        for mod, pkg in RUNTIME_MODULES.items()
        if importlib.util.find_spec(mod.split(".")[0]) is None or importlib.util.find_spec(mod) is None
    ]
    if absent:
        raise BuildError(
            f"python packages needed by torchair are not installed in {sys.executable}: "
            f"{' '.join(absent)}  (pip install {' '.join(absent)})"
        )


_NETWORK_HINTS = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Max retries exceeded",
    "ConnectTimeout",
    "Network is unreachable",
    "ProxyError",
    "Connection refused",
    "Failed to establish a new connection",
    "SSLError",
    "ReadTimeout",
)


def _find_wheel(directory: Path) -> Path | None:
    wheels = sorted(directory.glob(f"torch_npu-{TORCH_NPU_VERSION}-*.whl")) if directory.is_dir() else []
    return wheels[0] if wheels else None


def _download_wheel(p: HarnessPaths) -> Path:
    override = os.environ.get("TCB_TORCHAIR_WHEEL")
    if override:
        wheel = Path(override).expanduser()
        if not wheel.is_file():
            raise BuildError(f"TCB_TORCHAIR_WHEEL={override} does not exist")
        return wheel
    wheel = _find_wheel(p.wheel_dir)
    if wheel is not None:
        return wheel
    p.wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        f"torch-npu=={TORCH_NPU_VERSION}",
        "-d",
        str(p.wheel_dir),
    ]
    _log(f"downloading torch-npu=={TORCH_NPU_VERSION} (~44 MB, --no-deps)")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as exc:
        raise PrerequisiteMissing(
            "registry",
            f"'pip download torch-npu=={TORCH_NPU_VERSION}' timed out "
            f"after {exc.timeout:.0f}s; is the package registry reachable?",
        ) from None
    output = (res.stdout or "") + (res.stderr or "")
    wheel = _find_wheel(p.wheel_dir)
    if res.returncode == 0 and wheel is not None:
        return wheel
    tail = "\n".join(output.strip().splitlines()[-15:])
    if "No module named pip" in output:
        raise BuildError(f"pip is not available in {sys.executable}:\n{tail}")
    if any(hint in output for hint in _NETWORK_HINTS) or "(from versions: none)" in output:
        # nothing at all named torch-npu was visible: unreachable registry (or one without the package)
        raise PrerequisiteMissing(
            "registry",
            f"no torch-npu distribution visible: package registry unreachable, "
            f"or no torch-npu wheel for {sys.implementation.cache_tag}/"
            f"{platform.machine()}; 'pip download torch-npu=={TORCH_NPU_VERSION}' "
            f"failed:\n{tail}",
        )
    if "No matching distribution" in output or "Could not find a version" in output:
        raise PrerequisiteMissing(
            "platform",
            f"no torch-npu=={TORCH_NPU_VERSION} wheel for this interpreter/platform "
            f"({sys.implementation.cache_tag}, {platform.machine()}) on the registry:\n{tail}",
        )
    raise BuildError(f"'pip download torch-npu=={TORCH_NPU_VERSION}' failed (exit {res.returncode}):\n{tail}")


def _extract_torchair(wheel: Path, p: HarnessPaths) -> int:
    staging = p.build_dir / "src.partial"
    shutil.rmtree(staging, ignore_errors=True)
    count = 0
    try:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                name = info.filename
                if not name.startswith(TORCHAIR_PREFIX) or info.is_dir():
                    continue
                # zip-slip guard: stay inside the staging dir
                target = (staging / name).resolve()
                if staging.resolve() not in target.parents:
                    raise BuildError(f"refusing suspicious wheel member {name!r}")
                zf.extract(info, staging)
                count += 1
    except zipfile.BadZipFile as exc:
        wheel.unlink(missing_ok=True)
        raise BuildError(f"{wheel} is not a valid wheel ({exc}); deleted it, re-run to download again") from exc
    if count == 0:
        raise BuildError(f"{wheel} contains no {TORCHAIR_PREFIX} files")
    shutil.rmtree(p.src_dir, ignore_errors=True)
    staging.rename(p.src_dir)
    return count


@contextlib.contextmanager
def _build_lock(p: HarnessPaths):
    p.build_dir.mkdir(parents=True, exist_ok=True)
    with open(p.build_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_built(*, force: bool = False) -> HarnessPaths:
    """Build the harness if needed and return its paths (instant when up to date)."""
    p = paths()
    if not force and _stamp_ok(p):
        return p
    check_prerequisites()
    with _build_lock(p):
        if not force and _stamp_ok(p):  # someone else built it while we waited
            return p
        start = time.monotonic()
        p.stamp.unlink(missing_ok=True)
        wheel = _download_wheel(p)
        files = _extract_torchair(wheel, p)
        _log(f"extracted {files} torchair files from {wheel.name}")
        shutil.rmtree(p.stubs_dir, ignore_errors=True)
        try:
            summary = gen_stubs.generate(p.torchair_parent, p.stubs_dir, log=_log)
        except gen_stubs.StubBuildError as exc:
            raise BuildError(f"building the CANN stub libraries failed: {exc}") from exc
        stamp = dict(
            _expected_stamp(), wheel=wheel.name, files=files, stubs=summary, seconds=round(time.monotonic() - start, 2)
        )
        p.stamp.write_text(json.dumps(stamp, indent=2) + "\n")
        _log(f"harness ready in {stamp['seconds']} s at {p.build_dir}")
    return p


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if the stamp is up to date")
    args = parser.parse_args(argv)
    try:
        p = ensure_built(force=args.force)
    except PrerequisiteMissing as exc:
        print(f"prerequisite missing ({exc.kind}): {exc}", file=sys.stderr)
        return 2
    print(p.build_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
