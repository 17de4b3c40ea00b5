"""The remote tier: cache entries shared by a fleet through Redis.

Layout (``<p>`` is the key prefix, ``tcb`` by default; ``<ns>`` separates
per-rank programs):

* ``<p>:m:<kind>:<ns><key>`` - the entry's *record*: JSON with the entry's manifest
  fields, every blob's size and sha256 (and chunk count), and, with
  ``TORCHAIR_CACHE_KEY`` set, an HMAC-SHA256 of all of it;
* ``<p>:b:<sha256>`` (or ``...:<i>`` per chunk above the chunk size) - blobs,
  content-addressed, so kernels shared by many graphs are stored once;
* ``<p>:l:<kind>:<ns><key>`` - the fleet-wide compile lock: ``SET NX PX`` with a
  lease the holder renews; it expires when the holder dies or is stopped;
* ``<p>:r:<kind>:<key>:<cache>`` - a graph's sealed run-time cache (GE's compiled
  model, torchair's static kernels, often GBs), published by the node that sealed it:
  a record as above whose files are the seal and every file it lists, each with the
  sha256 of each of its chunks, stored at ``<p>:c:<chunk sha256>``.

No round trip moves much more than ``chunk`` bytes (4 MiB by default: one SET or GET of
a chunk, or a pipeline / MGET of small blobs up to that size), so each stays well inside
the socket timeout and memory holds a few chunks, whatever the size. Blobs and chunks
are content-addressed and written first; the record, written last, is what makes an
entry visible, so an upload that dies midway is never seen as complete (a newer
record replaces an older one whole). A reader verifies the record (signature when a
key is set) and every blob's size and sha256 before anything is written locally; a
run-time cache's record must list exactly the files its seal lists, and each chunk
(its digest) and each file (its seal's size and sha256) is checked as it streams into a
staging directory renamed into place only when all passed (``runtime_carry.py``).
Programs are merged with a ``WATCH``/``MULTI`` compare-and-set (the bypass's own
merge), never overwritten.

Every fault (server down or slow, refused auth, out of memory, an evicted or
corrupt entry) is a miss or a skipped publish with one warning per cause and a
count in ``stats().remote_faults``; every round trip is bounded by a socket
timeout, and after a connection fault the remote is skipped for a while
(``retry_after``) so a dead server costs one timeout, not one per graph.
redis-py is imported only when a remote is configured.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .logs import log, warn_once
from .stats import record

REMOTE_ENV = "TORCHAIR_CACHE_REMOTE"
PASSWORD_ENV = "TORCHAIR_CACHE_REMOTE_PASSWORD"
RECORD_FORMAT = 1
#: our own URL query parameters (the rest go to redis-py: ssl_ca_certs, ssl_cert_reqs, ...)
_PARAMS = {
    "timeout": 2.0,        # seconds, every connect / round trip
    "lease": 30.0,         # seconds a compile lock lives without renewal
    "wait": None,          # seconds a node waits for another's compile (default: the lock timeout)
    "retry_after": 30.0,   # seconds the remote is skipped after a connection fault
    "chunk": 4 << 20,      # bytes: blobs above it are stored in chunks; no round trip moves much more
    "prefix": "tcb",
}
_RENEW_LUA = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE_LUA = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class RemoteError(Exception):
    """A remote entry that is refused (corrupt, partial, unsigned); the message says why."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class RemoteConfigError(ValueError):
    """A bad remote URL; the message names the fix."""


