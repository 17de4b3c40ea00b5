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
