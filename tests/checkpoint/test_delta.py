"""Delta checkpoints: DeltaLocalTier on its own and through the manager over real training (``test_delta_codec.py``: the
XOR+zstd codec on its own)."""

from __future__ import annotations

import copy
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_resilience.checkpoint.format as format_module
from lightning_resilience.checkpoint.delta_tier import DELTA_BIN, DELTA_JSON, DELTA_OF, DeltaLocalTier
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import MANIFEST, read_manifest
from lightning_resilience.checkpoint.local import LocalTier, step_dirname
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.tier import Tier, TierIdentity
from lightning_resilience.checkpoint.tree import unflatten_state
from tests.checkpoint.conftest import (
    assert_bitwise,
    assert_tensors_bitwise,
    flip_byte,
    make_snapshot,
    make_state,
    rewrite_manifest,
)


# ------------------------------------------------------------------------------------------------------- tier
def _tier(root: Path, **kwargs: Any) -> DeltaLocalTier:
    tier = DeltaLocalTier(root, **{"every_n_steps": 1, **kwargs})
    tier.bind(TierIdentity())
    return tier


def _kinds(tier: DeltaLocalTier) -> dict[int, int | None]:
    """step -> base step (None for a full step)."""
    return {step: tier.base_of(step) for step in tier.list_steps()}


def test_delta_tier_is_a_tier_and_validates_its_arguments(tmp_path: Path) -> None:
    """Usable wherever a Tier is expected; bad construction arguments name the config key."""
    assert isinstance(DeltaLocalTier(tmp_path), Tier)
    assert isinstance(DeltaLocalTier(tmp_path), LocalTier)
    with pytest.raises(ValueError, match=r"tiers\.local\.full_every"):
        DeltaLocalTier(tmp_path, full_every=0)
    with pytest.raises(ValueError, match=r"tiers\.local\.level"):
        DeltaLocalTier(tmp_path, level=99)
    with pytest.raises(ValueError, match=r"tiers\.local\.lossy_bits"):
        DeltaLocalTier(tmp_path, lossy_bits=-1)


