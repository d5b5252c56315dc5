"""The newest committed step, as the launcher reads it between attempts: from what every rank's checkpoint engine
committed (progress records, wherever the tiers are), or an iteration file."""

from __future__ import annotations

from pathlib import Path

from lightning_resilience.checkpoint.progress import ProgressRecorder, newest_committed
from lightning_resilience.checkpoint.tier import Durability
from lightning_resilience.launch.progress import job_progress, read_iteration_file
from lightning_resilience.rundir import RunDir

TIERS = {"memory": Durability.process, "local": Durability.host, "s3": Durability.remote}


def _recorders(run_dir: RunDir, world: int = 2) -> list[ProgressRecorder]:
    out = [ProgressRecorder(run_dir, rank, world, TIERS) for rank in range(world)]
    for r in out:
        r.start()
    return out


def test_a_step_counts_once_every_rank_committed_it(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    assert job_progress(run_dir, None, local_ranks=2).known is False  # nobody reports: progress unknown
    r0, r1 = _recorders(run_dir)
    progress = job_progress(run_dir, None, local_ranks=2)
    assert progress.known and progress.step is None and progress.describe() == "none"
    r0("local", 4), r1("local", 4), r0("local", 8)  # rank 1 died before committing step 8
    assert job_progress(run_dir, None, local_ranks=2).step == 4
    r0("memory", 9), r1("memory", 9)  # RAM inside the worker dies with it: no progress for a restart
    assert job_progress(run_dir, None, local_ranks=2).step == 4
    r1("s3", 12), r0("s3", 12)  # an object store counts
    assert job_progress(run_dir, None, local_ranks=2).tiers == {"local": 4, "s3": 12}


def test_a_rank_missing_its_record_blocks_the_step_unless_this_node_has_all_its_ranks(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    r0, r1 = (ProgressRecorder(run_dir, rank, 4, TIERS) for rank in (0, 1))  # 4-rank job, node-local run dir
    r0("local", 10), r1("local", 12)
    assert newest_committed(run_dir, local_ranks=4).step is None
    assert newest_committed(run_dir, local_ranks=2).step == 10


def test_a_restarted_rank_keeps_its_record_and_adds_what_its_tiers_list(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    (r0,) = _recorders(run_dir, world=1)
    r0("local", 20)
    again = ProgressRecorder(run_dir, 0, 1, TIERS, listed={"s3": [8, 16], "local": [10]})
    again.start()  # the record only grows: an attempt that dies before its first commit loses nothing
    assert job_progress(run_dir, None, local_ranks=1).tiers == {"local": 20, "s3": 16}


def test_iteration_file(tmp_path: Path) -> None:
    path = tmp_path / "latest_checkpointed_iteration.txt"
    assert read_iteration_file(path) is None
    assert job_progress(RunDir(tmp_path), path, local_ranks=1).known  # a source is named: known, none yet
    path.write_text("1200\n")
    assert read_iteration_file(path) == 1200
    assert job_progress(RunDir(tmp_path), path, local_ranks=1).step == 1200
    path.write_text("not a number")
    assert read_iteration_file(path) is None
