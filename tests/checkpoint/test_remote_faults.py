"""RemoteTier when the store fails: a server killed mid-upload, transient faults retried with capped backoff, a store
that stays down or never answers, wrong credentials and a missing bucket named, and how each error is classified.

Every outage here is real: the server's sockets are closed while the tier talks to it (moto in server mode on
loopback). Retries wait through an injected ``sleep`` that records the delays, so nothing in this file sleeps; every
other wait is bounded.
"""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lightning_resilience.checkpoint.local import step_dirname
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.remote import RemoteFault, RemoteTierError, classify_error
from tests.checkpoint import _s3server
from tests.checkpoint._remote import Sleeps, bound, remote_tier, s3_tier, started, step_keys, train
from tests.checkpoint._s3server import S3Endpoint
from tests.checkpoint.conftest import (
    assert_state_equal,
    assert_tensors_equal,
    make_snapshot,
    make_state,
)

# the server fixtures live in a helper module (other test modules may share them): expose them to pytest here
s3_server = _s3server.s3_server
s3 = _s3server.s3
own_s3 = _s3server.own_s3


# ------------------------------------------------------------------------------------------------ S3: outages
def test_server_killed_mid_upload_is_counted_and_training_continues(
    own_s3: S3Endpoint, managers: list[CheckpointManager]
) -> None:
    """The store dies after the first file of step 3; training goes on; when it is back the next step uploads."""
    sleeps = Sleeps()
    remote = s3_tier(own_s3, sleeps, retries=2)
    real_upload = remote._upload
    uploads = {"step3": 0}

    def upload(local: Path, key: str) -> None:
        real_upload(local, key)
        if f"/{step_dirname(3)}/" in key:
            uploads["step3"] += 1
            if uploads["step3"] == 1:
                own_s3.server.kill()  # a real outage: sockets closed under the client

    remote._upload = upload  # type: ignore[method-assign]
    manager = started(managers, [MemoryTier(keep=1), remote])
    train(manager, range(1, 4))
    stats = manager.stats.tiers["remote"]
    assert (stats.writes, stats.failures) == (2, 1)
    assert stats.last_error is not None and "unreachable" in stats.last_error
    assert own_s3.endpoint_url in stats.last_error and "tiers.remote.url=s3://ckpt/run" in stats.last_error
    assert uploads["step3"] == 1 and remote.retries_total == 2 and len(sleeps.delays) == 2

    # still down: the training thread gets the committed steps from memory, without a request
    retries_before = remote.retries_total
    assert remote.list_steps() == [1, 2]
    assert remote.retries_total == retries_before
    train(manager, range(4, 5))  # snapshot taken, remote write fails again, training continues
    assert (stats.writes, stats.failures) == (2, 2)
    assert manager.stats.tiers["memory"].writes == 4

    own_s3.server.start()  # the store comes back on the same endpoint, with its data
    train(manager, range(5, 6))
    assert (stats.writes, stats.failures) == (3, 2) and stats.last_step == 5
    assert remote.list_steps() == [2, 5]  # keep=2 over what was committed
    manager.close()

    fresh = started(managers, [s3_tier(own_s3)])
    assert step_keys(own_s3, 3) == []  # the half-uploaded step 3 was cleaned up at bind
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (5, "remote")
    assert_state_equal(restored.state, make_state(5))


