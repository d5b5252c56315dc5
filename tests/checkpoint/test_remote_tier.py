"""RemoteTier against a real S3-compatible server on loopback (moto in server mode) and against file:// URLs.

Every outage here is real: the server's sockets are closed while the tier talks to it. Retries wait through an
injected ``sleep`` that records the delays, so nothing in this file sleeps; every other wait is bounded.
"""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import MANIFEST
from lightning_resilience.checkpoint.local import LocalTier, step_dirname
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.remote import RemoteTier
from lightning_resilience.checkpoint.tier import Durability, Tier
from tests.checkpoint import _s3server
from tests.checkpoint._remote import Sleeps, bound, remote_of, remote_tier, s3_tier, started, step_keys, train
from tests.checkpoint._s3server import S3Endpoint
from tests.checkpoint.conftest import (
    assert_state_equal,
    assert_tensors_equal,
    data_file,
    flip_byte,
    make_snapshot,
    make_state,
)

# the server fixtures live in a helper module (other test modules may share them): expose them to pytest here
s3_server = _s3server.s3_server
s3 = _s3server.s3
own_s3 = _s3server.own_s3


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
    manager = started(managers, [MemoryTier(keep=1), remote_tier(url)])
    train(manager, range(1, 5))
    assert remote_of(manager).list_steps() == [3, 4]
    assert sorted(p.name for p in root.iterdir()) == [step_dirname(3), step_dirname(4)]
    shard = root / step_dirname(4) / "rank_00000"
    assert sorted(p.name for p in shard.iterdir()) == [".metadata", "__0_0.distcp", MANIFEST, "skeleton.json"]
    manager.close()

    fresh = started(managers, [remote_tier(url)])
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (4, "remote")
    assert restored.meta == {"epoch": 1}
    assert_state_equal(restored.state, make_state(4))


@pytest.mark.parametrize("protocol", ["file", "memory"])
def test_write_list_read_delete(tmp_path: Path, protocol: str) -> None:
    """The Tier contract on its own: rewrite replaces whole, delete un-commits then removes, both idempotent."""
    url = f"file://{tmp_path}/ckpt" if protocol == "file" else f"memory://{tmp_path.name}/ckpt"
    tier = bound(remote_tier(url))
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
    writer = bound(remote_tier(f"file://{root}"), rank=0, world_size=2)
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

    reader = bound(remote_tier(f"file://{root}"), rank=0, world_size=4)
    with pytest.raises(CheckpointCorruptError, match="world size 2"):
        reader.read(3)


# ------------------------------------------------------------------------------------------------ S3: round trip
def test_s3_round_trip_through_the_manager(s3: S3Endpoint, managers: list[CheckpointManager]) -> None:
    """Memory + S3 tiers: uploads run on the persist worker, retention holds, a fresh manager restores bitwise."""
    upload_threads: set[str] = set()
    remote = s3_tier(s3)
    real_upload = remote._upload

    def upload(local: Path, key: str) -> None:
        upload_threads.add(threading.current_thread().name)
        real_upload(local, key)

    remote._upload = upload  # type: ignore[method-assign]
    manager = started(managers, [MemoryTier(keep=1), remote])
    train(manager, range(1, 5))
    assert upload_threads == {"lr-persist"}  # never the training thread
    assert remote.list_steps() == [3, 4]
    assert manager.stats.tiers["remote"].writes == 4 and manager.stats.tiers["remote"].failures == 0
    assert s3.keys() == [
        f"run/{step_dirname(step)}/rank_00000/{name}"
        for step in (3, 4)
        for name in (".metadata", "__0_0.distcp", MANIFEST, "skeleton.json")
    ]
    manager.close()

    fresh = started(managers, [MemoryTier(keep=1), s3_tier(s3)])
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (4, "remote")
    assert_state_equal(restored.state, make_state(4))
    assert fresh.stats.skipped_corrupt == []


