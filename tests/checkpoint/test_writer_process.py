"""The writer process and the raw shard writer: DCP-compatible bytes, checksums computed while writing, errors and
deaths reported to the caller, no orphan after the trainer is killed."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from lightning_resilience.checkpoint.dcp_layout import DATA_FILE, METADATA_FILE
from lightning_resilience.checkpoint.format import checksum_file, read_shard, validate_shard, write_shard
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.snapshot import SnapshotPool, StagedSnapshot
from lightning_resilience.checkpoint.tree import flatten_state
from lightning_resilience.checkpoint.worker import WriterProcess
from tests.checkpoint.conftest import assert_tensors_equal, make_snapshot, make_state, state_at

WAIT = timedelta(seconds=60)


@pytest.fixture
def writer() -> Any:
    proc = WriterProcess(WAIT)
    proc.start()
    yield proc
    proc.close(WAIT)


def _shared_snapshot(tmp_path: Path, step: int, writer: WriterProcess | None) -> tuple[StagedSnapshot, Any]:
    """``make_snapshot(step)`` held in a shared-memory slot, as the manager hands it to a persist."""
    tier = MemoryTier(keep=1, shared_memory=True, shm_dir=str(tmp_path / "shm"), run_id="w")
    from lightning_resilience.checkpoint.tier import TierIdentity

    tier.bind(TierIdentity(0, 1))
    pool = SnapshotPool(max_slots=2, buffers=tier.buffers(2))
    slot = pool.capture(step, flatten_state(make_state(step)), {"epoch": step // 3})
    snap = slot.view(writer)
    assert snap.shared is not None and snap.writer is writer
    return snap, (pool, slot)


def test_the_writer_process_writes_a_shard_dcp_and_our_reader_load(tmp_path: Path, writer: WriterProcess) -> None:
    snap, _ = _shared_snapshot(tmp_path, 4, writer)
    write_shard(tmp_path / "shard", snap, rank=0, world_size=1)
    assert writer.writes == 1
    manifest, loaded = read_shard(tmp_path / "shard")
    assert_tensors_equal(loaded.tensors, make_snapshot(4).tensors)
    assert loaded.skeleton == make_snapshot(4).skeleton and loaded.meta == {"epoch": 1}
    # DCP's own reader loads the same files as it loads its own
    into = {n: torch.empty_like(t) for n, t in make_snapshot(4).tensors.items()}
    dcp.load(into, storage_reader=FileSystemReader(tmp_path / "shard"), no_dist=True)
    assert_tensors_equal(into, make_snapshot(4).tensors)
    # the checksums computed while writing are those of the files as they lie on disk
    for name, info in manifest.files.items():
        assert checksum_file(tmp_path / "shard" / name) == info["xxh3_64"]


def test_raw_bytes_are_the_same_in_the_writer_process_and_in_the_thread(tmp_path: Path, writer: WriterProcess) -> None:
    snap, _ = _shared_snapshot(tmp_path, 2, writer)
    write_shard(tmp_path / "process", snap, rank=0, world_size=1)
    write_shard(tmp_path / "thread", make_snapshot(2), rank=0, world_size=1)
    for name in (DATA_FILE, "skeleton.json"):
        assert (tmp_path / "process" / name).read_bytes() == (tmp_path / "thread" / name).read_bytes()
    assert (tmp_path / "thread" / METADATA_FILE).exists()
    validate_shard(tmp_path / "thread")


def test_a_dcp_save_and_our_raw_save_load_alike(tmp_path: Path) -> None:
    """Our files are what dcp.save writes, record for record (the frames are those of torch.save)."""
    snap = make_snapshot(3)
    dcp.save(dict(snap.tensors), checkpoint_id=tmp_path / "dcp", no_dist=True)
    write_shard(tmp_path / "ours", snap, rank=0, world_size=1)
    assert (tmp_path / "dcp" / DATA_FILE).stat().st_size == (tmp_path / "ours" / DATA_FILE).stat().st_size


def test_a_disk_error_in_the_writer_arrives_with_its_errno(tmp_path: Path, writer: WriterProcess) -> None:
    snap, _ = _shared_snapshot(tmp_path, 1, writer)
    (tmp_path / "taken").mkdir()
    with pytest.raises(OSError) as err:
        write_shard(tmp_path / "taken", snap, rank=0, world_size=1)
    assert err.value.errno == errno.EEXIST
    write_shard(tmp_path / "next", snap, rank=0, world_size=1)  # the writer is still serving


def test_a_writer_that_dies_is_replaced_and_never_hangs_a_persist(tmp_path: Path, writer: WriterProcess) -> None:
    """Killed between requests, the writer is either found dead (a new one takes the request) or the request hits
    the broken pipe (an I/O error, which the persist reports as a failed write); the next write goes through."""
    snap, _ = _shared_snapshot(tmp_path, 1, writer)
    first = writer.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    try:
        write_shard(tmp_path / "maybe", snap, rank=0, world_size=1)
    except OSError as err:
        assert err.errno == errno.EIO
    write_shard(tmp_path / "next", snap, rank=0, world_size=1)
    validate_shard(tmp_path / "next")
    assert writer.pid not in (None, first)


def test_a_manager_persists_through_the_writer_process(tmp_path: Path) -> None:
    tier = MemoryTier(keep=2, shared_memory=True, shm_dir=str(tmp_path / "shm"), run_id="m")
    manager = CheckpointManager([tier, LocalTier(tmp_path / "disk", every_n_steps=2)])
    manager.setup()
    for step in range(1, 5):
        manager.on_step(step, state_at(step))
        manager.wait()  # a persist that finds the previous one running is deferred: not what this test is about
    assert manager._writer.writes == 2
    disk = LocalTier(tmp_path / "disk")
    disk.bind_for_reading(manager.identity)
    assert disk.list_steps() == [2, 4]
    assert_tensors_equal(disk.read(4).tensors, make_snapshot(4).tensors)
    pid = manager._writer.pid
    manager.close(finished=True)
    assert pid is not None and not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split(") ")[-1][:1] != "Z"


def _trainer(pid_file: str, ready: Any) -> None:
    writer = WriterProcess(WAIT)
    writer.start()
    Path(pid_file).write_text(str(writer.pid))
    ready.set()
    time.sleep(120)  # killed long before: the trainer is busy training


@pytest.mark.timeout(120)
def test_no_writer_outlives_a_trainer_killed_with_sigkill(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("forkserver")
    ready = ctx.Event()
    trainer = ctx.Process(target=_trainer, args=(str(tmp_path / "pid"), ready))
    trainer.start()
    try:
        assert ready.wait(60)
        writer_pid = int((tmp_path / "pid").read_text())
        assert _alive(writer_pid)
        assert trainer.pid is not None
        os.kill(trainer.pid, signal.SIGKILL)
    finally:
        trainer.join(30)
    deadline = time.monotonic() + 10
    while _alive(writer_pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # bounded poll of another process's state: there is nothing to wait on
    assert not _alive(writer_pid), "the writer process outlived its killed trainer"


def test_a_writer_that_dies_in_the_middle_of_a_request_is_noticed_at_once(
    tmp_path: Path, writer: WriterProcess
) -> None:
    """The request's segment is a FIFO nobody writes to: the writer blocks opening it, is killed there, and the
    caller gets an I/O error within a second or so instead of waiting for the request's timeout."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    snap, _ = _shared_snapshot(tmp_path, 1, writer)
    stuck = StagedSnapshot(snap.step, snap.skeleton, snap.tensors, snap.meta, shared=replace(snap.shared, path=fifo),
                           writer=writer)  # fmt: skip
    pid = writer.pid
    assert pid is not None

    def kill_when_blocked() -> None:
        wchan = Path(f"/proc/{pid}/wchan")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and wchan.read_text() != "wait_for_partner":
            time.sleep(0.01)  # bounded poll of another process's state
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_blocked)
    killer.start()
    start = time.monotonic()
    with pytest.raises(OSError) as err:
        write_shard(tmp_path / "lost", stuck, rank=0, world_size=1)
    killer.join(30)
    assert err.value.errno == errno.EIO and "exit code -9" in str(err.value)
    assert time.monotonic() - start < 30 < WAIT.total_seconds()


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_an_error_in_the_writer_process_reaches_the_training_thread(tmp_path: Path, policy: str) -> None:
    """The writer process fails a write (its segment is gone: ENOENT there): the persist records the failure, and with
    ``on_persist_error=raise`` every rank raises it at the next persist agreement, on the training thread."""
    from lightning_resilience.checkpoint.config import CheckpointConfig
    from lightning_resilience.checkpoint.errors import CheckpointWorkerError

    tier = MemoryTier(keep=2, shared_memory=True, shm_dir=str(tmp_path / "shm"), run_id="e")
    config = CheckpointConfig(on_persist_error=policy)
    manager = CheckpointManager([tier, LocalTier(tmp_path / "disk", every_n_steps=2)], config)
    manager.setup()
    write_files = manager._writer.write_files
    manager._writer.write_files = lambda directory, segment, *rest: write_files(  # type: ignore[method-assign]
        directory, tmp_path / "gone", *rest
    )
    manager.on_step(1, state_at(1))
    manager.on_step(2, state_at(2))
    manager.wait(hold_failure=True)
    manager.on_step(3, state_at(3))
    assert manager.stats.tiers["local"].failures == 1
    assert "No such file or directory" in str(manager.stats.tiers["local"].last_error)
    if policy == "raise":
        with pytest.raises(CheckpointWorkerError, match=r"failed on rank\(s\) \[0\]"):
            manager.on_step(4, state_at(4))
    else:
        manager.on_step(4, state_at(4))
    manager.close(finished=True)
