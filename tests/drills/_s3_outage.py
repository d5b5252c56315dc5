"""The S3 store of the campaign's ``s3-outage`` drills: moto on loopback in the campaign's process
(``tests/checkpoint/_s3server.py``), and a control socket through which a rank, as its upload starts, has the server
killed (listening socket closed, open connections cut) and started again on the same port some seconds later.

The ranks find both through the environment: :data:`ENDPOINT_ENV` (the store's URL) and :data:`CONTROL_ENV` (the
control socket's path). A request is one line, ``outage <seconds>``; the answer ``down`` comes once the server is
dead, and the server is back ``seconds`` later. The store's contents survive (the backend lives in this process), as a
real store's do across an outage of its endpoint.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from tests.checkpoint._s3server import BUCKET, S3Endpoint, S3Server

ENDPOINT_ENV = "LR_DRILL_S3_ENDPOINT"
CONTROL_ENV = "LR_DRILL_S3_CONTROL"
REQUEST_TIMEOUT_S = 30.0


class S3Outages:
    """A moto server, and the control socket that cuts it on request (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.server = S3Server()
        self.server.start()
        S3Endpoint(self.server).create_bucket()
        self.path = root / "s3-control.sock"
        self.path.unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        self._listener.listen()
        self._closing = threading.Event()
        self.outages: list[float] = []
        self._thread = threading.Thread(target=self._serve, name="s3-outages", daemon=True)
        self._thread.start()

    @property
    def env(self) -> dict[str, str]:
        return {ENDPOINT_ENV: self.server.endpoint, CONTROL_ENV: str(self.path)}

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(REQUEST_TIMEOUT_S)
                try:
                    verb, seconds = conn.recv(64).decode().split()
                    assert verb == "outage", verb
                    self.server.kill()
                    conn.sendall(b"down\n")
                except (OSError, ValueError, AssertionError):
                    continue
            self.outages.append(float(seconds))
            # the outage lasts this long (it is the fault's duration, not a wait for something to happen)
            self._closing.wait(float(seconds))
            self.server.start()

    def close(self) -> None:
        self._closing.set()
        self._listener.close()
        self._thread.join(timeout=REQUEST_TIMEOUT_S)
        self.server.kill()
        self.path.unlink(missing_ok=True)


@contextlib.contextmanager
def s3_outages(root: Path) -> Iterator[S3Outages]:
    outages = S3Outages(root)
    try:
        yield outages
    finally:
        outages.close()


def request_outage(control: str, seconds: float) -> None:
    """From a rank: cut the store for ``seconds``; returns once it is down."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(REQUEST_TIMEOUT_S)
        conn.connect(control)
        conn.sendall(f"outage {seconds}\n".encode())
        if conn.recv(16).strip() != b"down":
            raise RuntimeError("the campaign did not take the S3 server down")


def storage_overrides(endpoint: str, prefix: str, every_n_steps: int) -> list[str]:
    """Hydra overrides of ``resilience/checkpoint=tiered_s3`` for this store: its endpoint, a prefix per drill, the
    drill's upload cadence, and no retries below the tier's own (botocore's would sleep on their own clock)."""
    tier = "resilience.checkpoint.tiers.2"
    return [
        "resilience/checkpoint=tiered_s3",
        f"{tier}.every_n_steps={every_n_steps}",
        f"{tier}.url=s3://{BUCKET}/{prefix}",
        f"+{tier}.storage_options.key=testing",
        f"+{tier}.storage_options.secret=testing",
        f"+{tier}.storage_options.client_kwargs.endpoint_url='{endpoint}'",
        f"+{tier}.storage_options.client_kwargs.region_name=us-east-1",
        f"+{tier}.storage_options.config_kwargs.retries.total_max_attempts=1",
        f"+{tier}.storage_options.config_kwargs.connect_timeout=5",
        f"+{tier}.storage_options.config_kwargs.read_timeout=10",
        f"+{tier}.storage_options.use_listings_cache=false",
    ]


def committed_in_store(endpoint: str, prefix: str) -> dict[int, list[int]]:
    """Step -> ranks whose shard has its manifest in the store (the remote tier's commit point)."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    out: dict[int, list[int]] = {}
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")
    for obj in listing.get("Contents", []):
        parts = obj["Key"].split("/")  # prefix/step_.../rank_.../manifest.json
        if len(parts) == 4 and parts[3] == "manifest.json":
            out.setdefault(int(parts[1].removeprefix("step_")), []).append(int(parts[2].removeprefix("rank_")))
    return {step: sorted(ranks) for step, ranks in out.items()}
