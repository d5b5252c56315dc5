"""RemoteTier against a real S3-compatible server on loopback (moto in server mode) and against file:// URLs.

Every outage here is real: the server's sockets are closed while the tier talks to it. Retries wait through an
injected ``sleep`` that records the delays, so nothing in this file sleeps; every other wait is bounded.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import MANIFEST
from lightning_resilience.checkpoint.local import LocalTier, step_dirname
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.remote import RemoteFault, RemoteTier, RemoteTierError, classify_error
from lightning_resilience.checkpoint.tier import Durability, Tier, TierIdentity
from tests.checkpoint import _s3server
from tests.checkpoint._s3server import S3Endpoint
from tests.checkpoint.conftest import (
    assert_state_equal,
    assert_tensors_equal,
    data_file,
    flip_byte,
    make_snapshot,
    make_state,
    state_at,
)

# the server fixtures live in a helper module (other test modules may share them): expose them to pytest here
s3_server = _s3server.s3_server
s3 = _s3server.s3
own_s3 = _s3server.own_s3

_WAIT = timedelta(seconds=30)


class Sleeps:
    """The injected ``sleep``: records every backoff instead of waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def _tier(url: str, sleeps: Sleeps | None = None, **kwargs: Any) -> RemoteTier:
    kwargs.setdefault("every_n_steps", 1)
    kwargs.setdefault("keep", 2)
    tier = RemoteTier(url, sleep=sleeps or Sleeps(), **kwargs)
    if hasattr(tier.fs, "retries"):
        tier.fs.retries = 1  # s3fs retries some errors itself, sleeping for real; the tier's own loop is under test
    return tier


def _s3_tier(s3: S3Endpoint, sleeps: Sleeps | None = None, *, prefix: str = "run", **kwargs: Any) -> RemoteTier:
    kwargs.setdefault("storage_options", s3.storage_options())
    return _tier(s3.url(prefix), sleeps, **kwargs)


def _bound(tier: RemoteTier, rank: int = 0, world_size: int = 1) -> RemoteTier:
    tier.bind(TierIdentity(rank, world_size))
    return tier


def _started(managers: list[CheckpointManager], tiers: list[Tier]) -> CheckpointManager:
    manager = CheckpointManager(tiers, CheckpointConfig(drain_timeout_s=_WAIT.total_seconds()))
    manager.setup()
    managers.append(manager)
    return manager


def _train(manager: CheckpointManager, steps: range) -> None:
    for step in steps:
        assert manager.on_step(step, state_at(step), meta={"epoch": step // 3}) is True
        assert manager.wait(_WAIT) is True


def _remote(manager: CheckpointManager) -> RemoteTier:
    (tier,) = [t for t in manager.tiers if isinstance(t, RemoteTier)]
    return tier


def _step_keys(s3: S3Endpoint, step: int, prefix: str = "run") -> list[str]:
    return s3.keys(f"{prefix}/{step_dirname(step)}/")


# ------------------------------------------------------------------------------------------------ construction
def test_remote_tier_satisfies_the_tier_protocol(tmp_path: Path) -> None:
    """RemoteTier is usable wherever a Tier is expected, and ranks as the most durable tier."""
    tier = RemoteTier(f"file://{tmp_path}")
    assert isinstance(tier, Tier)
    assert tier.durability is Durability.remote and tier.durability.level > LocalTier(tmp_path).durability.level
    assert (tier.name, tier.every_n_steps, tier.keep, tier.retries_total) == ("remote", 500, 3, 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"url": ""}, r"tiers\.remote\.url must be an fsspec URL"),
        ({"url": "   "}, r"tiers\.remote\.url must be an fsspec URL"),
        ({"url": "nosuchproto://bucket/run"}, r"tiers\.remote\.url has an unknown protocol 'nosuchproto'"),
        ({"url": "memory://"}, r"tiers\.remote\.url must name a bucket or directory, got 'memory://'"),
        ({"url": "memory://x", "every_n_steps": -1}, r"tiers\.remote\.every_n_steps"),
        ({"url": "memory://x", "keep": 0}, r"tiers\.remote\.keep"),
        ({"url": "memory://x", "retries": -1}, r"tiers\.remote\.retries"),
        ({"url": "memory://x", "backoff_s": -1.0}, r"tiers\.remote\.backoff_s"),
        ({"url": "memory://x", "backoff_s": 2.0, "max_backoff_s": 1.0}, r"tiers\.remote\.max_backoff_s"),
        ({"url": "memory://x", "timeout_s": 0}, r"tiers\.remote\.timeout_s"),
        ({"url": "memory://x", "storage_options": ["key"]}, r"tiers\.remote\.storage_options must be a mapping"),
    ],
)
def test_invalid_settings_are_rejected_naming_the_key(kwargs: dict[str, Any], match: str) -> None:
    """A bad value fails at construction, with a ValueError naming the config key (and no network involved)."""
    with pytest.raises(ValueError, match=match):
        RemoteTier(**kwargs)


