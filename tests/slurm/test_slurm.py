"""The Slurm recipe (``recipes/schedulers/slurm.sbatch``) on a real one-node Slurm cluster (``.ci/slurm.sh``, started by
``make slurm``, which ``make test`` runs): the README's example on 2 CPU ranks, real SIGKILLs.

* ``sbatch --requeue``: a kill the launcher cannot restart (``--max-restarts 0``) ends the launcher with 1, its verdict
  says requeue, the batch script requeues the job, and the requeued job resumes and ends bitwise equal to an
  uninterrupted run;
* a job that cannot get past a step stops with 88 and is not requeued, although ``srun``, tearing the step down,
  ends with 143 (a second task stands for another node's launcher, which srun SIGTERMs): the verdict is in a file.

Skipped, with the reason, where Slurm cannot be installed or started (``$SLURM_STATE/skip``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_resilience.launch.records import AttemptRecord, LaunchRecord, read_records
from lightning_resilience.rundir import RunDir
from tests._ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "schedulers" / "slurm.sbatch"
SCRIPT = ROOT / "tests" / "drills" / "_readme_script.py"
STATE = Path(os.environ.get("SLURM_STATE", "/tmp/lightning_resilience_slurm"))
JOB_DEADLINE_S = 300
STEPS = 24


def _cluster() -> str | None:
    """The slurm.conf of the running test cluster, or None."""
    ready = STATE / "ready"
    return ready.read_text().strip() if ready.is_file() else None


def _why_not() -> str:
    skip = STATE / "skip"
    if skip.is_file():
        return f"Slurm is not available here: {skip.read_text().strip()}"
    return "no test Slurm cluster: run `make slurm` (.ci/slurm.sh) first"


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_cluster() is None, reason=_why_not())]


def _env(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "SLURM_CONF": str(_cluster()),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        **extra,
    }
    for name in ("LIGHTNING_RESILIENCE", "LIGHTNING_RESILIENCE_ATTEMPT", "LIGHTNING_RESILIENCE_RUN_DIR"):
        env.pop(name, None)
    for name in [n for n in env if n.startswith("SLURM_") and n != "SLURM_CONF"]:  # not a job of the test's own
        env.pop(name)
    return env


def _launcher() -> str:
    console = Path(sys.executable).parent / "lightning-resilience"
    assert console.exists(), "the console script of this environment (pip install -e .)"
    return str(console)


def _job(job: str, env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _run_job(tmp: Path, sbatch_args: list[str], script_args: list[str], **exports: str) -> tuple[dict[str, str], str]:
    """Submit the recipe, let a requeued job start again at once (Slurm holds it ~2 minutes), wait for its end."""
    env = _env(**exports)
    cmd = ["sbatch", "--parsable", f"--chdir={tmp}", f"--output={tmp}/slurm-%j.out", "--export=ALL", *sbatch_args,
           str(RECIPE), *script_args]  # fmt: skip
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    deadline = time.monotonic() + JOB_DEADLINE_S
    nudged: set[str] = set()  # the requeues whose start was brought forward (once each)
    while True:
        info = _job(job, env)
        state = info.get("JobState", "")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        restart = info.get("Restarts", "")
        if state == "PENDING" and info.get("Reason") == "BeginTime" and restart not in nudged:  # requeued: start soon
            nudged.add(restart)
            # not within the second of the requeue: slurmd revokes the old run's credential with one-second
            # granularity, and a credential issued in that same second is refused ("Job credential revoked")
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+2"], env=env, timeout=30)
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env, timeout=30)
            raise AssertionError(f"job {job} did not end within {JOB_DEADLINE_S} s: {info}")
        time.sleep(1)
    return info, (tmp / f"slurm-{job}.out").read_text()


def _script_args(tmp: Path, *extra: str) -> list[str]:
    return [str(SCRIPT), "--ckpt", str(tmp / "user_ckpt"), "--out", str(tmp / "out"), "--steps", str(STEPS), *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("slurm_reference")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           *_script_args(tmp)]  # fmt: skip
    subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=JOB_DEADLINE_S, check=True)
    return torch.load(tmp / "out" / "weights.pt", weights_only=True)


def test_requeue_after_a_kill_resumes_bitwise(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    run_dir = tmp_path / "run"
    info, log = _run_job(
        tmp_path, [], _script_args(tmp_path, "--kill-steps", "12"),
        RUN_DIR=str(run_dir), NPROC="2", MAX_RESTARTS="0", RDZV_PORT=str(free_port()), LR=_launcher(),
    )  # fmt: skip
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log)
    assert "DRILL: rank 1 SIGKILL at step 12" in log and "restart 1 of the job" in log, log
    records = list(read_records(RunDir(run_dir).launch().root))
    launches = [r for r in records if isinstance(r, LaunchRecord)]
    attempts = [r for r in records if isinstance(r, AttemptRecord)]
    assert [launch.first_attempt for launch in launches] == [0, 1]  # the requeue continued the record
    assert len({launch.run_id for launch in launches}) == 1  # the job id: one run id across the requeue
    assert [(a.decision, a.exit_code) for a in attempts] == [("stop", 1), ("done", 0)]
    assert attempts[1].step_at_start is not None and attempts[1].step_at_start > 0  # it resumed, not restarted
    weights = torch.load(tmp_path / "out" / "weights.pt", weights_only=True)
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)


def test_a_job_that_cannot_progress_is_not_requeued_although_srun_ends_with_143(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # task 1 stands for another node's launcher: srun SIGTERMs it when task 0 (ours) ends non-zero, and then ends 143
    wrapper = tmp_path / "lr"
    wrapper.write_text(
        "#!/bin/bash\n"
        'if [ "${SLURM_PROCID:-0}" = 1 ]; then trap "exit 143" TERM; sleep 600 & wait; exit 0; fi\n'
        f'exec {_launcher()} "$@"\n'
    )
    wrapper.chmod(0o755)
    info, log = _run_job(
        tmp_path, ["--ntasks-per-node=2"], _script_args(tmp_path, "--always-kill-step", "6"),
        RUN_DIR=str(run_dir), NPROC="2", MAX_RESTARTS="5", RDZV_PORT=str(free_port()), LR=str(wrapper),
        SRUN_ARGS="--ntasks=2", LAUNCH_ARGS="--max-no-progress-restarts 2",
    )  # fmt: skip
    assert "srun exit 143" in log, log  # the launcher's 88 did not reach the batch script through srun
    verdict = json.loads(RunDir(run_dir).launch().verdict.read_text())
    assert verdict["exit_code"] == 88 and verdict["requeue"] is False, verdict
    assert "do not requeue" in log
    assert info["Restarts"] == "0" and info["JobState"] == "COMPLETED", (info, log)
    attempts = [r for r in read_records(RunDir(run_dir).launch().root) if isinstance(r, AttemptRecord)]
    assert [a.progress for a in attempts] == [True, False, False]
