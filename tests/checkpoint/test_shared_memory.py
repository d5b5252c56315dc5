"""Snapshots in node-local shared memory: committed once the copy landed, left for the next process, restored from
there, never torn, never of another run, bounded, cleaned.

A "previous process" is simulated in one process by giving its buffers the identity of a dead process (a pid that
does not exist); the multi-rank tests run real gloo ranks, each attempt a new set of processes.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilience.checkpoint import filesystems, host_copy
from lightning_resilience.checkpoint import shared_memory as shm
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.tier import Durability, TierIdentity
from tests._ranks import run_ranks
from tests.checkpoint.conftest import assert_state_equal, make_state, state_at

RUN = "test-run"
DEAD = (2**22 + 12345, 1)  # no such pid (above the kernel's pid_max default of 2**22)


def _tier(shm_dir: Path, run_id: str = RUN, keep: int = 2) -> MemoryTier:
    return MemoryTier(every_n_steps=1, keep=keep, shared_memory=True, shm_dir=str(shm_dir), run_id=run_id)


def _manager(shm_dir: Path, *more: Any, run_id: str = RUN, keep: int = 2) -> CheckpointManager:
    manager = CheckpointManager([_tier(shm_dir, run_id, keep), *more])
    manager.setup()
    return manager


@pytest.fixture
def as_dead_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Call it to make buffers created from then on belong to a process that no longer exists."""

    def dead() -> None:
        monkeypatch.setattr(shm, "process_identity", lambda: DEAD)

    yield dead


def _run_dead_process(shm_dir: Path, steps: list[int], as_dead: Callable[[], None], **kw: Any) -> None:
    """A process that snapshots ``steps`` and dies (no close: what a SIGKILL leaves)."""
    as_dead()
    manager = _manager(shm_dir, **kw)
    for step in steps:
        manager.on_step(step, state_at(step))
    manager.wait_snapshot()


def _files(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.rglob("*") if p.is_file())


def _committed(shm_dir: Path) -> list[int]:
    """Steps whose marker vouches for its buffer as it is now (a marker of an older generation does not)."""
    steps = []
    for buffer in shm_dir.rglob("buf-*.bin"):
        info = shm._read_marker(buffer.with_suffix(".json"), buffer)
        if info is not None:
            steps.append(int(info["step"]))
    return sorted(steps)


