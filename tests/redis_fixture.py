"""A real ``redis-server`` for the remote-tier tests, on a private loopback port.

Skipped only when ``redis-server`` is absent and ``TCB_REQUIRE_REDIS`` is not set
(CI sets it: ``make redis`` installs the distribution's package when it can).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

REQUIRE_ENV = "TCB_REQUIRE_REDIS"


def redis_server_binary() -> str | None:
    return shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process (no persistence) that a test can stop, pause and restart."""

    def __init__(self, binary: str, workdir: str, *extra: str) -> None:
        self.binary = binary
        self.workdir = workdir
        self.extra = list(extra)
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def password(self) -> str | None:
        return self.extra[self.extra.index("--requirepass") + 1] if "--requirepass" in self.extra else None

    def url(self, db: int = 0, **params: object) -> str:
        auth = f":{self.password}@" if self.password else ""
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"redis://{auth}127.0.0.1:{self.port}/{db}" + (f"?{query}" if query else "")

    def command(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--databases", "64", "--dir", self.workdir, *self.extra]

    def start(self) -> None:
        os.makedirs(self.workdir, exist_ok=True)
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited ({self.proc.returncode}): {self.command()}") from None
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def flush(self) -> None:
        self.client().flushall()


class RedisFactory:
    """Starts servers (each on its own port) and stops them all at the end of the session."""

    def __init__(self, binary: str, root: str) -> None:
        self.binary = binary
        self.root = root
        self.servers: list[RedisServer] = []

    def __call__(self, *extra: str) -> RedisServer:
        server = RedisServer(self.binary, os.path.join(self.root, f"r{len(self.servers)}"), *extra)
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture(scope="session")
def redis_factory(tmp_path_factory):
    binary = redis_server_binary()
    if binary is None:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but redis-server is not installed (make redis)")
        pytest.skip("redis-server is not installed (make redis installs it)")
    factory = RedisFactory(binary, str(tmp_path_factory.mktemp("redis")))
    yield factory
    factory.close()


@pytest.fixture(scope="session")
def redis_server(redis_factory) -> RedisServer:
    """The shared server; tests use their own db numbers or flush."""
    return redis_factory()