def test_ranks_keep_to_their_own_shards(s3: S3Endpoint) -> None:
    """Two ranks share a prefix: each lists, reads and deletes only its own shard of a step."""
    rank0 = bound(s3_tier(s3), rank=0, world_size=2)
    rank1 = bound(s3_tier(s3), rank=1, world_size=2)
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
    tier = bound(s3_tier(s3))
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
    remote = s3_tier(s3, sleeps, retries=3)
    real_op = remote._op

    def op(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "put_file" and args[1].endswith(f"{step_dirname(2)}/rank_00000/{MANIFEST}"):
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
        return real_op(method, *args, **kwargs)

    remote._op = op  # type: ignore[method-assign]
    manager = started(managers, [MemoryTier(keep=1), remote])
    train(manager, range(1, 3))
    stats = manager.stats.tiers["remote"]
    assert (stats.writes, stats.failures) == (1, 1)
    assert stats.last_error is not None and "RemoteTierError" in stats.last_error
    assert "failed 4 time(s)" in stats.last_error and "ConnectionResetError" in stats.last_error
    assert remote.retries_total == 3 and len(sleeps.delays) == 3
    assert step_keys(s3, 2) == []  # the data files uploaded before the failure were removed again
    manager.close()

    fresh = started(managers, [s3_tier(s3)])
    assert remote_of(fresh).list_steps() == [1]
    with pytest.raises(CheckpointCorruptError, match="not committed"):
        remote_of(fresh).read(2)
    restored = fresh.restore()
    assert restored is not None and restored.step == 1
    assert_state_equal(restored.state, make_state(1))


class _ProcessKilled(BaseException):
    """Stands for SIGKILL: no ``except Exception`` cleanup runs."""


def test_writer_killed_before_the_manifest_leaves_an_untrusted_shard(s3: S3Endpoint) -> None:
    """Data objects without a manifest are never listed or read; the next process's bind removes them."""
    tier = bound(s3_tier(s3))
    tier.write(make_snapshot(1))

    def killed(manifest: Path, shard: str) -> None:
        raise _ProcessKilled

    tier._commit = killed  # type: ignore[method-assign]
    with pytest.raises(_ProcessKilled):
        tier.write(make_snapshot(2))
    assert MANIFEST not in {k.rsplit("/", 1)[-1] for k in step_keys(s3, 2)}
    assert len(step_keys(s3, 2)) == 3  # .metadata, __0_0.distcp, skeleton.json: uploaded, not committed

    restarted = s3_tier(s3)
    assert bound(restarted).list_steps() == [1]
    assert step_keys(s3, 2) == []  # bind cleaned the uncommitted shard of its own rank
    assert_tensors_equal(restarted.read(1).tensors, make_snapshot(1).tensors)


# ------------------------------------------------------------------------------------------------ restore fallback
def test_restore_falls_back_to_local_when_the_remote_is_unreachable(
    own_s3: S3Endpoint, tmp_path: Path, managers: list[CheckpointManager]
) -> None:
    """Remote down at restore (listing fails), or going down between listing and reading: local step 2 wins."""
    manager = started(managers, [LocalTier(tmp_path, every_n_steps=2, keep=5), s3_tier(own_s3, keep=5)])
    train(manager, range(1, 4))
    assert manager.tiers[0].list_steps() == [2] and remote_of(manager).list_steps() == [1, 2, 3]
    manager.close()

    own_s3.server.kill()
    sleeps = Sleeps()
    fresh = started(managers, [LocalTier(tmp_path, every_n_steps=2, keep=5), s3_tier(own_s3, sleeps, keep=5)])
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (2, "local")
    assert_state_equal(restored.state, make_state(2))
    assert len(sleeps.delays) == 5  # the startup listing got every retry before giving up

    own_s3.server.start()
    remote = s3_tier(own_s3, keep=5)
    real_list = remote.list_steps

    def list_then_fail() -> list[int]:
        steps = real_list()
        own_s3.server.kill()  # gone between the agreement on candidates and the read
        return steps

    remote.list_steps = list_then_fail  # type: ignore[method-assign]
    fresh = started(managers, [LocalTier(tmp_path, every_n_steps=2, keep=5), remote])
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (2, "local")
    (skipped,) = fresh.stats.skipped_corrupt
    assert "step 3" in skipped and "'remote'" in skipped and "unreachable" in skipped


def test_restore_falls_back_to_remote_when_local_is_corrupt(
    s3: S3Endpoint, tmp_path: Path, managers: list[CheckpointManager]
) -> None:
    """The newest step is corrupt on local disk: the same step is read from S3 instead."""
    manager = started(managers, [LocalTier(tmp_path, every_n_steps=1, keep=3), s3_tier(s3, keep=3)])
    train(manager, range(1, 4))
    manager.close()
    flip_byte(data_file(tmp_path / step_dirname(3) / "rank_00000"))

    fresh = started(managers, [LocalTier(tmp_path, every_n_steps=1, keep=3), s3_tier(s3, keep=3)])
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier) == (3, "remote")
    assert_state_equal(restored.state, make_state(3))
    (skipped,) = fresh.stats.skipped_corrupt
    assert "'local'" in skipped and "checksum" in skipped
