"""The remote tier over TLS (``rediss://``) against a real redis-server with a TLS port.

A test CA and a server certificate are made with the ``openssl`` CLI; the server speaks
only TLS. A node that trusts the CA (``?ssl_ca_certs=``) publishes and another node reads
a verified entry; a node that does not trust the certificate, or speaks plain ``redis://``
to the TLS port, gets a miss with one warning, never a failed or hung call.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time

import pytest
from redis_fixture import RedisServer, redis_server_binary

pytestmark = pytest.mark.slow

FILES = {"k.so": os.urandom(2000), "wrapper.py": b"print('hi')\n"}


def _certs(d: str) -> str:
    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=tcb test CA")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.ext")
    return d


class TlsRedis(RedisServer):
    """redis-server listening with TLS only (plain port off)."""

    def __init__(self, binary: str, workdir: str, certs: str) -> None:
        self.certs = certs
        super().__init__(binary, workdir)

    def command(self) -> list[str]:
        c = self.certs
        return [self.binary, "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.workdir, "--tls-cert-file", os.path.join(c, "server.crt"),
                "--tls-key-file", os.path.join(c, "server.key"), "--tls-ca-cert-file", os.path.join(c, "ca.crt"),
                "--tls-auth-clients", "no"]


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    binary = redis_server_binary()
    if binary is None or shutil.which("openssl") is None:
        if os.environ.get("TCB_REQUIRE_REDIS"):
            pytest.fail("TCB_REQUIRE_REDIS is set but redis-server or openssl is missing")
        pytest.skip("needs redis-server and openssl")
    certs = _certs(str(tmp_path_factory.mktemp("certs")))
    server = TlsRedis(binary, str(tmp_path_factory.mktemp("tls-redis")), certs)
    yield server
    server.stop()


def _layered(tmp_path, name, url):
    from torchair_cached_backend import layers
    from torchair_cached_backend.store import Store

    root = tmp_path / name
    root.mkdir(mode=0o700)
    layers.configure(str(root), remote=url)
    return Store(str(root), "graphs")


def test_rediss_with_a_trusted_ca_shares_verified_entries(tls_server, tmp_path):
    url = f"rediss://127.0.0.1:{tls_server.port}/0?ssl_ca_certs={tls_server.certs}/ca.crt"
    assert _layered(tmp_path, "a", url).save("tls1", FILES, {})
    entry = _layered(tmp_path, "b", url).load("tls1")
    assert entry is not None and entry.files == FILES  # fetched over TLS, verified, written locally


@pytest.mark.parametrize("how", ["untrusted", "plain"])
def test_untrusted_certificate_or_plain_protocol_is_a_miss_with_one_warning(tls_server, tmp_path, caplog, how):
    import torchair_cached_backend as tcb

    port = tls_server.port
    url = (f"rediss://127.0.0.1:{port}/0?timeout=1" if how == "untrusted"  # system CAs: ours is not among them
           else f"redis://127.0.0.1:{port}/0?timeout=1")
    before = tcb.stats().remote_faults
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="torchair_cached_backend"):
        store = _layered(tmp_path, how, url)
        assert store.load(f"tls-{how}") is None
        assert store.save(f"tls-{how}", FILES, {})  # the local cache still works
    assert time.monotonic() - t0 < 10
    assert tcb.stats().remote_faults > before
    remote = [r.getMessage() for r in caplog.records if r.getMessage().startswith("npu_cached: remote cache")]
    assert len(remote) == 1, [r.getMessage() for r in caplog.records]