def test_full_every_n_writes_and_deltas_against_the_last_full(tmp_path: Path) -> None:
    """full_every=4: F D D D F D; each delta names the newest full step and reads back exactly."""
    tier = _tier(tmp_path, keep=100, full_every=4)
    for step in range(1, 7):
        tier.write(make_snapshot(step))
    assert _kinds(tier) == {1: None, 2: 1, 3: 1, 4: 1, 5: None, 6: 5}
    shard = tier.shard_dir(3)
    assert sorted(p.name for p in shard.iterdir()) == sorted([DELTA_BIN, DELTA_JSON, "skeleton.json", MANIFEST])
    assert read_manifest(shard).meta == {"epoch": 1, DELTA_OF: 1}
    for step in range(1, 7):
        snap = tier.read(step)
        assert snap.step == step and snap.meta == {"epoch": step // 3}  # the reserved key is not handed back
        assert_bitwise(unflatten_state(snap.skeleton, snap.tensors), make_state(step))


def test_new_process_starts_with_a_full_write(tmp_path: Path) -> None:
    """After bind (a restart) the first write is full; the deltas already on disk stay readable."""
    _tier(tmp_path, keep=100, full_every=3).write(make_snapshot(1))
    restarted = _tier(tmp_path, keep=100, full_every=3)
    for step in (2, 3):
        restarted.write(make_snapshot(step))
    assert _kinds(restarted) == {1: None, 2: None, 3: 2}


def test_rewritten_base_invalidates_its_old_deltas(tmp_path: Path) -> None:
    """A full step written again (after a rollback) is never silently combined with deltas made against the old one."""
    tier = _tier(tmp_path, keep=100, full_every=10)
    for step in (1, 2):
        tier.write(make_snapshot(step))
    other = _tier(tmp_path, keep=100, full_every=10)  # a restarted process rewrites step 1
    rewritten = make_snapshot(9)
    rewritten.step = 1
    other.write(rewritten)
    with pytest.raises(CheckpointCorruptError, match=r"full step 1.*rewritten"):
        other.read(2)
    tier.write(make_snapshot(3))  # the old writer notices its base changed on disk: a full write
    assert tier.base_of(3) is None


def test_plain_local_tier_refuses_a_delta_shard_cleanly(tmp_path: Path) -> None:
    """A reader without delta support sees a corrupt shard (restore skips it), not a crash."""
    tier = _tier(tmp_path, keep=100, full_every=4)
    for step in (1, 2):
        tier.write(make_snapshot(step))
    plain = LocalTier(tmp_path)
    plain.bind(TierIdentity())
    with pytest.raises(CheckpointCorruptError):
        plain.read(2)
    assert_tensors_bitwise(plain.read(1).tensors, make_snapshot(1).tensors)


def test_reserved_meta_key_is_refused(tmp_path: Path) -> None:
    """User metadata may not use the key that marks a delta shard."""
    snap = make_snapshot(1)
    snap.meta[DELTA_OF] = 0
    with pytest.raises(ValueError, match=DELTA_OF):
        _tier(tmp_path).write(snap)


def test_failed_delta_write_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta write that dies before the rename leaves no shard and no temporary; the next write succeeds."""
    tier = _tier(tmp_path, keep=100, full_every=4)
    tier.write(make_snapshot(1))
    real = format_module.fsync_dir
    calls = {"n": 0}

    def dying_fsync(path: Path) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        real(path)

    monkeypatch.setattr(format_module, "fsync_dir", dying_fsync)  # seal_shard's fsync of the sealed shard
    with pytest.raises(OSError):
        tier.write(make_snapshot(2))
    assert tier.list_steps() == [1]
    assert not any(p.name.startswith(".rank_") for p in tmp_path.rglob("*"))
    tier.write(make_snapshot(2))
    assert _kinds(tier) == {1: None, 2: 1}


def test_base_copy_does_not_alias_the_snapshot(tmp_path: Path) -> None:
    """The manager reuses snapshot buffers: overwriting them after a full write must not change the base."""
    tier = _tier(tmp_path, keep=100, full_every=3)
    for cycle in range(2):  # the second full write reuses the first base's buffers
        first = cycle * 3 + 1
        snap = make_snapshot(first)
        tier.write(snap)
        for step in (first + 1, first + 2):
            fresh = make_snapshot(step)
            for name, tensor in snap.tensors.items():
                tensor.copy_(fresh.tensors[name])  # the pool's slot now holds the next step
            snap.step = step
            tier.write(snap)
    assert _kinds(tier) == {1: None, 2: 1, 3: 1, 4: None, 5: 4, 6: 4}
    for step in range(1, 7):
        assert_tensors_bitwise(tier.read(step).tensors, make_snapshot(step).tensors)


def test_base_not_cached_is_read_back(tmp_path: Path) -> None:
    """cache_base=False writes the same deltas, reading the base from disk instead of holding it in RAM; a base
    that went bad on disk makes the next write full instead of failing it."""
    tier = _tier(tmp_path, keep=100, full_every=4, cache_base=False)
    for step in (1, 2, 3):
        tier.write(make_snapshot(step))
    assert _kinds(tier) == {1: None, 2: 1, 3: 1}
    assert_tensors_bitwise(tier.read(3).tensors, make_snapshot(3).tensors)
    flip_byte(next((tmp_path / step_dirname(1) / "rank_00000").glob("*.distcp")))
    tier.write(make_snapshot(4))
    assert tier.base_of(4) is None
    assert_tensors_bitwise(tier.read(4).tensors, make_snapshot(4).tensors)


def test_delete_of_a_needed_base_is_deferred_until_its_deltas_are_gone(tmp_path: Path) -> None:
    """delete(base) keeps it while deltas need it; deleting the last delta then removes the base too."""
    tier = _tier(tmp_path, keep=100, full_every=4)
    for step in (1, 2, 3):
        tier.write(make_snapshot(step))
    tier.delete(1)
    assert tier.list_steps() == [1, 2, 3] and tier.dependants(1) == [2, 3]
    tier.delete(2)
    assert tier.list_steps() == [1, 3]
    assert_tensors_bitwise(tier.read(3).tensors, make_snapshot(3).tensors)
    tier.delete(3)
    assert tier.list_steps() == []
    assert list(tmp_path.iterdir()) == []
    tier.delete(3)  # idempotent


# ------------------------------------------------------------------------------------------ through the manager
class _Run:
    """A real training loop (Linear + AdamW) checkpointed every step; remembers each step's exact state."""

    def __init__(self, seed: int = 0, freeze_embedding: bool = False) -> None:
        torch.manual_seed(seed)
        self.embedding = torch.nn.Embedding(4096, 32)
        self.model = torch.nn.Sequential(self.embedding, torch.nn.Flatten(), torch.nn.Linear(4 * 32, 3))
        self.embedding.weight.requires_grad_(not freeze_embedding)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-2)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.states: dict[int, Any] = {}

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def step(self) -> None:
        tokens = torch.randint(0, 4096, (8, 4), generator=self.gen)
        target = torch.randint(0, 3, (8,), generator=self.gen)
        loss = torch.nn.functional.cross_entropy(self.model(tokens), target)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def train(self, manager: CheckpointManager, steps: range, after: Callable[[int], None] | None = None) -> None:
        for step in steps:
            self.step()
            manager.on_step(step, self.state, meta={"step": step})
            assert manager.wait()
            self.states[step] = copy.deepcopy(self.state())
            if after is not None:
                after(step)