def test_a_custom_name_is_used_in_messages() -> None:
    with pytest.raises(ValueError, match=r"tiers\.s3_backup\.url"):
        RemoteTier("bogus-proto://x", name="s3_backup")


# ------------------------------------------------------------------------------------------------ file:// URLs
def test_file_url_round_trip_through_the_manager(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """A shared-file-system URL: LocalTier's layout, retention, and a bitwise restore in a fresh manager."""
    root = tmp_path / "shared"
    url = f"file://{root}"
    manager = _started(managers, [MemoryTier(keep=1), _tier(url)])
    _train(manager, range(1, 5))
    assert _remote(manager).list_steps() == [3, 4]
    assert sorted(p.name for p in root.iterdir()) == [step_dirname(3), step_dirname(4)]
    shard = root / step_dirname(4) / "rank_00000"
    assert sorted(p.name for p in shard.iterdir()) == [".metadata", "__0_0.distcp", MANIFEST, "skeleton.json"]
    manager.close()

    fresh = _started(managers, [_tier(url)])
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (4, "remote")
    assert restored.meta == {"epoch": 1}
    assert_state_equal(restored.state, make_state(4))


@pytest.mark.parametrize("protocol", ["file", "memory"])
def test_write_list_read_delete(tmp_path: Path, protocol: str) -> None:
    """The Tier contract on its own: rewrite replaces whole, delete un-commits then removes, both idempotent."""
    url = f"file://{tmp_path}/ckpt" if protocol == "file" else f"memory://{tmp_path.name}/ckpt"
    tier = _bound(_tier(url))
    assert tier.list_steps() == []  # root not created yet: nothing, not an error
    for step in (5, 1, 3):
        tier.write(make_snapshot(step))
    assert tier.list_steps() == [1, 3, 5]
    newer = make_snapshot(9)
    newer.step = 3
    tier.write(newer)  # a rewrite after a rollback
    assert_tensors_equal(tier.read(3).tensors, newer.tensors)
    tier.delete(3)
    tier.delete(3)
    assert tier.list_steps() == [1, 5]
    with pytest.raises(CheckpointCorruptError, match="not committed"):
        tier.read(3)
    remaining = [str(p) for p in tier.fs.find(tier.root)]
    assert not any(step_dirname(3) in p or ".tmp-" in p for p in remaining), remaining
    if protocol == "file":
        assert not (tmp_path / "ckpt" / step_dirname(3)).exists()  # the emptied step directory is gone too
    else:
        tier.fs.rm(tier.root, recursive=True)  # the memory store is process-wide


def test_read_validates_like_the_local_tier(tmp_path: Path) -> None:
    """A flipped byte, a manifest naming a path outside the shard, another world size: all refused, named."""
    root = tmp_path / "ckpt"
    writer = _bound(_tier(f"file://{root}"), rank=0, world_size=2)
    for step in (1, 2, 3):
        writer.write(make_snapshot(step))
    shard = root / step_dirname(1) / "rank_00000"
    flip_byte(data_file(shard))
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as info:
        writer.read(1)
    assert f"file://{shard}" in str(info.value)  # the store's location, not the temporary download

    manifest = json.loads((root / step_dirname(2) / "rank_00000" / MANIFEST).read_text())
    manifest["files"]["../../escape"] = {"size": 1, "xxh3_64": "0"}
    (root / step_dirname(2) / "rank_00000" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match="outside the shard"):
        writer.read(2)

    reader = _bound(_tier(f"file://{root}"), rank=0, world_size=4)
    with pytest.raises(CheckpointCorruptError, match="world size 2"):
        reader.read(3)


# ------------------------------------------------------------------------------------------------ S3: round trip
def test_s3_round_trip_through_the_manager(s3: S3Endpoint, managers: list[CheckpointManager]) -> None:
    """Memory + S3 tiers: uploads run on the persist worker, retention holds, a fresh manager restores bitwise."""
    upload_threads: set[str] = set()
    remote = _s3_tier(s3)
    real_upload = remote._upload

    def upload(local: Path, key: str) -> None:
        upload_threads.add(threading.current_thread().name)
        real_upload(local, key)

    remote._upload = upload  # type: ignore[method-assign]
    manager = _started(managers, [MemoryTier(keep=1), remote])
    _train(manager, range(1, 5))
    assert upload_threads == {"lr-persist"}  # never the training thread
    assert remote.list_steps() == [3, 4]
    assert manager.stats.tiers["remote"].writes == 4 and manager.stats.tiers["remote"].failures == 0
    assert s3.keys() == [
        f"run/{step_dirname(step)}/rank_00000/{name}"
        for step in (3, 4)
        for name in (".metadata", "__0_0.distcp", MANIFEST, "skeleton.json")
    ]
    manager.close()

    fresh = _started(managers, [MemoryTier(keep=1), _s3_tier(s3)])
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (4, "remote")
    assert_state_equal(restored.state, make_state(4))
    assert fresh.stats.skipped_corrupt == []


def test_ranks_keep_to_their_own_shards(s3: S3Endpoint) -> None:
    """Two ranks share a prefix: each lists, reads and deletes only its own shard of a step."""
    rank0 = _bound(_s3_tier(s3), rank=0, world_size=2)
    rank1 = _bound(_s3_tier(s3), rank=1, world_size=2)
    rank0.write(make_snapshot(1))
    rank0.write(make_snapshot(2))
    rank1.write(make_snapshot(2))
    assert (rank0.list_steps(), rank1.list_steps()) == ([1, 2], [2])
    rank0.delete(2)
    assert (rank0.list_steps(), rank1.list_steps()) == ([1], [2])
    assert_tensors_equal(rank1.read(2).tensors, make_snapshot(2).tensors)
    with pytest.raises(CheckpointCorruptError, match="not committed"):
        rank1.read(1)


def test_corrupt_object_in_the_bucket_is_refused(s3: S3Endpoint) -> None:
    """A data object changed in the store (same size) fails the checksum on read; the error names the S3 URL."""
    tier = _bound(_s3_tier(s3))
    tier.write(make_snapshot(1))
    client = s3.server.client()
    key = f"run/{step_dirname(1)}/rank_00000/__0_0.distcp"
    data = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as info:
        tier.read(1)
    assert f"s3://{s3.bucket}/run/{step_dirname(1)}/rank_00000" in str(info.value)


# ------------------------------------------------------------------------------------------------ S3: partial uploads
def test_upload_failing_before_the_manifest_commits_nothing(s3: S3Endpoint, managers: list[CheckpointManager]) -> None:
    """The link dies just before the manifest of step 2: counted, never listed, step 1 still restores."""
    sleeps = Sleeps()
    remote = _s3_tier(s3, sleeps, retries=3)
    real_op = remote._op

    def op(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "put_file" and args[1].endswith(f"{step_dirname(2)}/rank_00000/{MANIFEST}"):
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
        return real_op(method, *args, **kwargs)

    remote._op = op  # type: ignore[method-assign]
    manager = _started(managers, [MemoryTier(keep=1), remote])
    _train(manager, range(1, 3))
    stats = manager.stats.tiers["remote"]
    assert (stats.writes, stats.failures) == (1, 1)
    assert stats.last_error is not None and "RemoteTierError" in stats.last_error
    assert "failed 4 time(s)" in stats.last_error and "ConnectionResetError" in stats.last_error
    assert remote.retries_total == 3 and len(sleeps.delays) == 3
    assert _step_keys(s3, 2) == []  # the data files uploaded before the failure were removed again
    manager.close()

    fresh = _started(managers, [_s3_tier(s3)])
    assert _remote(fresh).list_steps() == [1]
    with pytest.raises(CheckpointCorruptError, match="not committed"):
        _remote(fresh).read(2)
    restored = fresh.restore()
    assert restored is not None and restored.step == 1
    assert_state_equal(restored.state, make_state(1))


class _ProcessKilled(BaseException):
    """Stands for SIGKILL: no ``except Exception`` cleanup runs."""


def test_writer_killed_before_the_manifest_leaves_an_untrusted_shard(s3: S3Endpoint) -> None:
    """Data objects without a manifest are never listed or read; the next process's bind removes them."""
    tier = _bound(_s3_tier(s3))
    tier.write(make_snapshot(1))

    def killed(manifest: Path, shard: str) -> None:
        raise _ProcessKilled

    tier._commit = killed  # type: ignore[method-assign]
    with pytest.raises(_ProcessKilled):
        tier.write(make_snapshot(2))
    assert MANIFEST not in {k.rsplit("/", 1)[-1] for k in _step_keys(s3, 2)}
    assert len(_step_keys(s3, 2)) == 3  # .metadata, __0_0.distcp, skeleton.json: uploaded, not committed

    restarted = _s3_tier(s3)
    assert _bound(restarted).list_steps() == [1]
    assert _step_keys(s3, 2) == []  # bind cleaned the uncommitted shard of its own rank
    assert_tensors_equal(restarted.read(1).tensors, make_snapshot(1).tensors)


# ------------------------------------------------------------------------------------------------ S3: outages
def test_server_killed_mid_upload_is_counted_and_training_continues(
    own_s3: S3Endpoint, managers: list[CheckpointManager]
) -> None:
    """The store dies after the first file of step 3; training goes on; when it is back the next step uploads."""
    sleeps = Sleeps()
    remote = _s3_tier(own_s3, sleeps, retries=2)
    real_upload = remote._upload
    uploads = {"step3": 0}

    def upload(local: Path, key: str) -> None:
        real_upload(local, key)
        if f"/{step_dirname(3)}/" in key:
            uploads["step3"] += 1
            if uploads["step3"] == 1:
                own_s3.server.kill()  # a real outage: sockets closed under the client

    remote._upload = upload  # type: ignore[method-assign]
    manager = _started(managers, [MemoryTier(keep=1), remote])
    _train(manager, range(1, 4))
    stats = manager.stats.tiers["remote"]
    assert (stats.writes, stats.failures) == (2, 1)
    assert stats.last_error is not None and "unreachable" in stats.last_error
    assert own_s3.endpoint_url in stats.last_error and "tiers.remote.url=s3://ckpt/run" in stats.last_error
    assert uploads["step3"] == 1 and remote.retries_total == 2 and len(sleeps.delays) == 2

    # still down: the training thread gets the committed steps from memory, without a request
    retries_before = remote.retries_total
    assert remote.list_steps() == [1, 2]
    assert remote.retries_total == retries_before
    _train(manager, range(4, 5))  # snapshot taken, remote write fails again, training continues
    assert (stats.writes, stats.failures) == (2, 2)
    assert manager.stats.tiers["memory"].writes == 4

    own_s3.server.start()  # the store comes back on the same endpoint, with its data
    _train(manager, range(5, 6))
    assert (stats.writes, stats.failures) == (3, 2) and stats.last_step == 5
    assert remote.list_steps() == [2, 5]  # keep=2 over what was committed
    manager.close()

    fresh = _started(managers, [_s3_tier(own_s3)])
    assert _step_keys(own_s3, 3) == []  # the half-uploaded step 3 was cleaned up at bind
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (5, "remote")
    assert_state_equal(restored.state, make_state(5))


def test_transient_faults_are_retried_with_capped_exponential_backoff(s3: S3Endpoint) -> None:
    """503 SlowDown, throttling, a refused connection and a timeout are retried; waits double up to the cap."""
    sleeps = Sleeps()
    tier = _bound(_s3_tier(s3, sleeps, retries=5, backoff_s=0.5, max_backoff_s=1.5))
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
    tier = _bound(_s3_tier(own_s3, sleeps, retries=3))
    own_s3.server.kill()
    with pytest.raises(RemoteTierError) as info:
        tier.write(make_snapshot(1))
    assert isinstance(info.value, OSError)
    assert info.value.fault is RemoteFault.TRANSIENT and info.value.attempts == 4
    assert tier.retries_total == 3 and len(sleeps.delays) == 3
    with pytest.raises(RemoteTierError):  # a read is retried too, then reported as an OSError
        _s3_tier(own_s3, sleeps, retries=1).read(1)


def test_a_store_that_never_answers_is_bounded_by_timeout_s(s3: S3Endpoint) -> None:
    """An endpoint that accepts connections and then stays silent: each call gives up after timeout_s."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:  # listens, never accepts: a black hole
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        options = s3.storage_options(
            client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
            config_kwargs={"retries": {"total_max_attempts": 1}, "connect_timeout": 60, "read_timeout": 60},
        )
        sleeps = Sleeps()
        tier = _tier(s3.url(), sleeps, storage_options=options, retries=1, timeout_s=0.5)
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
    good = _bound(_s3_tier(s3, storage_options=s3.storage_options(key=key, secret=secret)))
    good.write(make_snapshot(1))
    assert good.list_steps() == [1]

    creds = {"key": key, "secret": "not-the-secret"} if bad == "wrong-secret" else {"key": "AKIAUNKNOWN000000000"}
    sleeps = Sleeps()
    remote = _s3_tier(s3, sleeps, storage_options=s3.storage_options(**creds))
    with pytest.raises(RemoteTierError) as info:
        _bound(remote).write(make_snapshot(2))
    message = str(info.value)
    assert info.value.fault is RemoteFault.CREDENTIALS
    assert f"credentials rejected by {s3.endpoint_url} for tiers.remote.url=s3://ckpt/run" in message
    assert "check tiers.remote.storage_options (key/secret) or AWS_* env" in message
    assert remote.retries_total == 0 and sleeps.delays == []
    assert remote.list_steps() == []  # logged, not raised: a restore can still use another tier
    with pytest.raises(RemoteTierError, match="credentials rejected"):
        remote.read(1)

    manager = _started(managers, [MemoryTier(keep=1), _s3_tier(s3, storage_options=s3.storage_options(**creds))])
    _train(manager, range(2, 4))
    stats = manager.stats.tiers["remote"]
    assert (stats.writes, stats.failures) == (0, 2) and manager.stats.tiers["memory"].writes == 2
    assert stats.last_error is not None and "tiers.remote.storage_options" in stats.last_error


def test_missing_bucket_is_named_and_not_created(s3: S3Endpoint, managers: list[CheckpointManager]) -> None:
    """A URL whose bucket does not exist fails without retries, naming bucket and key, and creates no bucket."""
    sleeps = Sleeps()
    url = "s3://no-such-bucket/run"
    tier = _bound(_tier(url, sleeps, storage_options=s3.storage_options()))
    with pytest.raises(RemoteTierError) as info:
        tier.write(make_snapshot(1))
    assert info.value.fault is RemoteFault.NO_BUCKET
    assert f"bucket 'no-such-bucket' does not exist (tiers.remote.url={url})" in str(info.value)
    assert tier.retries_total == 0 and sleeps.delays == []
    assert tier.list_steps() == []
    buckets = [b["Name"] for b in s3.server.client().list_buckets()["Buckets"]]
    assert buckets == [s3.bucket]

    manager = _started(managers, [MemoryTier(keep=1), _tier(url, storage_options=s3.storage_options())])
    _train(manager, range(1, 2))
    stats = manager.stats.tiers["remote"]
    assert stats.failures == 1 and stats.last_error is not None and "no-such-bucket" in stats.last_error


# ------------------------------------------------------------------------------------------------ restore fallback
def test_restore_falls_back_to_local_when_the_remote_is_unreachable(
    own_s3: S3Endpoint, tmp_path: Path, managers: list[CheckpointManager]
) -> None:
    """Remote down at restore (listing fails), or going down between listing and reading: local step 2 wins."""
    manager = _started(managers, [LocalTier(tmp_path, every_n_steps=2, keep=5), _s3_tier(own_s3, keep=5)])
    _train(manager, range(1, 4))
    assert manager.tiers[0].list_steps() == [2] and _remote(manager).list_steps() == [1, 2, 3]
    manager.close()

    own_s3.server.kill()
    sleeps = Sleeps()
    fresh = _started(managers, [LocalTier(tmp_path, every_n_steps=2, keep=5), _s3_tier(own_s3, sleeps, keep=5)])
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (2, "local")
    assert_state_equal(restored.state, make_state(2))
    assert len(sleeps.delays) == 5  # the startup listing got every retry before giving up

    own_s3.server.start()
    remote = _s3_tier(own_s3, keep=5)
    real_list = remote.list_steps

    def list_then_fail() -> list[int]:
        steps = real_list()
        own_s3.server.kill()  # gone between the agreement on candidates and the read
        return steps

    remote.list_steps = list_then_fail  # type: ignore[method-assign]
    fresh = _started(managers, [LocalTier(tmp_path, every_n_steps=2, keep=5), remote])
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (2, "local")
    (skipped,) = fresh.stats.skipped_corrupt
    assert "step 3" in skipped and "'remote'" in skipped and "unreachable" in skipped


def test_restore_falls_back_to_remote_when_local_is_corrupt(
    s3: S3Endpoint, tmp_path: Path, managers: list[CheckpointManager]
) -> None:
    """The newest step is corrupt on local disk: the same step is read from S3 instead."""
    manager = _started(managers, [LocalTier(tmp_path, every_n_steps=1, keep=3), _s3_tier(s3, keep=3)])
    _train(manager, range(1, 4))
    manager.close()
    flip_byte(data_file(tmp_path / step_dirname(3) / "rank_00000"))

    fresh = _started(managers, [LocalTier(tmp_path, every_n_steps=1, keep=3), _s3_tier(s3, keep=3)])
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (3, "remote")
    assert_state_equal(restored.state, make_state(3))
    (skipped,) = fresh.stats.skipped_corrupt
    assert "'local'" in skipped and "checksum" in skipped


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
