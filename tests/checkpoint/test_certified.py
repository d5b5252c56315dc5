"""Certified steps and content integrity in the checkpoint engine: a content print checked at commit and at restore,
rejected steps taken out of every tier with a record ``ckpt ls`` shows, a verified-only tier, ``resume=verified``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilience.checkpoint.certify import TOMBSTONE, Verification, verification_of
from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.content import CONTENT, ContentPrint, content_mismatch
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.snapshot import SnapshotPool
from lightning_resilience.testing.faults import FaultPlan
from tests.checkpoint.conftest import assert_state_equal, make_state, state_at


def _manager(managers: list[CheckpointManager], *tiers: Any, **config: Any) -> CheckpointManager:
    manager = CheckpointManager(list(tiers), CheckpointConfig(**config))
    manager.setup()
    managers.append(manager)
    return manager


def test_a_content_print_sees_one_flipped_bit_and_a_missing_or_extra_tensor() -> None:
    tensors = {"w": torch.randn(300), "n": torch.arange(5), "b": torch.tensor([True, False]), "e": torch.empty(0)}
    meta = ContentPrint(3, tensors).meta()
    assert content_mismatch(tensors, meta) == []
    flipped = dict(tensors, w=tensors["w"].clone())
    flipped["w"].view(torch.int32)[7] ^= 1  # the lowest mantissa bit
    assert content_mismatch(flipped, meta) == ["w"]
    assert content_mismatch({k: v for k, v in tensors.items() if k != "n"}, meta) == ["n"]
    assert content_mismatch({**tensors, "x": torch.ones(1)}, meta) == ["x"]
    assert content_mismatch(tensors, {}) is None  # no print: nothing to check


def test_a_tier_that_saves_another_steps_tensors_is_refused_at_restore_and_the_step_before_is_taken(
    tmp_path: Path, managers: list[CheckpointManager]
) -> None:
    tier = LocalTier(tmp_path, every_n_steps=1, keep=3)
    FaultPlan().fail_at(None, 3, "tier.local.write", "stale").instrument(tier)
    manager = _manager(managers, tier)
    for step in (1, 2, 3):
        manager.on_step(step, state_at(step))
        assert manager.wait()
    assert manager.steps()["local"] == [1, 2, 3]  # the stale write "succeeded"
    restarted = _manager(managers, LocalTier(tmp_path, every_n_steps=1, keep=3))
    restored = restarted.restore()
    assert restored is not None and restored.step == 2
    assert_state_equal(restored.state, make_state(2))
    [skipped] = restarted.stats.skipped_corrupt
    assert "tier 'local'" in skipped and "step 3 are not the state" in skipped


def test_staged_tensors_that_are_not_the_step_are_committed_nowhere(
    tmp_path: Path, managers: list[CheckpointManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    capture = SnapshotPool.capture

    def stale_staging(self: SnapshotPool, step: int, flat: Any, *args: Any, **kwargs: Any) -> Any:
        slot = capture(self, step, flat, *args, **kwargs)
        if step == 2:  # the copy into the staging buffers did not happen: they still hold an older step
            slot.wait_copied()
            next(iter(slot.view().tensors.values())).add_(1)
        return slot

    monkeypatch.setattr(SnapshotPool, "capture", stale_staging)
    manager = _manager(managers, LocalTier(tmp_path, every_n_steps=1, keep=3))
    for step in (1, 2):
        manager.on_step(step, state_at(step))
        manager.wait()
    assert manager.steps()["local"] == [1]
    stats = manager.stats.tiers["local"]
    assert stats.failures == 1 and "step 2 are not the state" in (stats.last_error or "")


def test_a_rejected_step_leaves_every_tier_with_a_record_and_is_never_restored(
    tmp_path: Path, managers: list[CheckpointManager]
) -> None:
    memory, local = MemoryTier(every_n_steps=1, keep=3), LocalTier(tmp_path, every_n_steps=1, keep=5)
    manager = _manager(managers, memory, local)
    for step in range(1, 5):
        manager.on_step(step, state_at(step))
        assert manager.wait()
    assert manager.reject(2, "SDC at step 4: diverged") == [3, 4]
    assert manager.steps() == {"memory": [2], "local": [1, 2]} and manager.stats.rejected_steps == [3, 4]
    record = (tmp_path / "step_000000000004" / TOMBSTONE).read_text()
    assert '"reason": "SDC at step 4: diverged"' in record and '"verification": "rejected"' in record
    restarted = _manager(managers, LocalTier(tmp_path, every_n_steps=1, keep=5))
    restored = restarted.restore()
    assert restored is not None and restored.step == 2
    # a later write of the same step (training goes on after a rollback) is an ordinary step again
    restarted.on_step(3, state_at(3))
    assert restarted.wait() and restarted.steps()["local"] == [1, 2, 3]


def _verified_every(k: int) -> Any:
    return lambda step: {"verification": "verified" if step % k == 0 else "unverified"}


def test_a_verified_only_tier_publishes_only_verified_steps_and_resume_verified_takes_them(
    tmp_path: Path, managers: list[CheckpointManager]
) -> None:
    durable = LocalTier(tmp_path / "durable", every_n_steps=1, keep=10, name="durable")
    manager = _manager(managers, LocalTier(tmp_path / "local", every_n_steps=1, keep=10), durable,
                       verified_only=["durable"])  # fmt: skip
    manager.add_meta_provider(_verified_every(3))
    for step in range(1, 8):
        manager.on_step(step, state_at(step))
        assert manager.wait()
    assert manager.steps() == {"local": list(range(1, 8)), "durable": [3, 6]}
    local_only = _manager(managers, LocalTier(tmp_path / "local", every_n_steps=1, keep=10), resume="verified")
    restored = local_only.restore()
    assert restored is not None and restored.step == 6 and verification_of(restored.meta) is Verification.verified
    assert CONTENT not in restored.meta  # the print stays in the manifest: the engine's own
    assert CONTENT in (tmp_path / "local" / "step_000000000006" / "rank_00000" / "manifest.json").read_text()
    with pytest.raises(ValueError, match="verified_only"):
        CheckpointManager([durable], CheckpointConfig(verified_only=["s3"]))