def _manager(managers: list[CheckpointManager], root: Path, *, keep: int = 100) -> CheckpointManager:
    manager = CheckpointManager([DeltaLocalTier(root, every_n_steps=1, keep=keep, full_every=4)])
    manager.setup()
    managers.append(manager)
    return manager


def _delta_tier(manager: CheckpointManager) -> DeltaLocalTier:
    tier = manager.tiers[0]
    assert isinstance(tier, DeltaLocalTier)
    return tier


def test_training_run_restores_bitwise_and_resumes_identically(
    tmp_path: Path, managers: list[CheckpointManager]
) -> None:
    """Linear + AdamW, cadence 1, full_every=4: every step restores bitwise on a fresh manager, and training
    resumed from the newest (a delta) continues exactly like the uninterrupted run."""
    run = _Run()
    writer = _manager(managers, tmp_path)
    run.train(writer, range(1, 11))
    assert _kinds(_delta_tier(writer)) == {
        1: None, 2: 1, 3: 1, 4: 1, 5: None, 6: 5, 7: 5, 8: 5, 9: None, 10: 9,
    }  # fmt: skip
    assert writer.stats.tiers["local"].failures == 0
    fresh = _manager(managers, tmp_path)
    restored = fresh.restore()
    assert restored is not None and (restored.step, restored.tier, restored.meta) == (10, "local", {"step": 10})
    assert_bitwise(restored.state, run.states[10])
    for step in range(1, 10):
        assert_bitwise(unflatten_state(*_snap_parts(_delta_tier(fresh), step)), run.states[step])

    resumed = _Run()
    resumed.model.load_state_dict(restored.state["model"])
    resumed.optimizer.load_state_dict(restored.state["optimizer"])
    resumed.gen.set_state(run.gen.get_state())
    for _ in range(3):
        run.step()
        resumed.step()
    assert_bitwise(resumed.state(), run.state())


def _snap_parts(tier: DeltaLocalTier, step: int) -> tuple[Any, dict[str, torch.Tensor]]:
    snap = tier.read(step)
    return snap.skeleton, snap.tensors


