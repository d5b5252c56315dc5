"""Single-process restore: newest valid step wins, corrupt shards are skipped and named, policies are honoured."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.errors import NoValidCheckpointError
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.tier import Tier
from tests.checkpoint.conftest import assert_state_equal, data_file, flip_byte, make_state, state_at


def _started(managers: list[CheckpointManager], tiers: list[Tier], **config: str) -> CheckpointManager:
    manager = CheckpointManager(tiers, CheckpointConfig(**config))  # type: ignore[arg-type]
    manager.setup()
    managers.append(manager)
    return manager


def _train(manager: CheckpointManager, steps: range) -> None:
    for step in steps:
        manager.on_step(step, state_at(step), meta={"epoch": step // 3})
        assert manager.wait()


@pytest.fixture
def written(tmp_path: Path, managers: list[CheckpointManager]) -> Path:
    """A local tier holding committed steps 1, 2, 3 (written by a manager that has since gone away)."""
    manager = _started(managers, [LocalTier(tmp_path, every_n_steps=1, keep=5)])
    _train(manager, range(1, 4))
    manager.close()
    return tmp_path


def _restarted(managers: list[CheckpointManager], root: Path, **config: str) -> CheckpointManager:
    """A new process over the same directory: nothing in memory, only what is on disk."""
    return _started(managers, [LocalTier(root, every_n_steps=1, keep=5)], **config)


def test_restore_picks_the_newest_step(written: Path, managers: list[CheckpointManager]) -> None:
    """With every shard valid, the newest committed step is restored exactly, with its metadata."""
    manager = _restarted(managers, written)
    restored = manager.restore()
    assert restored is not None
    assert (restored.step, restored.tier) == (3, "local")
    assert restored.meta == {"epoch": 1}
    assert_state_equal(restored.state, make_state(3))
    assert manager.stats.restored_step == 3 and manager.stats.restored_from == "local"
    assert manager.stats.skipped_corrupt == []


def test_corrupt_newest_falls_back_to_previous(written: Path, managers: list[CheckpointManager]) -> None:
    """One flipped byte in step 3 makes restore return step 2, and the skip names the corrupt shard."""
    manager = _restarted(managers, written)
    corrupt = manager.tiers[0].shard_dir(3)  # type: ignore[attr-defined]
    flip_byte(data_file(corrupt))
    restored = manager.restore()
    assert restored is not None and restored.step == 2
    assert_state_equal(restored.state, make_state(2))
    assert len(manager.stats.skipped_corrupt) == 1
    (skipped,) = manager.stats.skipped_corrupt
    assert str(corrupt) in skipped and "step 3" in skipped and "checksum" in skipped


def test_fallback_walks_past_several_corrupt_steps(written: Path, managers: list[CheckpointManager]) -> None:
    """Different kinds of damage on the two newest steps: restore reaches step 1 and reports both."""
    manager = _restarted(managers, written)
    tier = manager.tiers[0]
    (tier.shard_dir(3) / "manifest.json").unlink()  # type: ignore[attr-defined]
    data = data_file(tier.shard_dir(2))  # type: ignore[attr-defined]
    data.write_bytes(data.read_bytes()[:10])
    restored = manager.restore()
    assert restored is not None and restored.step == 1
    assert_state_equal(restored.state, make_state(1))
    assert [("step 3" in s, "step 2" in s) for s in manager.stats.skipped_corrupt] == [(True, False), (False, True)]


def _corrupt_all(root: Path) -> None:
    for data in root.glob("step_*/rank_00000/*.distcp"):
        flip_byte(data)


def test_all_corrupt_starts_fresh_by_default(written: Path, managers: list[CheckpointManager]) -> None:
    """if_none_valid='start_fresh': every step corrupt gives None (train from scratch), each skip recorded."""
    _corrupt_all(written)
    manager = _restarted(managers, written, if_none_valid="start_fresh")
    assert manager.restore() is None
    assert len(manager.stats.skipped_corrupt) == 3
    assert manager.stats.restored_step is None


def test_all_corrupt_fails_when_configured(written: Path, managers: list[CheckpointManager]) -> None:
    """if_none_valid='fail': every step corrupt raises, and the message names the setting to change."""
    _corrupt_all(written)
    manager = _restarted(managers, written, if_none_valid="fail")
    with pytest.raises(NoValidCheckpointError, match="if_none_valid"):
        manager.restore()


def test_empty_directory_is_a_fresh_start_even_with_fail(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """No checkpoint at all is a first run, not a failure: 'fail' applies only when checkpoints exist."""
    manager = _restarted(managers, tmp_path / "empty", if_none_valid="fail")
    assert manager.restore() is None
    assert manager.stats.skipped_corrupt == []


def test_explicit_step_is_restored_even_if_not_newest(written: Path, managers: list[CheckpointManager]) -> None:
    """restore(step=N) loads exactly N."""
    restored = _restarted(managers, written).restore(step=1)
    assert restored is not None and restored.step == 1
    assert_state_equal(restored.state, make_state(1))


def test_explicit_missing_step_raises(written: Path, managers: list[CheckpointManager]) -> None:
    """Asking for a step that was never committed raises instead of silently loading another one."""
    with pytest.raises(NoValidCheckpointError, match="step 7"):
        _restarted(managers, written).restore(step=7)


def test_explicit_corrupt_step_raises_without_falling_back(written: Path, managers: list[CheckpointManager]) -> None:
    """An explicitly requested corrupt step raises even though an older valid step exists."""
    manager = _restarted(managers, written)
    flip_byte(data_file(manager.tiers[0].shard_dir(2)))  # type: ignore[attr-defined]
    with pytest.raises(NoValidCheckpointError, match="step 2"):
        manager.restore(step=2)


def test_restore_prefers_the_memory_tier(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """When memory and disk both hold the newest step, the faster memory copy is used."""
    manager = _started(managers, [LocalTier(tmp_path, every_n_steps=1, keep=3), MemoryTier(keep=2)])
    _train(manager, range(1, 4))
    assert manager.tiers[0].list_steps() == [2, 3] and manager.tiers[1].list_steps() == [1, 2, 3]
    restored = manager.restore()
    assert restored is not None
    assert (restored.step, restored.tier) == (3, "memory")
    assert_state_equal(restored.state, make_state(3))


def test_memory_copy_used_when_disk_copy_is_corrupt(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """A corrupt disk shard of a step still in memory costs nothing: memory is read first, nothing is skipped."""
    manager = _started(managers, [MemoryTier(keep=2), LocalTier(tmp_path, every_n_steps=1, keep=3)])
    _train(manager, range(1, 4))
    flip_byte(data_file(manager.tiers[1].shard_dir(3)))  # type: ignore[attr-defined]
    restored = manager.restore()
    assert restored is not None and (restored.step, restored.tier) == (3, "memory")
    assert manager.stats.skipped_corrupt == []


def test_restored_tensors_do_not_alias_memory_buffers(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """A RAM restore hands its buffers over: the step leaves the RAM tier, and later snapshots never reuse them."""
    manager = _started(managers, [MemoryTier(keep=2), LocalTier(tmp_path, every_n_steps=1, keep=3)])
    _train(manager, range(1, 4))
    restored = manager.restore()
    assert restored is not None and restored.tier == "memory"
    assert 3 not in manager.tiers[0].list_steps()
    weight = restored.state["model"]["weight"]
    weight.add_(1000.0)  # the optimizer updating the restored parameter in place
    again = manager.restore()  # the handed-over step now comes from disk, untouched by the edit above
    assert again is not None and (again.step, again.tier) == (3, "local")
    assert_state_equal(again.state, make_state(3))
    # keep snapshotting: the pool reuses its slots, but never the ones handed to a restored state
    _train(manager, range(4, 9))
    assert torch.equal(weight, make_state(3)["model"]["weight"] + 1000.0)
    assert_state_equal(again.state, make_state(3))