def test_transient_faults_are_retried_with_capped_exponential_backoff(s3: S3Endpoint) -> None:
    """503 SlowDown, throttling, a refused connection and a timeout are retried; waits double up to the cap."""
    sleeps = Sleeps()
    tier = bound(s3_tier(s3, sleeps, retries=5, backoff_s=0.5, max_backoff_s=1.5))
    from botocore.exceptions import EndpointConnectionError

    faults: list[BaseException] = [
        _client_error("SlowDown", 503),
        _client_error("Throttling", 400),
        EndpointConnectionError(endpoint_url=s3.endpoint_url),
        TimeoutError("timed out"),
    ]
    real_op = tier._op

    def op(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "put_file" and faults:
            raise faults.pop(0)
        return real_op(method, *args, **kwargs)

    tier._op = op  # type: ignore[method-assign]
    tier.write(make_snapshot(1))
    assert tier.list_steps() == [1]
    assert tier.retries_total == 4
    for attempt, delay in enumerate(sleeps.delays):
        ceiling = min(1.5, 0.5 * 2**attempt)
        assert ceiling / 2 <= delay <= ceiling, (attempt, delay)
    assert_tensors_equal(tier.read(1).tensors, make_snapshot(1).tensors)


def test_retries_give_up_with_an_oserror_when_the_store_stays_down(own_s3: S3Endpoint) -> None:
    """With the server gone every operation is tried ``retries + 1`` times, then fails as RemoteTierError."""
    sleeps = Sleeps()
    tier = bound(s3_tier(own_s3, sleeps, retries=3))
    own_s3.server.kill()
    with pytest.raises(RemoteTierError) as info:
        tier.write(make_snapshot(1))
    assert isinstance(info.value, OSError)
    assert info.value.fault is RemoteFault.TRANSIENT and info.value.attempts == 4
    assert tier.retries_total == 3 and len(sleeps.delays) == 3
    with pytest.raises(RemoteTierError):  # a read is retried too, then reported as an OSError
        s3_tier(own_s3, sleeps, retries=1).read(1)


def test_a_store_that_never_answers_is_bounded_by_timeout_s(s3: S3Endpoint) -> None:
    """An endpoint that accepts connections and then stays silent: each call gives up after timeout_s."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:  # listens, never accepts: a black hole
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        options = s3.storage_options(
            client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
            config_kwargs={"retries": {"total_max_attempts": 1}, "connect_timeout": 60, "read_timeout": 60},
        )
        sleeps = Sleeps()
        tier = remote_tier(s3.url(), sleeps, storage_options=options, retries=1, timeout_s=0.5)
        with pytest.raises(RemoteTierError) as info:
            tier.read(1)
    assert info.value.fault is RemoteFault.TRANSIENT and info.value.attempts == 2
    assert "Timeout" in str(info.value) and endpoint in str(info.value)
    assert len(sleeps.delays) == 1


# ------------------------------------------------------------------------------------------------ S3: misconfiguration
def _iam_user(s3: S3Endpoint) -> tuple[str, str]:
    """A user allowed everything on S3, created while authentication is still off."""
    iam = s3.server.client("iam")
    iam.create_user(UserName="trainer")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]


@pytest.mark.parametrize("bad", ["wrong-secret", "unknown-key"])
def test_wrong_credentials_name_the_setting(s3: S3Endpoint, managers: list[CheckpointManager], bad: str) -> None:
    """With moto's IAM auth on, good keys work and bad ones fail at once (no retries) with a message saying what
    to fix; through the manager that is a counted failure, and listing does not raise."""
    key, secret = _iam_user(s3)
    s3.server.set_auth(True)
    good = bound(s3_tier(s3, storage_options=s3.storage_options(key=key, secret=secret)))
    good.write(make_snapshot(1))
    assert good.list_steps() == [1]

    creds = {"key": key, "secret": "not-the-secret"} if bad == "wrong-secret" else {"key": "AKIAUNKNOWN000000000"}
    sleeps = Sleeps()
    remote = s3_tier(s3, sleeps, storage_options=s3.storage_options(**creds))
    with pytest.raises(RemoteTierError) as info:
        bound(remote).write(make_snapshot(2))
    message = str(info.value)
    assert info.value.fault is RemoteFault.CREDENTIALS
    assert f"credentials rejected by {s3.endpoint_url} for tiers.remote.url=s3://ckpt/run" in message
    assert "check tiers.remote.storage_options (key/secret) or AWS_* env" in message
    assert remote.retries_total == 0 and sleeps.delays == []
    assert remote.list_steps() == []  # logged, not raised: a restore can still use another tier
    with pytest.raises(RemoteTierError, match="credentials rejected"):
        remote.read(1)

    manager = started(managers, [MemoryTier(keep=1), s3_tier(s3, storage_options=s3.storage_options(**creds))])
    train(manager, range(2, 4))
    stats = manager.stats.tiers["remote"]
    assert (stats.writes, stats.failures) == (0, 2) and manager.stats.tiers["memory"].writes == 2
    assert stats.last_error is not None and "tiers.remote.storage_options" in stats.last_error


def test_missing_bucket_is_named_and_not_created(s3: S3Endpoint, managers: list[CheckpointManager]) -> None:
    """A URL whose bucket does not exist fails without retries, naming bucket and key, and creates no bucket."""
    sleeps = Sleeps()
    url = "s3://no-such-bucket/run"
    tier = bound(remote_tier(url, sleeps, storage_options=s3.storage_options()))
    with pytest.raises(RemoteTierError) as info:
        tier.write(make_snapshot(1))
    assert info.value.fault is RemoteFault.NO_BUCKET
    assert f"bucket 'no-such-bucket' does not exist (tiers.remote.url={url})" in str(info.value)
    assert tier.retries_total == 0 and sleeps.delays == []
    assert tier.list_steps() == []
    buckets = [b["Name"] for b in s3.server.client().list_buckets()["Buckets"]]
    assert buckets == [s3.bucket]

    manager = started(managers, [MemoryTier(keep=1), remote_tier(url, storage_options=s3.storage_options())])
    train(manager, range(1, 2))
    stats = manager.stats.tiers["remote"]
    assert stats.failures == 1 and stats.last_error is not None and "no-such-bucket" in stats.last_error


# ------------------------------------------------------------------------------------------------ classification
def _client_error(code: str, status: int) -> Exception:
    """botocore's ClientError as the S3 API returns it."""
    from botocore.exceptions import ClientError

    response = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "PutObject")  # type: ignore[arg-type]