def test_corrupt_delta_falls_back_to_the_newest_valid_step(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """A damaged delta (one flipped byte, even with a re-signed manifest) is skipped; the step before wins."""
    run = _Run()
    run.train(_manager(managers, tmp_path), range(1, 8))  # F1 D2 D3 D4 F5 D6 D7
    newest = tmp_path / step_dirname(7) / "rank_00000"
    flip_byte(newest / DELTA_BIN)
    fresh = _manager(managers, tmp_path)
    restored = fresh.restore()
    assert restored is not None and restored.step == 6
    assert_bitwise(restored.state, run.states[6])
    assert len(fresh.stats.skipped_corrupt) == 1 and "checksum mismatch in delta.bin" in fresh.stats.skipped_corrupt[0]

    # a tool that re-signs the manifest hides the damage from the file checksums: the decode checksum catches it
    flip_byte(tmp_path / step_dirname(6) / "rank_00000" / DELTA_BIN)
    rewrite_manifest(tmp_path / step_dirname(6) / "rank_00000")
    again = _manager(managers, tmp_path)
    restored = again.restore()
    assert restored is not None and restored.step == 5
    assert_bitwise(restored.state, run.states[5])
    assert any("step 6" in msg and "full step 5" in msg for msg in again.stats.skipped_corrupt)


def test_missing_base_skips_its_deltas_with_a_warning_naming_it(
    tmp_path: Path, managers: list[CheckpointManager], caplog: pytest.LogCaptureFixture
) -> None:
    """Deleting full step 5 makes deltas 6 and 7 unrestorable; restore warns naming step 5 and takes step 4."""
    run = _Run()
    run.train(_manager(managers, tmp_path), range(1, 8))
    shutil.rmtree(tmp_path / step_dirname(5))
    fresh = _manager(managers, tmp_path)
    with caplog.at_level(logging.WARNING):
        restored = fresh.restore()
    assert restored is not None and restored.step == 4
    assert_bitwise(restored.state, run.states[4])
    for step in (7, 6):
        (warning,) = [r.getMessage() for r in caplog.records if f"checkpoint step {step} " in r.getMessage()]
        assert "its base, full step 5, is missing" in warning


def test_retention_keep_2_never_breaks_a_chain(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """keep=2 over 14 steps: after every persist each retained delta's base is on disk and every step restores;
    bases are deleted once no delta needs them, so the disk never holds more than keep + 1 steps."""
    run = _Run()
    manager = _manager(managers, tmp_path, keep=2)
    tier = _delta_tier(manager)

    def check(step: int) -> None:
        kinds = _kinds(tier)
        newest = sorted(kinds)[-2:]
        assert newest == [s for s in (step - 1, step) if s >= 1]
        needed = {base for s, base in kinds.items() if s in newest and base is not None}
        assert set(kinds) == set(newest) | needed, (step, kinds)  # nothing more is kept
        for s in kinds:
            assert_bitwise(unflatten_state(*_snap_parts(tier, s)), run.states[s])

    run.train(manager, range(1, 15), after=check)
    assert _kinds(tier) == {13: None, 14: 13}
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dirname(13), step_dirname(14)]


def test_deltas_are_much_smaller_when_only_some_parameters_train(
    tmp_path: Path, managers: list[CheckpointManager]
) -> None:
    """Frozen embedding + trainable head: a delta shard is a small fraction of a full shard."""
    run = _Run(freeze_embedding=True)
    manager = _manager(managers, tmp_path)
    run.train(manager, range(1, 9))

    def shard_bytes(step: int) -> int:
        return sum(p.stat().st_size for p in (tmp_path / step_dirname(step) / "rank_00000").iterdir())

    tier = _delta_tier(manager)
    full = [shard_bytes(s) for s in tier.list_steps() if tier.base_of(s) is None]
    deltas = [shard_bytes(s) for s in tier.list_steps() if tier.base_of(s) is not None]
    assert len(full) == 2 and len(deltas) == 6
    assert max(deltas) < 0.1 * min(full), (deltas, full)
    embedding_bytes = run.embedding.weight.numel() * 4
    assert min(full) > embedding_bytes > 10 * max(deltas)