def redact(url: str) -> str:
    """The URL without its password (for messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def parse_url(url: str) -> tuple[str, dict[str, Any]]:
    """Split ``url`` into the URL redis-py gets and our parameters; RemoteConfigError if bad."""
    if not isinstance(url, str) or not url:
        raise RemoteConfigError(f"remote must be a redis:// or rediss:// URL, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise RemoteConfigError(
            f"remote URL {redact(url)!r} has scheme {parts.scheme!r}; use redis://host:port/db, rediss:// for TLS "
            "(password in the URL or $TORCHAIR_CACHE_REMOTE_PASSWORD)"
        )
    params = dict(_PARAMS)
    rest = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in _PARAMS:
            rest.append((name, value))
            continue
        try:
            params[name] = value if name == "prefix" else (int(value) if name == "chunk" else float(value))
        except ValueError:
            raise RemoteConfigError(f"remote URL parameter {name}={value!r} is not a number") from None
        if name != "prefix" and params[name] <= 0:
            raise RemoteConfigError(f"remote URL parameter {name}={value!r} must be > 0")
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(rest), "")), params


def signing_key() -> bytes | None:
    """``$TORCHAIR_CACHE_KEY`` as bytes, as bundles use it."""
    key = os.environ.get("TORCHAIR_CACHE_KEY") or None
    return key.encode() if key else None


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class RedisRemote:
    """One Redis server as the remote tier (shared by every store of the process that names it)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client_url, self.params = parse_url(url)
        self.prefix = str(self.params["prefix"])
        self._client: Any = None
        self._down_until = 0.0
        self._lock = threading.Lock()
        #: entries refused in this process (corrupt, partial, unsigned): not fetched again until republished
        self._refused: set[tuple[str, str]] = set()

    def __repr__(self) -> str:
        return f"RedisRemote({redact(self.url)!r})"

    # -- connection and faults --------------------------------------------
    def client(self) -> Any:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
        return self._client

    def _connect(self) -> Any:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise RemoteError(
                "no-redis", "the remote tier needs redis-py: pip install 'torchair-cached-backend[redis]'"
            ) from None
        timeout = float(self.params["timeout"])
        kwargs: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
        }
        if urlsplit(self.client_url).password is None and os.environ.get(PASSWORD_ENV):
            kwargs["password"] = os.environ[PASSWORD_ENV]
        return redis.Redis.from_url(self.client_url, **kwargs)

    def available(self) -> bool:
        """False while the remote is skipped after a connection fault."""
        return time.monotonic() >= self._down_until

    def fault(self, exc: BaseException, doing: str) -> None:
        """Count a fault and warn once per cause; a connection fault skips the remote for a while."""
        record(remote_faults=1)
        cause, advice = self._classify(exc)
        if cause in ("down", "timeout", "auth", "no-redis"):
            self._down_until = time.monotonic() + float(self.params["retry_after"])
        warn_once(
            f"remote:{self.url}:{cause}",
            "npu_cached: remote cache %s: could not %s (%s: %s); %s. The call is served from the local cache or "
            "compiled; stats().remote_faults counts these.",
            redact(self.url), doing, cause, exc, advice,
        )

    def _classify(self, exc: BaseException) -> tuple[str, str]:
        if isinstance(exc, RemoteError):
            advice = {
                "unsigned": "with TORCHAIR_CACHE_KEY set only entries signed with that key are used; publish "
                            "them from nodes that have the key",
                "no-redis": "install redis-py or unset the remote",
            }.get(exc.cause, "the entry is ignored and rebuilt (and republished)")
            return exc.cause, advice
        name = type(exc).__name__
        text = str(exc)
        if "AuthenticationError" in name or "NOAUTH" in text or "WRONGPASS" in text or "invalid password" in text:
            return "auth", f"check the password (in the URL or ${PASSWORD_ENV})"
        if "OOM" in text or "maxmemory" in text:
            return "full", "the server is out of memory (maxmemory): raise it or set an eviction policy"
        if "Timeout" in name or isinstance(exc, (socket.timeout, TimeoutError)):
            return "timeout", "the server is slow or unreachable: it is skipped for a while"
        if "Connection" in name or isinstance(exc, OSError):
            return "down", "the server is unreachable: it is skipped for a while"
        return "error", "the remote is skipped for this entry"

    # -- keys ---------------------------------------------------------------
    def _mkey(self, kind: str, key: str) -> str:
        return f"{self.prefix}:m:{kind}:{key}"

    def _lkey(self, kind: str, key: str) -> str:
        return f"{self.prefix}:l:{kind}:{key}"

    def _bkeys(self, digest: str, chunks: int) -> list[str]:
        base = f"{self.prefix}:b:{digest}"
        return [base] if chunks == 0 else [f"{base}:{i}" for i in range(chunks)]

    # -- records ------------------------------------------------------------
    def _record(self, kind: str, key: str, files: dict[str, bytes], manifest: dict[str, Any],
                runtime: str | None = None) -> tuple[bytes, dict[str, bytes]]:
        """(record bytes, {redis key: bytes} of the blobs)."""
        chunk = int(self.params["chunk"])
        infos: dict[str, Any] = {}
        blobs: dict[str, bytes] = {}
        for name, data in files.items():
            digest = _sha256(data)
            chunks = 0 if len(data) <= chunk else -(-len(data) // chunk)
            infos[name] = {"size": len(data), "sha256": digest, "chunks": chunks}
            for i, bkey in enumerate(self._bkeys(digest, chunks)):
                blobs[bkey] = data if chunks == 0 else data[i * chunk:(i + 1) * chunk]
        return self._signed_record(kind, key, infos, manifest, runtime), blobs

    @staticmethod
    def _signed_record(kind: str, key: str, infos: dict[str, Any], manifest: dict[str, Any],
                       runtime: str | None = None) -> bytes:
        """The record's bytes over the files' infos (signed when a key is set): one writer for
        entries' records and run-time caches' records alike."""
        body: dict[str, Any] = {"format": RECORD_FORMAT, "kind": kind, "key": key, "manifest": manifest, "files": infos,
                                "published": time.time()}
        if runtime is not None:
            body["runtime"] = runtime
        mac_key = signing_key()
        if mac_key is not None:
            body["sig"] = hmac.new(mac_key, _canonical(body), hashlib.sha256).hexdigest()
        return _canonical(body)

    def _parse_record(self, kind: str, key: str, raw: bytes, runtime: str | None = None) -> dict[str, Any]:
        from .store_layout import loads_bounded, valid_name

        if runtime is not None:
            from .runtime_cache import valid_rel as valid_name  # noqa: F811 - a cache's files are paths

        try:
            body = loads_bounded(raw)
        except Exception as exc:
            raise RemoteError("corrupt", f"record of {kind}/{key[:12]} is not valid JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("format") != RECORD_FORMAT:
            raise RemoteError("corrupt", f"record of {kind}/{key[:12]} has another format")
        if body.get("kind") != kind or body.get("key") != key or body.get("runtime") != runtime:
            raise RemoteError("corrupt", f"record of {kind}/{key[:12]} names another entry")
        infos = body.get("files")
        if not isinstance(infos, dict) or not isinstance(body.get("manifest"), dict):
            raise RemoteError("corrupt", f"record of {kind}/{key[:12]} is malformed")
        for name, info in infos.items():
            ok = (valid_name(name) and isinstance(info, dict) and isinstance(info.get("size"), int)
                  and isinstance(info.get("sha256"), str) and len(info["sha256"]) == 64
                  and isinstance(info.get("chunks"), int) and 0 <= info["chunks"] <= 1 << 16)
            if ok and "parts" in info:
                parts = info["parts"]
                ok = (isinstance(parts, list) and len(parts) == info["chunks"]
                      and all(isinstance(p, str) and len(p) == 64 for p in parts))
            if not ok:
                raise RemoteError("corrupt", f"record of {kind}/{key[:12]} has a malformed blob record {name!r}")
        mac_key = signing_key()
        if mac_key is not None:
            sig = body.pop("sig", None)
            want = hmac.new(mac_key, _canonical(body), hashlib.sha256).hexdigest()
            if not isinstance(sig, str) or not hmac.compare_digest(sig, want):
                raise RemoteError(
                    "unsigned", f"entry {kind}/{key[:12]} is {'unsigned' if sig is None else 'signed with another key or altered'}"
                )
        return body

    def _fetch_blobs(self, conn: Any, kind: str, key: str, body: dict[str, Any]) -> dict[str, bytes]:
        """Every blob of a record, each checked against its size and sha256."""
        names = list(body["files"])
        wanted: list[tuple[str, int]] = []
        for name in names:
            info = body["files"][name]
            keys = self._bkeys(info["sha256"], info["chunks"])
            wanted += [(bkey, -(-info["size"] // len(keys))) for bkey in keys]
        values = self._mget_bounded(conn, wanted)
        record(remote_bytes_in=sum(len(v) for v in values if v))
        files: dict[str, bytes] = {}
        pos = 0
        for name in names:
            info = body["files"][name]
            count = max(info["chunks"], 1)
            parts = values[pos:pos + count]
            pos += count
            if any(p is None for p in parts):
                raise RemoteError("partial", f"entry {kind}/{key[:12]} lost blob {name!r} (evicted?)")
            data = b"".join(parts)
            if len(data) != info["size"] or _sha256(data) != info["sha256"]:
                raise RemoteError("corrupt", f"blob {name!r} of {kind}/{key[:12]} fails its size/sha256 check")
            files[name] = data
        return files

    def _mget_bounded(self, conn: Any, wanted: list[tuple[str, int]]) -> list[Any]:
        """MGET of ``(key, expected size)`` in round trips of about ``chunk`` bytes each (one
        reply of a whole large entry could not arrive within the socket timeout on a slow link)."""
        limit = int(self.params["chunk"])
        values: list[Any] = []
        batch: list[str] = []
        size = 0
        for bkey, expect in wanted:
            if batch and size + expect > limit:
                values += conn.mget(batch)
                batch, size = [], 0
            batch.append(bkey)
            size += expect
        if batch:
            values += conn.mget(batch)
        return values

    def _set_bounded(self, conn: Any, blobs: dict[str, bytes]) -> None:
        """SET every blob in pipelines of about ``chunk`` bytes each (each one round trip well inside
        the socket timeout). Blobs are content-addressed: the record, set after them, is what
        makes an entry visible, so a publish that dies midway is never seen as complete."""
        limit = int(self.params["chunk"])
        pipe = conn.pipeline(transaction=False)
        size = 0
        for bkey, data in blobs.items():
            if size and size + len(data) > limit:
                pipe.execute()
                size = 0
            pipe.set(bkey, data)
            size += len(data)
        pipe.execute()

    # -- operations (none raises) --------------------------------------------
    def get(self, kind: str, key: str) -> tuple[dict[str, Any], dict[str, bytes]] | None:
        """(manifest fields, verified files) of ``kind/key``, or None (absent, refused, or a fault)."""
        if not self.available() or (kind, key) in self._refused:
            return None
        try:
            conn = self.client()
            raw = conn.get(self._mkey(kind, key))
            if raw is None:
                return None
            body = self._parse_record(kind, key, raw)
            files = self._fetch_blobs(conn, kind, key, body)
        except Exception as exc:  # noqa: BLE001 - any fault of the remote is a miss
            if isinstance(exc, RemoteError):
                self._refused.add((kind, key))
            self.fault(exc, f"read {kind}/{key[:12]}")
            return None
        return body["manifest"], files

    # -- run-time caches (GE's compiled model, static kernels), each with its seal --------
    def _rkey(self, kind: str, key: str, subdir: str) -> str:
        return f"{self.prefix}:r:{kind}:{key}:{subdir}"

    def _ckey(self, digest: str) -> str:
        return f"{self.prefix}:c:{digest}"

    def _put_stream(self, conn: Any, reader: Any) -> dict[str, Any]:
        """Send a file chunk by chunk (one SET of at most ``chunk`` bytes each, named by the chunk's
        sha256); its record: size, sha256 and the chunks' digests, all computed as it streamed."""
        chunk = int(self.params["chunk"])
        whole, parts, size = hashlib.sha256(), [], 0
        while True:
            data = reader.read(chunk)
            if not data:
                break
            digest = _sha256(data)
            conn.set(self._ckey(digest), data)
            record(remote_bytes_out=len(data))
            parts.append(digest)
            whole.update(data)
            size += len(data)
        return {"size": size, "sha256": whole.hexdigest(), "chunks": len(parts), "parts": parts}

    def _stream_blob(self, conn: Any, kind: str, key: str, name: str, info: dict[str, Any]) -> Iterator[bytes]:
        """A blob of a record, one GET per chunk, each chunk checked against its digest when the
        record lists them (the whole is checked by the caller against the seal)."""
        parts = info.get("parts")
        keys = [self._ckey(p) for p in parts] if parts is not None else self._bkeys(info["sha256"], info["chunks"])
        for i, bkey in enumerate(keys):
            data = conn.get(bkey)
            if data is None:
                raise RemoteError("partial", f"entry {kind}/{key[:12]} lost chunk {i} of {name!r} (evicted?)")
            if parts is not None and _sha256(data) != parts[i]:
                raise RemoteError("corrupt", f"chunk {i} of {name!r} of {kind}/{key[:12]} fails its sha256 check")
            record(remote_bytes_in=len(data))
            yield data

    def put_runtime(self, kind: str, key: str, cache: Any) -> bool:
        """Publish a sealed run-time cache of ``kind/key`` (``cache``: a :class:`runtime_carry.Sealed`,
        or anything with its ``subdir``, ``seal_raw``, ``files`` and ``open(rel)``): every file
        streamed in chunks, then the record last, so no other node sees a partial upload as
        complete. False on a fault (a file that changed since it was sealed included)."""
        from .runtime_cache import seal_name

        if not self.available():
            return False
        subdir = cache.subdir
        try:
            conn = self.client()
            infos = {seal_name(subdir): self._put_stream(conn, io.BytesIO(cache.seal_raw))}
            for rel in sorted(cache.files):
                with cache.open(rel) as reader:
                    infos[f"{subdir}/{rel}"] = self._put_stream(conn, reader)
            raw = self._signed_record(kind, key, infos, {}, runtime=subdir)
            conn.set(self._rkey(kind, key, subdir), raw)
            record(remote_bytes_out=len(raw), remote_published=1)
            return True
        except Exception as exc:  # noqa: BLE001
            self.fault(exc, f"publish the run-time cache {subdir} of {kind}/{key[:12]}")
            return False

    def get_runtime(self, kind: str, key: str, subdirs: tuple[str, ...]
                    ) -> dict[str, tuple[bytes, Callable[[Any], None]]]:
        """{cache: (seal bytes, fill)} of the run-time caches of ``kind/key`` the remote holds:
        the record (signature when a key is set) and the seal checked, and the seal listing
        exactly the files the record carries; ``fill(staging)`` then streams every file chunk by
        chunk into a :class:`runtime_carry.Staging` (which checks it against the seal), counting
        a fault and raising on a lost or corrupt chunk. A cache that fails a check is left out."""
        from .runtime_cache import MAX_SEAL_BYTES, SealMismatch, parse_seal, seal_name

        found: dict[str, tuple[bytes, Callable[[Any], None]]] = {}
        if not self.available():
            return found
        try:
            conn = self.client()
            raws = conn.mget([self._rkey(kind, key, subdir) for subdir in subdirs])
        except Exception as exc:  # noqa: BLE001
            self.fault(exc, f"read the run-time caches of {kind}/{key[:12]}")
            return found
        for subdir, raw in zip(subdirs, raws, strict=True):
            if raw is None:
                continue
            where = f"the run-time cache {subdir} of {kind}/{key[:12]}"
            try:
                infos = self._parse_record(kind, key, raw, runtime=subdir)["files"]
                sname, prefix = seal_name(subdir), subdir + "/"
                info = infos.get(sname)
                if info is None or info["size"] > MAX_SEAL_BYTES:
                    raise RemoteError("corrupt", f"{where} has no seal (or an oversized one)")
                seal_raw = b"".join(self._stream_blob(conn, kind, key, sname, info))
                if len(seal_raw) != info["size"] or _sha256(seal_raw) != info["sha256"]:
                    raise RemoteError("corrupt", f"the seal of {where} fails its size/sha256 check")
                try:
                    sealed = parse_seal(seal_raw, key, subdir)
                except SealMismatch as exc:
                    raise RemoteError("corrupt", f"{where}: {exc}") from None
                carried = {n[len(prefix):]: (i["size"], i["sha256"]) for n, i in infos.items() if n != sname}
                if any(n != sname and not n.startswith(prefix) for n in infos) or carried != sealed:
                    raise RemoteError("corrupt", f"{where}: the files carried do not match its seal")
            except Exception as exc:  # noqa: BLE001 - any fault is a miss: GE builds its own
                self.fault(exc, f"read {where}")
                continue
            found[subdir] = (seal_raw, self._runtime_fill(conn, kind, key, where, prefix, infos, sorted(sealed)))
        return found

    def _runtime_fill(self, conn: Any, kind: str, key: str, where: str, prefix: str, infos: dict[str, Any],
                      rels: list[str]) -> Callable[[Any], None]:
        from .runtime_cache import SealMismatch

        def fill(staging: Any) -> None:
            try:
                for rel in rels:
                    staging.write(rel, self._stream_blob(conn, kind, key, prefix + rel, infos[prefix + rel]))
            except SealMismatch as exc:  # what streamed in is not the file its seal lists
                self.fault(RemoteError("corrupt", f"{where}: {exc}"), f"read {where}")
                raise
            except OSError:  # a local fault writing it (disk full...): not the remote's (logged by the installer)
                raise
            except Exception as exc:
                self.fault(exc, f"read {where}")
                raise

        return fill

    def exists(self, kind: str, key: str) -> bool:
        if not self.available():
            return False
        try:
            return bool(self.client().exists(self._mkey(kind, key)))
        except Exception as exc:  # noqa: BLE001
            self.fault(exc, f"look up {kind}/{key[:12]}")
            return False

    def put(self, kind: str, key: str, files: dict[str, bytes], manifest: dict[str, Any]) -> bool:
        """Publish the blobs (bounded round trips), then the record; False on a fault."""
        if not self.available():
            return False
        try:
            raw, blobs = self._record(kind, key, files, manifest)
            conn = self.client()
            self._set_bounded(conn, blobs)
            conn.set(self._mkey(kind, key), raw)
            self._refused.discard((kind, key))
            record(remote_bytes_out=len(raw) + sum(len(v) for v in blobs.values()), remote_published=1)
            return True
        except Exception as exc:  # noqa: BLE001
            self.fault(exc, f"publish {kind}/{key[:12]}")
            return False

    def merge(
        self, kind: str, key: str, files: dict[str, bytes], manifest: dict[str, Any],
        merger: Callable[[dict[str, Any] | None, dict[str, bytes], dict[str, Any], dict[str, bytes]],
                         tuple[dict[str, Any], dict[str, bytes]]],
        attempts: int = 16,
    ) -> bool:
        """Merge an entry into the remote one with WATCH/MULTI: a concurrent writer makes
        the transaction fail and it is redone on what that writer published."""
        if not self.available():
            return False
        try:
            from redis.exceptions import WatchError

            mkey = self._mkey(kind, key)
            with self.client().pipeline(transaction=True) as pipe:
                for _ in range(attempts):
                    try:
                        pipe.watch(mkey)
                        raw = pipe.get(mkey)
                        old, old_files = None, {}
                        if raw is not None:
                            try:
                                body = self._parse_record(kind, key, raw)
                                old_files = self._fetch_blobs(pipe, kind, key, body)
                                old = body["manifest"]
                            except RemoteError as exc:  # garbage (or evicted blobs): nothing to keep
                                log.info("npu_cached: remote %s/%s replaced: %s", kind, key[:12], exc)
                        merged, merged_files = merger(old, old_files, manifest, files)
                        raw_new, blobs = self._record(kind, key, merged_files, merged)
                        self._set_bounded(self.client(), blobs)  # content-addressed: only the record is swapped
                        pipe.multi()
                        pipe.set(mkey, raw_new)
                        pipe.execute()
                        self._refused.discard((kind, key))
                        record(remote_bytes_out=len(raw_new) + sum(len(v) for v in blobs.values()), remote_published=1)
                        return True
                    except WatchError:
                        time.sleep(0.005)
                        continue
            raise RemoteError("contended", f"{kind}/{key[:12]} kept changing during {attempts} merge attempts")
        except Exception as exc:  # noqa: BLE001
            self.fault(exc, f"merge {kind}/{key[:12]}")
            return False

    def keys(self, kind: str) -> list[str]:
        """Keys of the records of ``kind`` (SCAN; for ``explain``)."""
        pattern = self._mkey(kind, "*")
        head = len(self._mkey(kind, ""))
        out = [k.decode() if isinstance(k, bytes) else k for k in self.client().scan_iter(match=pattern, count=500)]
        return sorted(k[head:] for k in out)

    def read_manifest(self, kind: str, key: str) -> dict[str, Any] | None:
        """The manifest fields of a record, its signature checked (for ``explain``); raises on faults."""
        raw = self.client().get(self._mkey(kind, key))
        return None if raw is None else self._parse_record(kind, key, raw)["manifest"]

    # -- fleet-wide single flight -------------------------------------------
    @contextlib.contextmanager
    def compile_lock(self, kind: str, key: str, default_wait: float) -> Iterator[bool]:
        """Hold the fleet-wide lock of ``kind/key`` while compiling it.

        Yields True when this node holds it (compile, publish, release), False when it
        should not compile under it: the entry appeared meanwhile (load it), the wait
        bound passed, or the remote failed. The lease is renewed by a thread while the
        block runs, so it outlives long compiles but expires ``lease`` seconds after the
        holder dies or is stopped."""
        token = self._acquire(kind, key, default_wait)
        if token is None:
            yield False
            return
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(kind, key, token, stop), daemon=True,
                                   name=f"tcb-lease-{key[:8]}")
        renewer.start()
        try:
            yield True
        finally:
            stop.set()
            renewer.join(timeout=float(self.params["timeout"]) * 2)
            with contextlib.suppress(Exception):
                self.client().eval(_RELEASE_LUA, 1, self._lkey(kind, key), token)

    def _acquire(self, kind: str, key: str, default_wait: float) -> str | None:
        if not self.available():
            return None
        wait = float(self.params["wait"] if self.params["wait"] is not None else default_wait)
        lease_ms = int(float(self.params["lease"]) * 1000)
        token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        lkey, mkey = self._lkey(kind, key), self._mkey(kind, key)
        t0 = time.monotonic()
        pause = 0.02
        holder = None
        try:
            conn = self.client()
            while True:
                if conn.set(lkey, token, nx=True, px=lease_ms):
                    if conn.exists(mkey):  # published between our miss and the lock: load it
                        conn.eval(_RELEASE_LUA, 1, lkey, token)
                        return None
                    return token
                if conn.exists(mkey):
                    return None
                holder = conn.get(lkey) or holder
                if time.monotonic() - t0 >= wait:
                    warn_once(f"remote-wait:{self.url}", "npu_cached: waited %.0fs for %s (held by %s on the remote "
                              "cache); compiling here", wait, f"{kind}/{key[:12]}",
                              holder.decode(errors="replace") if isinstance(holder, bytes) else holder)
                    return None
                time.sleep(pause)
                pause = min(pause * 1.5, 0.5)
        except Exception as exc:  # noqa: BLE001
            self.fault(exc, f"take the compile lock of {kind}/{key[:12]}")
            return None
        finally:
            waited = time.monotonic() - t0
            if waited > 0.05:
                log.info("npu_cached: waited %.2fs on the remote lock of %s/%s", waited, kind, key[:12])

    def _renew(self, kind: str, key: str, token: str, stop: threading.Event) -> None:
        lease = float(self.params["lease"])
        while not stop.wait(lease / 3):
            try:
                if not self.client().eval(_RENEW_LUA, 1, self._lkey(kind, key), token, int(lease * 1000)):
                    return  # lost it (expired while we were stopped): the other node compiles too
            except Exception:  # noqa: BLE001 - the lease then simply expires
                return


_REMOTES: dict[str, RedisRemote] = {}
_REMOTES_LOCK = threading.Lock()


def remote_for(url: str) -> RedisRemote:
    """The process-wide client of ``url`` (one connection pool per server)."""
    with _REMOTES_LOCK:
        found = _REMOTES.get(url)
        if found is None:
            found = _REMOTES[url] = RedisRemote(url)
        return found
