"""Engine hooks other components build on: metadata providers, bounded rollback, emergency save from RAM."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from tests.checkpoint.conftest import assert_state_equal, make_state, state_at


def _manager(managers: list[CheckpointManager], *tiers: object) -> CheckpointManager:
    manager = CheckpointManager(list(tiers), CheckpointConfig())  # type: ignore[arg-type]
    manager.setup()
    managers.append(manager)
    return manager


def test_meta_providers_reach_the_manifest(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """What a provider says about a step is stored with it and comes back on restore."""
    manager = _manager(managers, LocalTier(tmp_path, every_n_steps=1, keep=3))
    manager.add_meta_provider(lambda step: {"verified": step % 2 == 0})
    for step in (1, 2):
        manager.on_step(step, state_at(step), meta={"epoch": 0})
        assert manager.wait()
    for step, verified in ((1, False), (2, True)):
        restored = manager.restore(step)
        assert restored is not None and restored.meta == {"epoch": 0, "verified": verified}


def test_restore_max_step_rolls_back_to_an_older_step(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """``max_step`` picks the newest step at or below it, across tiers."""
    manager = _manager(managers, MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path, every_n_steps=2, keep=3))
    for step in range(1, 6):
        manager.on_step(step, state_at(step))
        assert manager.wait()
    assert manager.steps() == {"memory": [4, 5], "local": [2, 4]}
    restored = manager.restore(max_step=3)
    assert restored is not None and (restored.step, restored.tier) == (2, "local")
    assert_state_equal(restored.state, make_state(2))


def test_emergency_save_persists_the_newest_ram_snapshot(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """The newest RAM step lands on disk although no disk cadence was due; a restart restores it."""
    manager = _manager(managers, MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path, every_n_steps=10, keep=2))
    for step in range(1, 8):
        manager.on_step(step, state_at(step))
    assert manager.emergency_save(timedelta(seconds=30)) == 7
    assert manager.steps()["local"] == [7]
    assert manager.stats.tiers["local"].writes == 1
    manager.close()
    restarted = _manager(managers, LocalTier(tmp_path, every_n_steps=10, keep=2))
    restored = restarted.restore()
    assert restored is not None and restored.step == 7
    assert_state_equal(restored.state, make_state(7))


def test_emergency_save_without_snapshot_returns_none(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    manager = _manager(managers, MemoryTier(every_n_steps=5, keep=1), LocalTier(tmp_path, every_n_steps=10, keep=2))
    manager.on_step(1, state_at(1))  # no tier wants step 1
    assert manager.emergency_save(timedelta(seconds=5)) is None
    assert manager.steps()["local"] == []


def test_emergency_save_survives_a_failing_tier(tmp_path: Path, managers: list[CheckpointManager]) -> None:
    """A tier that cannot be written is counted as a failure; the other tier still gets the step."""
    blocker = tmp_path / "blocked"
    blocker.write_text("not a directory")
    manager = _manager(
        managers,
        MemoryTier(every_n_steps=1, keep=1),
        LocalTier(blocker / "sub", every_n_steps=10, keep=2, name="broken"),
        LocalTier(tmp_path / "ok", every_n_steps=10, keep=2, name="ok"),
    )
    manager.on_step(3, state_at(3))
    assert manager.emergency_save(timedelta(seconds=30)) == 3
    assert manager.stats.tiers["broken"].failures == 1
    assert manager.steps()["ok"] == [3]


def test_commit_listeners_hear_each_persistent_commit_from_the_persist_thread(
    tmp_path: Path, managers: list[CheckpointManager]
) -> None:
    """Told as soon as a tier committed (no later call on the training thread needed), RAM tiers never; emergency
    saves too; a failing listener fails no checkpoint."""
    from lightning_resilience.checkpoint.progress import record_progress
    from lightning_resilience.launch.progress import job_progress
    from lightning_resilience.rundir import RunDir

    manager = _manager(managers, MemoryTier(every_n_steps=1, keep=2), LocalTier(tmp_path / "ckpt", every_n_steps=2))
    heard: list[tuple[str, int]] = []
    manager.add_commit_listener(lambda tier, step: heard.append((tier, step)))
    manager.add_commit_listener(lambda tier, step: 1 / 0)
    record_progress(manager, RunDir(tmp_path / "run"))
    for step in range(1, 5):
        manager.on_step(step, state_at(step))
        assert manager._worker.wait_idle(timedelta(seconds=30))  # the worker is done: nothing collected yet
    assert heard == [("local", 2), ("local", 4)]
    manager.on_step(5, state_at(5))
    assert manager.emergency_save(timedelta(seconds=30)) == 5
    assert heard[-1] == ("local", 5)
    assert job_progress(RunDir(tmp_path / "run"), None, local_ranks=1).tiers == {"local": 5}
