"""Shared fixtures: every cross-process claim runs in fresh interpreters."""

from __future__ import annotations

import pytest
from subprocess_helpers import run_python


@pytest.fixture
def run():
    return run_python


@pytest.fixture
def cache_dir(tmp_path):
    d = tmp_path / "cache"
    return str(d)


@pytest.fixture
def inductor_dir(tmp_path):
    d = tmp_path / "inductor"
    d.mkdir()
    return str(d)


# a real redis-server for the remote-tier tests (tests/test_remote*.py), started once per session
from redis_fixture import redis_factory, redis_server  # noqa: E402,F401


def pytest_terminal_summary(terminalreporter):
    """The libraries the suite ran against, after the results (also under ``-q``): the test extras
    are ranges, so a new transformers or kernels release reaches the next clean run, and its log
    names the versions a failure came with."""
    from importlib import metadata

    found = []
    for name in ("torch", "transformers", "kernels", "redis"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} -")
    terminalreporter.write_line("libraries: " + ", ".join(found))
