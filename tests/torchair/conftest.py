"""Fixtures for tests that run against the *real* torchair on CPU.

The session fixture builds the harness once (``tests/torchair_harness/build.py``:
downloads the pinned torch-npu wheel, extracts torchair, builds CANN stubs).

It skips only when a prerequisite is truly absent on this machine (no gcc /
g++ / readelf, the package registry is unreachable, or no wheel exists for this
interpreter/platform).  With ``TCB_REQUIRE_TORCHAIR=1`` (CI) those cases fail
instead.  Any other build problem is an error, never a skip.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from tests.torchair_harness import build as harness_build  # noqa: E402


def _torchair_required() -> bool:
    return os.environ.get("TCB_REQUIRE_TORCHAIR", "").strip().lower() not in ("", "0", "false", "no")


def _unavailable(reason: str):
    if _torchair_required():
        pytest.fail(f"{reason} (TCB_REQUIRE_TORCHAIR is set, so this is a failure)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session", autouse=True)
def torchair_harness() -> harness_build.HarnessPaths:
    """Paths of the built harness (build dir, torchair parent dir, stub libraries)."""
    if shutil.which("gcc") is None:
        _unavailable("real-torchair tests need gcc to build CANN stub libraries, and gcc is not on PATH")
    try:
        return harness_build.ensure_built()
    except harness_build.PrerequisiteMissing as exc:
        _unavailable(f"real-torchair harness cannot be built here [{exc.kind}]: {exc}")