def _translated(code: str, status: int, exc: Callable[[str], OSError]) -> Callable[[], OSError]:
    """What s3fs raises: a builtin OSError whose cause is botocore's ClientError."""

    def make() -> OSError:
        err = exc(code)
        err.__cause__ = _client_error(code, status)
        return err

    return make


def _botocore(name: str, **kwargs: Any) -> Callable[[], Exception]:
    def make() -> Exception:
        from botocore import exceptions

        error: Exception = getattr(exceptions, name)(**kwargs)
        return error

    return make


@pytest.mark.parametrize(
    ("make", "fault"),
    [
        (lambda: _client_error("SlowDown", 503), RemoteFault.TRANSIENT),
        (lambda: _client_error("InternalError", 500), RemoteFault.TRANSIENT),
        (lambda: _client_error("ThrottlingException", 400), RemoteFault.TRANSIENT),
        (lambda: _client_error("TooManyRequests", 429), RemoteFault.TRANSIENT),
        (_translated("SlowDown", 503, lambda m: OSError(errno.EBUSY, m)), RemoteFault.TRANSIENT),
        (_botocore("EndpointConnectionError", endpoint_url="http://x"), RemoteFault.TRANSIENT),
        (_botocore("ReadTimeoutError", endpoint_url="http://x"), RemoteFault.TRANSIENT),
        (lambda: ConnectionRefusedError(errno.ECONNREFUSED, "refused"), RemoteFault.TRANSIENT),
        (lambda: TimeoutError(), RemoteFault.TRANSIENT),
        (lambda: OSError(errno.EIO, "i/o error"), RemoteFault.TRANSIENT),
        (lambda: _client_error("InvalidAccessKeyId", 403), RemoteFault.CREDENTIALS),
        (_translated("SignatureDoesNotMatch", 403, PermissionError), RemoteFault.CREDENTIALS),
        (_botocore("NoCredentialsError"), RemoteFault.CREDENTIALS),
        (_translated("NoSuchBucket", 404, FileNotFoundError), RemoteFault.NO_BUCKET),
        (_translated("NoSuchKey", 404, FileNotFoundError), RemoteFault.NOT_FOUND),
        (lambda: _client_error("InvalidArgument", 400), RemoteFault.PERMANENT),
        (lambda: OSError(errno.ENOSPC, "no space"), RemoteFault.PERMANENT),
        (lambda: ValueError("a bug"), RemoteFault.BUG),
    ],
)
def test_errors_are_classified(make: Callable[[], BaseException], fault: RemoteFault) -> None:
    """What is retried, what names the credentials or the bucket, and what is a bug re-raised as is."""
    pytest.importorskip("botocore")
    assert classify_error(make()) is fault
