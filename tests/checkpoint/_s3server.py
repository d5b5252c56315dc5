"""A real S3-compatible server on loopback for the remote-tier tests: moto in server mode, in a thread.

``S3Server`` wraps :class:`moto.server.ThreadedMotoServer` with what a fault drill needs and moto lacks:

* :meth:`S3Server.kill` is a hard outage: the listening socket is closed (new connections are refused) and every
  open keep-alive connection is shut down (a pooled client connection does not keep working). moto's own
  ``stop()`` only leaves the accept loop, so connections would queue in the backlog or keep being served.
* :meth:`S3Server.start` again binds the same port: the store "comes back" at the same endpoint.

The moto backend lives in this process, so the store's contents survive a kill/start cycle (like a real S3 outage:
the data is still there when the endpoint answers again); :meth:`S3Server.reset` empties it.

Fixtures (import them into a test module): ``s3_server`` (one per module), ``s3`` (per test: empty store, one
bucket, authentication off) and ``own_s3`` (a private server a test may kill).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

# optional: without them the fixtures skip, and the test module's other tests (file://, memory://) still run
try:
    import boto3
    import s3fs  # noqa: F401
    from moto.moto_server import werkzeug_app
    from moto.server import ThreadedMotoServer
    from werkzeug.serving import BaseWSGIServer, make_server
except ImportError as _err:
    MISSING: str | None = f"S3 tests need `pip install 'moto[server]' s3fs` ({_err})"
    ThreadedMotoServer = object
    _MotoRequestHandler: Any = object
else:
    MISSING = None
    _MotoRequestHandler = werkzeug_app.MotoRequestHandler

__all__ = ["BUCKET", "MISSING", "S3Endpoint", "S3Server", "own_s3", "s3", "s3_server"]

BUCKET = "ckpt"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
_HTTP_TIMEOUT_S = 10.0

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise


class _TrackingHandler(_MotoRequestHandler):
    """Remembers its connection, so a kill can cut keep-alive connections that outlive the accept loop."""

    def setup(self) -> None:
        super().setup()
        self.server.live_connections.add(self.connection)  # type: ignore[attr-defined]

    def finish(self) -> None:
        self.server.live_connections.discard(self.connection)  # type: ignore[attr-defined]
        super().finish()


class S3Server(ThreadedMotoServer):  # type: ignore[misc]
    """moto's threaded server with a hard :meth:`kill` and a restart on the same port."""

    def __init__(self, port: int = 0) -> None:
        super().__init__(ip_address="127.0.0.1", port=port, verbose=False)
        self.port = port

    def _server_entry(self) -> None:
        # as ThreadedMotoServer._server_entry, with a handler that tracks connections
        app = werkzeug_app.DomainDispatcherApplication(werkzeug_app.create_backend_app)
        server: BaseWSGIServer = make_server(
            self._ip_address, self._port, app, threaded=True, request_handler=_TrackingHandler
        )
        server.live_connections = set()  # type: ignore[attr-defined]
        self._server = server
        self._server_ready_event.set()
        server.serve_forever(poll_interval=0.05)

    def start(self) -> None:
        super().start()
        self.port = self.get_host_and_port()[1]
        self._port = self.port  # a restart binds the same port

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def kill(self) -> None:
        """Hard outage: refuse new connections and cut the open ones. Idempotent."""
        server = self._server
        if server is None:
            return
        self._server = None
        self._server_ready_event.clear()  # a later start() waits for the new server, not this one
        server.shutdown()  # leaves serve_forever (bounded: it polls every 50 ms)
        server.server_close()  # closes the listening socket: connects are now refused
        for conn in list(server.live_connections):  # type: ignore[attr-defined]
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        assert self._thread is not None
        self._thread.join(timeout=_HTTP_TIMEOUT_S)
        assert not self._thread.is_alive(), "moto server thread did not stop"

    def stop(self) -> None:
        self.kill()

    def _post(self, path: str, body: bytes = b"") -> Any:
        request = urllib.request.Request(
            f"{self.endpoint}{path}", data=body, method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as response:
            text = response.read()
        return json.loads(text) if text else None

    def reset(self) -> None:
        """Empty every moto backend (buckets, IAM users) and turn authentication off."""
        self._post("/moto-api/reset")
        self.set_auth(False)

    def set_auth(self, enabled: bool) -> None:
        """With auth on, every request is checked against moto's IAM: unknown keys and bad signatures fail."""
        self._post("/moto-api/reset-auth", b"0" if enabled else b"inf")

    def client(self, service: str = "s3", **creds: str) -> Any:
        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=creds.get("key", ACCESS_KEY),
            aws_secret_access_key=creds.get("secret", SECRET_KEY),
        )


@dataclass
class S3Endpoint:
    """What a test needs to reach the server: URL prefix pieces and s3fs storage options."""

    server: S3Server
    bucket: str = BUCKET
    key: str = ACCESS_KEY
    secret: str = SECRET_KEY
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def endpoint_url(self) -> str:
        return self.server.endpoint

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        """s3fs options: this endpoint, these credentials, no stale caches, and no retries below the tier's own.

        botocore's and s3fs's retries would sleep for real; the tier's retry loop (with an injected sleep) is the
        one under test.
        """
        options: dict[str, Any] = {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
            "config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 5, "read_timeout": 10},
            "skip_instance_cache": True,
            "use_listings_cache": False,
        }
        options.update(self.extra)
        options.update(overrides)
        return options

    def url(self, prefix: str = "run") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key in the bucket under ``prefix``, read with boto3 (not through the code under test)."""
        listing = self.server.client().list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return sorted(obj["Key"] for obj in listing.get("Contents", []))

    def create_bucket(self) -> None:
        client = self.server.client()
        try:
            client.create_bucket(Bucket=self.bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass


@contextlib.contextmanager
def black_hole(endpoint: S3Endpoint) -> Iterator[None]:
    """The store stops answering: the server is killed and its port listens without ever accepting, so every
    request connects and then waits for an answer that never comes (a hung endpoint, not a refused one)."""
    endpoint.server.kill()
    with socket.create_server(("127.0.0.1", endpoint.server.port), backlog=64):
        yield


def _started(port: int = 0) -> S3Server:
    if MISSING is not None:
        pytest.skip(MISSING)
    server = S3Server(port)
    server.start()
    return server


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    """One moto server for the module (starting one costs a fraction of a second; its first request more)."""
    server = _started()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def s3(s3_server: S3Server) -> Iterator[S3Endpoint]:
    """An empty store with one bucket and authentication off."""
    if not s3_server.running:  # an earlier test killed the shared server and failed before restarting it
        s3_server.start()
    s3_server.reset()
    endpoint = S3Endpoint(s3_server)
    endpoint.create_bucket()
    yield endpoint
    if s3_server.running:
        s3_server.set_auth(False)


@pytest.fixture
def own_s3() -> Iterator[S3Endpoint]:
    """A private server with one bucket, for tests that kill and restart it."""
    server = _started()
    try:
        server.reset()
        endpoint = S3Endpoint(server)
        endpoint.create_bucket()
        yield endpoint
    finally:
        server.kill()
