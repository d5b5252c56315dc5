"""The README's first example on the launch lines users type, 2 CPU ranks, real processes, real SIGKILLs.

* plain ``torchrun --max-restarts 2 --master-port P`` (the static rendezvous, whose agent store outlives every
  attempt), Lightning's default DDP strategy, ``TieredCheckpoint`` alone: a rank is SIGKILLed, the restart comes up
  (the suite gave each attempt a store of its own before the process group existed) and the job ends bitwise equal
  to an uninterrupted run; ``README_DRILLS=3`` (``make readme-drills``) runs three such drills in a row;
* ``lightning-resilience launch --nproc-per-node 2 --max-restarts 2 script.py`` without ``--run-dir``: it runs
  (the default run directory is said at start), rank 0 sees torchrun's contract (``TORCHELASTIC_RESTART_COUNT``
  0, 1, 2, ``TORCHELASTIC_MAX_RESTARTS`` 2, one ``TORCHELASTIC_RUN_ID``), and the job that was killed twice while
  committing steps at a path of its own, outside any run directory, is not stopped for lack of progress; every
  rank of every attempt ran in a fork of its standby worker (warm), saw torchrun's ``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE`` and ``MASTER_PORT`` (Lightning too, at import), and the job ends bitwise equal to an uninterrupted
  run;
* ``LAUNCH_DRILLS=all`` adds: killed three times with progress in between (tiers outside the run directory), and a
  job whose only persistent tier is a remote one (an fsspec store), judged by what it committed there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_resilience.launch.records import AttemptRecord, read_records
from lightning_resilience.rundir import RunDir
from tests._ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "drills" / "_readme_script.py"
STEPS = 40
TIMEOUT_S = 300
README_DRILLS = int(os.environ.get("README_DRILLS", "1"))
ALL_LAUNCH_DRILLS = os.environ.get("LAUNCH_DRILLS") == "all"

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    for name in ("LIGHTNING_RESILIENCE", "LIGHTNING_RESILIENCE_ATTEMPT", "LIGHTNING_RESILIENCE_RUN_DIR",
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "SLURM_JOB_ID"):  # fmt: skip
        env.pop(name, None)
    return env


def _run(cmd: list[str], cwd: Path, log: Path) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as err:  # a hang fails the drill instead of blocking the suite
        log.write_text(f"{err.stdout}\n---- stderr ----\n{err.stderr}")
        raise AssertionError(f"hung for {TIMEOUT_S} s: {cmd}") from err
    log.write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    return proc


def _script_args(tmp: Path, *extra: str) -> list[str]:
    return [str(SCRIPT), "--ckpt", str(tmp / "user_ckpt"), "--out", str(tmp / "out"), "--steps", str(STEPS), *extra]


def _torchrun(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "2",
        "--master-port", str(free_port()), *_script_args(tmp, *extra),
    ]  # fmt: skip
    return _run(cmd, tmp, tmp / "torchrun.log")


def _launcher() -> list[str]:
    console = Path(sys.executable).parent / "lightning-resilience"
    return [str(console)] if console.exists() else [sys.executable, "-m", "lightning_resilience.cli"]


def _envs(tmp: Path, rank: int = 0) -> list[dict[str, str | None]]:
    return [json.loads(line) for line in (tmp / "out" / f"env_rank{rank}.jsonl").read_text().splitlines()]


def _weights(tmp: Path) -> dict[str, torch.Tensor]:
    return torch.load(tmp / "out" / "weights.pt", weights_only=True)


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs from the uninterrupted run"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("readme_reference")
    proc = _torchrun(tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _weights(tmp)


@pytest.mark.parametrize("drill", range(README_DRILLS))
def test_readme_example_under_plain_torchrun_restarts_and_ends_bitwise_equal(
    tmp_path: Path, reference: dict[str, torch.Tensor], drill: int
) -> None:
    kill_step = 9 + 7 * drill  # 9, 16, 23: before, on and after a persist step
    proc = _torchrun(tmp_path, "--kill-steps", str(kill_step))
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert f"DRILL: rank 1 SIGKILL at step {kill_step} (attempt 0)" in proc.stdout
    envs = _envs(tmp_path)
    assert [e["TORCHELASTIC_RESTART_COUNT"] for e in envs] == ["0", "1"]  # one restart, and it came up
    assert all(e["LIGHTNING_RESILIENCE_ATTEMPT_STORE"] for e in envs)  # each attempt met in a store of its own
    _assert_bitwise(_weights(tmp_path), reference)


def _attempts(run_dir: Path) -> list[AttemptRecord]:
    return [r for r in read_records(RunDir(run_dir).launch().root) if isinstance(r, AttemptRecord)]


def test_launch_without_a_run_dir_keeps_torchruns_contract_and_sees_progress_outside_the_run_dir(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    port = free_port()
    cmd = [*_launcher(), "launch", "--nproc-per-node", "2", "--max-restarts", "2", "--master-port", str(port),
           *_script_args(tmp_path, "--kill-steps", "12,24")]  # fmt: skip
    proc = _run(cmd, tmp_path, tmp_path / "launch.log")
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "no --run-dir given: the run directory is lightning_resilience_runs/" in proc.stderr
    (run_dir,) = (tmp_path / "lightning_resilience_runs").iterdir()
    envs = _envs(tmp_path)
    assert [e["TORCHELASTIC_RESTART_COUNT"] for e in envs] == ["0", "1", "2"]
    assert {e["TORCHELASTIC_MAX_RESTARTS"] for e in envs} == {"2"}
    run_ids = {e["TORCHELASTIC_RUN_ID"] for e in envs}
    assert len(run_ids) == 1 and None not in run_ids
    assert run_ids == {(RunDir(run_dir).launch().run_id).read_text().strip()}
    # warm restarts: each rank of each attempt is a new fork of its standby worker, with torchrun's variables
    launch = RunDir(run_dir).launch()
    for rank in (0, 1):
        seen = _envs(tmp_path, rank)
        assert all(e["RANK"] == e["LOCAL_RANK"] == str(rank) == str(e["rank_zero_only_at_import"]) for e in seen)
        assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_PORT"]) for e in seen} == {("2", "2", str(port))}
        records = [json.loads(launch.rank_record(a, rank).read_text()) for a in range(3)]
        assert [r["start"] for r in records] == ["standby"] * 3, records
        assert [r["pid"] for r in records] == [e["pid"] for e in seen] and len({e["pid"] for e in seen}) == 3
    assert ": cold start: " not in proc.stderr  # no rank had to import for itself
    records = _attempts(run_dir)
    # the user's LocalTier is at a path of its own: its commits reach the launcher through the progress records
    _assert_progressed(records, kills=(12, 24))
    assert records[-1].decision == "done"
    _assert_bitwise(_weights(tmp_path), reference)


def _assert_progressed(records: list[AttemptRecord], kills: tuple[int, ...]) -> None:
    """Each killed attempt committed a newer step (the step of its kill, or a little before it when a slow persist
    made the engine defer one), and each restart started from it."""
    assert len(records) == len(kills) + 1 and all(r.progress_known for r in records)
    for record, kill, before in zip(records, kills, (0, *kills)):
        assert record.progress and record.no_progress_count == 0 and record.decision == "restart", record
        assert record.step_at_end is not None and before < record.step_at_end <= kill, (record, kill)
    assert [r.step_at_start for r in records[1:]] == [r.step_at_end for r in records[:-1]]


def _launch(tmp: Path, *extra: str, max_restarts: int = 3) -> tuple[subprocess.CompletedProcess[str], Path]:
    run_dir = tmp / "run"
    cmd = [*_launcher(), "launch", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
           "--master-port", str(free_port()), "--run-dir", str(run_dir), *_script_args(tmp, *extra)]  # fmt: skip
    return _run(cmd, tmp, tmp / "launch.log"), run_dir


@pytest.mark.skipif(not ALL_LAUNCH_DRILLS, reason="a longer drill: make launch-drills (LAUNCH_DRILLS=all)")
def test_killed_three_times_with_progress_in_between_is_not_stopped(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    proc, run_dir = _launch(tmp_path, "--kill-steps", "12,24,36")
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = _attempts(run_dir)
    _assert_progressed(records, kills=(12, 24, 36))
    assert records[-1].decision == "done"
    _assert_bitwise(_weights(tmp_path), reference)


@pytest.mark.skipif(not ALL_LAUNCH_DRILLS, reason="a longer drill: make launch-drills (LAUNCH_DRILLS=all)")
def test_a_job_with_a_remote_tier_only_is_judged_by_it(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    store = f"file://{tmp_path / 'object_store'}"
    proc, run_dir = _launch(tmp_path, "--kill-steps", "12,24,36", "--remote", store, "--remote-only")
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = _attempts(run_dir)
    _assert_progressed(records, kills=(12, 24, 36))
    newest = records[2].step_at_end
    assert f"attempt 3 starting (newest committed step: {newest} (remote {newest}))" in proc.stderr
    _assert_bitwise(_weights(tmp_path), reference)