def test_a_restarted_process_restores_the_newest_whole_step_without_disk(
    tmp_path: Path, as_dead_process: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    _run_dead_process(tmp_path, [1, 2, 3], as_dead_process)
    monkeypatch.undo()  # the restarted process is alive
    manager = _manager(tmp_path)
    assert manager.memory_steps() == [2, 3]  # keep=2: what the dead process had committed
    restored = manager.restore()
    assert restored is not None and (restored.step, restored.tier) == (3, "memory")
    assert_state_equal(restored.state, make_state(3))
    assert restored.meta == {}


def test_restored_tensors_are_copies_and_the_step_stays_until_a_newer_one_is_committed(
    tmp_path: Path, as_dead_process: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    _run_dead_process(tmp_path, [1, 2, 3], as_dead_process)
    monkeypatch.undo()
    manager = _manager(tmp_path)
    restored = manager.restore()
    assert restored is not None
    restored.state["model"]["weight"].add_(1.0)  # the training state changes: the shared copy must not
    assert manager.memory_steps() == [3]  # the unrestored step 2 was another timeline's: dropped at restore
    # a crash now (before a newer step is committed) would restore step 3 again: it is still there, whole
    again = CheckpointManager([_tier(tmp_path)])
    again.setup()
    assert again.memory_steps() == [3]
    manager.on_step(4, state_at(4))
    manager.wait_snapshot()
    assert manager.memory_steps() == [4]  # step 3 of the dead process is gone, superseded
    assert _committed(tmp_path) == [4]


def test_a_buffer_without_its_marker_is_never_taken_for_a_step(
    tmp_path: Path, as_dead_process: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill in the middle of a copy leaves the buffer without a marker: the step before it is restored."""
    as_dead_process()
    manager = _manager(tmp_path)
    manager.on_step(1, state_at(1))
    manager.wait_snapshot()
    gate = threading.Event()
    copier = manager._pool._copier
    copier.submit(blocker := _blocked(gate))  # the copier thread is busy: the next copy stays in flight
    manager.on_step(2, state_at(2), overlap=lambda t: True)
    assert _committed(tmp_path) == [1], "step 2's marker was written before its copy landed"
    # the process dies here; its torn buffer of step 2 has no marker
    monkeypatch.undo()
    _restart_restores(tmp_path, [1])
    gate.set()
    blocker.done.wait(10)


def _restart_restores(shm_dir: Path, held: list[int]) -> None:
    """A restarted process finds ``held`` in shared memory and restores the newest, exactly."""
    restarted = _manager(shm_dir)
    assert restarted.memory_steps() == held
    restored = restarted.restore()
    assert restored is not None and restored.step == held[-1]
    assert_state_equal(restored.state, make_state(held[-1]))


def _blocked(gate: threading.Event) -> host_copy.CopyJob:
    """A copier job that holds the copier thread until ``gate`` opens."""
    job = host_copy.CopyJob([])
    job.then.append(lambda: gate.wait(30))
    return job


def test_the_marker_of_a_buffer_written_again_never_vouches_for_it(
    tmp_path: Path, as_dead_process: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Buffers are reused: the one being written for step 4 still has its marker of step 2 on disk, of an older
    generation. A kill now leaves step 3 as the newest whole step, never 2 nor 4."""
    as_dead_process()
    manager = _manager(tmp_path, keep=1)
    for step in (1, 2, 3):
        manager.on_step(step, state_at(step), overlap=lambda t: True)
        manager.wait_snapshot()
    markers = {json.loads(p.read_text())["step"] for p in tmp_path.rglob("*.json")}
    assert markers == {2, 3}  # step 2 was evicted: its marker is still there, vouching for nothing
    manager._pool._copier.submit(_blocked(gate := threading.Event()))
    manager.on_step(4, state_at(4), overlap=lambda t: True)
    monkeypatch.undo()
    _restart_restores(tmp_path, [3])
    gate.set()


def test_the_marker_goes_before_a_buffer_is_written_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = _manager(tmp_path, keep=1)
    copy_pairs = host_copy.copy_pairs
    checked: list[int] = []

    def vouched(dst: torch.Tensor) -> Path | None:
        """The marker (if any) that vouches for the buffer ``dst`` is in."""
        for slot in manager._pool._slots:
            arena = slot.arena
            if arena is not None and arena.segment is not None:
                start = arena.data.data_ptr()
                inside = start <= dst.data_ptr() < start + arena.nbytes
                if inside and shm._read_marker(arena.segment.marker, arena.segment.path) is not None:
                    return arena.segment.marker
        return None

    def checking_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, _ in pairs:
            assert vouched(dst) is None, "a buffer is written while a marker still vouches for it"
            checked.append(1)
        copy_pairs(pairs)

    monkeypatch.setattr(host_copy, "copy_pairs", checking_copy)
    for step in range(1, 7):
        manager.on_step(step, state_at(step), overlap=(lambda t: True) if step % 2 else None)
        manager.wait_snapshot()
    assert checked
    assert _committed(tmp_path) == [6]


def test_steps_of_another_run_are_never_restored(
    tmp_path: Path, as_dead_process: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    _run_dead_process(tmp_path, [1, 2], as_dead_process, run_id="another-run")
    monkeypatch.undo()
    manager = _manager(tmp_path)
    assert manager.memory_steps() == []
    assert manager.restore() is None


def test_steps_of_another_world_size_are_removed(
    tmp_path: Path, as_dead_process: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    _run_dead_process(tmp_path, [1], as_dead_process)
    monkeypatch.undo()
    tier = _tier(tmp_path)
    tier.bind(TierIdentity(0, 2))
    assert tier.list_steps() == []
    assert _files(tmp_path) == []


def test_stale_runs_are_swept_only_once_dead_and_old(tmp_path: Path) -> None:
    live = shm.rank_directory(tmp_path, shm.resolve_run_key("live")[0], 0)  # type: ignore[index]
    stale = shm.rank_directory(tmp_path, shm.resolve_run_key("stale")[0], 0)  # type: ignore[index]
    fresh = shm.rank_directory(tmp_path, shm.resolve_run_key("fresh")[0], 0)  # type: ignore[index]
    foreign = tmp_path / shm.SUBDIR / "not-ours"  # a directory this module did not name: never touched
    foreign.mkdir(parents=True)
    pid, started = shm.process_identity()
    for directory, owner in ((live, f"{pid}-{started}"), (stale, f"{DEAD[0]}-1"), (fresh, f"{DEAD[0]}-1")):
        directory.mkdir(parents=True)
        (directory / f"buf-{owner}-0.bin").write_bytes(b"x")
    old = 10_000.0
    for directory in (live, stale):
        os.utime(directory / next(iter(os.listdir(directory))), (old, old))
    removed = shm.sweep_stale_runs(tmp_path, keep="mine", now=old + shm.STALE_AFTER_S + 1)
    assert removed == [stale.parent]
    assert live.exists() and fresh.exists()  # a live writer; a run that died a moment ago (it may restart)
    assert foreign.exists()


def test_a_finished_job_leaves_nothing_behind(tmp_path: Path) -> None:
    manager = _manager(tmp_path, LocalTier(tmp_path / "disk", every_n_steps=2))
    for step in (1, 2, 3):
        manager.on_step(step, state_at(step))
    manager.wait()
    manager.close(finished=True)
    assert _files(tmp_path / shm.SUBDIR) == []
    assert not any((tmp_path / shm.SUBDIR).iterdir())


def test_a_crash_or_a_decided_stop_keeps_the_committed_steps(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    for step in (1, 2, 3):
        manager.on_step(step, state_at(step))
    manager.close()
    assert _committed(tmp_path) == [2, 3]
    # buffers nobody vouches for (the spare slots) are gone: what is left is bounded by keep
    assert sum(name.endswith(".bin") for name in _files(tmp_path)) == 2


def test_too_little_shared_memory_says_so_and_keeps_process_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shm, "free_bytes", lambda path: 1024)
    manager = _manager(tmp_path)
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            manager.on_step(step, state_at(step))
    manager.wait_snapshot()
    assert any("stay in process memory" in r.getMessage() and "MiB free" in r.getMessage() for r in caplog.records)
    assert _files(tmp_path) == []
    assert manager.tiers[0].durability is Durability.process
    restored = manager.restore(memory_only=True)  # the in-process tier still works
    assert restored is not None and restored.step == 3


def _no_run_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "LIGHTNING_RESILIENCE_RUN_DIR",
        "SLURM_JOB_ID",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
    ):
        monkeypatch.delenv(name, raising=False)


def test_no_run_identity_keeps_process_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _no_run_identity(monkeypatch)
    with caplog.at_level(logging.INFO):
        manager = _manager(tmp_path, run_id="")
    assert any("nothing identifies this run" in r.getMessage() for r in caplog.records)
    manager.on_step(1, state_at(1))
    assert _files(tmp_path) == []


def test_run_key_sources_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_run_identity(monkeypatch)
    assert shm.resolve_run_key() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    agent = shm.resolve_run_key()
    assert agent is not None and agent[0].startswith("agent-")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default names nothing
    assert shm.resolve_run_key() == agent
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert shm.resolve_run_key()[0].startswith("torchelastic-job-7-")  # type: ignore[index]
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    assert shm.resolve_run_key()[0].startswith("slurm-1234-")  # type: ignore[index]
    monkeypatch.setenv("LIGHTNING_RESILIENCE_RUN_DIR", "/runs/a/launch")
    assert shm.resolve_run_key()[0].startswith("launch-")  # type: ignore[index]
    assert shm.resolve_run_key("mine")[0].startswith("run-mine-")  # type: ignore[index]
    assert shm.resolve_run_key("a/b") != shm.resolve_run_key("a_b")  # the digest keeps sanitised names apart


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match=r"tiers\.memory\.shm_dir"):
        MemoryTier(shared_memory=True, shm_dir="")


# ------------------------------------------------------------------------------------------- real processes
def _write(rank: int, world: int, tmp: Path, shm_dir: str, steps: int, short_rank: int) -> dict[str, Any]:
    """An attempt that snapshots 1..steps (rank ``short_rank`` stops one step early) and dies without cleaning."""
    manager = CheckpointManager([_tier(Path(shm_dir))])
    manager.setup()
    for step in range(1, steps + (rank != short_rank)):
        manager.on_step(step, lambda step=step: {**make_state(step), "rank": torch.tensor(rank)})
    manager.wait_snapshot()
    return {"held": manager.memory_steps()}


def _restore(rank: int, world: int, tmp: Path, shm_dir: str) -> dict[str, Any]:
    manager = CheckpointManager([_tier(Path(shm_dir))])
    manager.setup()
    restored = manager.restore()
    assert restored is not None
    expected = {**make_state(restored.step), "rank": torch.tensor(rank)}
    assert_state_equal(restored.state, expected)
    return {"step": restored.step, "tier": restored.tier, "listed": manager.memory_steps()}


@pytest.mark.timeout(180)
def test_every_rank_restores_the_newest_step_all_of_them_hold(tmp_path: Path) -> None:
    """Rank 1 died a step earlier than rank 0: both restore the step before, each its own shard, from shared memory
    written by processes that are gone."""
    shm_dir = str(tmp_path / "shm")
    (tmp_path / "first").mkdir()
    (tmp_path / "restart").mkdir()
    written = run_ranks(_write, 2, tmp_path / "first", shm_dir, 4, 1)
    assert [r["held"] for r in written] == [[3, 4], [2, 3]]
    restored = run_ranks(_restore, 2, tmp_path / "restart", shm_dir)
    assert [(r["step"], r["tier"]) for r in restored] == [(3, "memory"), (3, "memory")]


def _killed_mid_copy(shm_dir: str, ready: Any) -> None:
    manager = CheckpointManager([_tier(Path(shm_dir))])
    manager.setup()
    manager.on_step(1, state_at(1))
    manager.wait_snapshot()
    manager._pool._copier.submit(_blocked(threading.Event()))  # the copy of step 2 will never land
    manager.on_step(2, state_at(2), overlap=lambda t: True)
    ready.set()
    threading.Event().wait(60)


@pytest.mark.timeout(120)
def test_a_process_killed_in_the_middle_of_a_copy_leaves_the_step_before(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("forkserver")
    ready = ctx.Event()
    proc = ctx.Process(target=_killed_mid_copy, args=(str(tmp_path), ready))
    proc.start()
    try:
        assert ready.wait(60), "the process never reached the copy"
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    _restart_restores(tmp_path, [1])


@pytest.mark.parametrize("shared", [True, False])
def test_an_exception_saves_to_disk_only_what_shared_memory_does_not_already_keep(tmp_path: Path, shared: bool) -> None:
    """After an exception (a rank-local emergency save) the newest snapshot goes to the local disk only when it lives
    in process memory: in shared memory it already survives the process, and the process ends sooner."""
    memory = MemoryTier(keep=2, shared_memory=shared, shm_dir=str(tmp_path / "shm"), run_id=RUN)
    manager = CheckpointManager([memory, LocalTier(tmp_path / "disk", every_n_steps=100)])
    manager.setup()
    for step in (1, 2, 3):
        manager.on_step(step, state_at(step))
    assert manager.emergency_save() == 3
    assert manager.steps()["local"] == ([] if shared else [3])
    manager.close()


def test_a_shm_dir_on_a_disk_is_used_and_said_to_be_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Buffers in a directory on a disk filesystem are written back to the disk by the kernel: honoured (the setting
    is the user's), and said with the filesystem's type; a tmpfs (the mount table's longest match) is not."""
    ram, spaced = tmp_path / "ram", tmp_path / "in ram"
    ram.mkdir(), spaced.mkdir()  # mount points exist
    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 0:1 / / rw,relatime - ext4 /dev/vda rw\n"
        f"25 22 0:23 / {ram} rw,relatime - tmpfs tmpfs rw\n"
        f"26 22 0:24 / {str(spaced).replace(' ', chr(92) + '040')} rw - tmpfs tmpfs rw\n"
    )
    monkeypatch.setattr(filesystems, "MOUNTINFO", table)
    assert filesystems.filesystem_type(tmp_path / "disk" / "not yet") == "ext4"
    assert filesystems.filesystem_type(ram / "not yet") == filesystems.filesystem_type(spaced) == "tmpfs"
    for where, said in ((tmp_path / "disk", True), (ram, False), (spaced, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            manager = _manager(where)
        manager.on_step(1, state_at(1))
        manager.wait_snapshot()
        warned = [r.getMessage() for r in caplog.records if "not in RAM" in r.getMessage()]
        assert bool(warned) is said, (where, warned)
        assert not said or (f"tiers.memory.shm_dir={where} is on a ext4 filesystem" in warned[0])
        assert _committed(where) == [1]  # used either way
        manager.close(finished=False)
    monkeypatch.setattr(filesystems, "MOUNTINFO", tmp_path / "no such table")
    assert filesystems.filesystem_type(tmp_path) is None
