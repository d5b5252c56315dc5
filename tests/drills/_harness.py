"""A reusable fault-drill harness: launch a training script under torchrun, inject one fault, relaunch when the fault
ended the job, and compare the final weights bitwise with an uninterrupted run.

One place decides the launch line (:func:`launch_command`), so a change of launcher touches nothing else. A drill is
a :class:`Drill` (script, world size, steps, loader workers, fault); :func:`run_drill` runs it in a directory of its
own and returns a :class:`DrillResult` with every attempt's report and the final weights; :func:`first_difference`
names the first tensor that differs. Seeds are printed so a failing drill replays: ``DRILL_SEED=<seed>``.

The script must accept ``--run-dir --steps --workers --fault --fault-step --fault-rank --launch --fault-launch``
(and ``--checkpoint`` when a drill names a checkpoint preset other than ``local``),
write ``reports/launch<L>_attempt<N>_rank<R>.json`` and, on rank 0 of the attempt that reaches ``--steps``,
``weights.pt`` (``tests/drills/_user_script.py`` is the reference).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from tests._ranks import free_port
from tests.drills._user_code import CHECKPOINTS, FAULTS

ROOT = Path(__file__).resolve().parents[2]
USER_SCRIPT = ROOT / "tests" / "drills" / "_user_script.py"
# faults that end the whole job (the launcher itself): the harness launches it again, as a scheduler's requeue would
_ENDS_THE_JOB = ("sigterm-launcher",)


def drill_seed(default: int = 20250601) -> int:
    """The seed of this session's random drills: ``DRILL_SEED`` when set, so a failure replays."""
    return int(os.environ.get("DRILL_SEED", str(default)))


@dataclass(frozen=True)
class Drill:
    """One drill: what runs, and which fault hits it where."""

    fault: str = "none"
    step: int = 0
    rank: int = 1
    workers: int = 0
    steps: int = 40
    world_size: int = 2
    max_restarts: int = 3
    script: Path = USER_SCRIPT
    timeout_s: float = 240.0
    """Bound on each launch (a hang fails the drill instead of blocking the suite)."""
    checkpoint: str = "local"
    """The checkpoint preset (``--checkpoint`` of the script, see ``tests/drills/_user_code.py``)."""
    args: tuple[str, ...] = ()
    """More arguments of the script (e.g. the train loader of ``tests/drills/_loader_script.py``)."""

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {self.fault!r}")
        if self.fault != "none" and not 0 < self.step < self.steps:
            raise ValueError(f"step must be in (0, steps={self.steps}), got {self.step}")
        if self.checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {self.checkpoint!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")

    @property
    def reference(self) -> Drill:
        """The same run without a fault."""
        return Drill(
            workers=self.workers,
            steps=self.steps,
            world_size=self.world_size,
            script=self.script,
            checkpoint=self.checkpoint,
            args=self.args,
        )

    def describe(self) -> str:
        where = "" if self.checkpoint == "local" else f", checkpoint={self.checkpoint}"
        where += "".join(f", {arg}" for arg in self.args)
        return f"{self.fault} rank {self.rank} step {self.step} (workers={self.workers}, steps={self.steps}{where})"


@dataclass
class DrillResult:
    drill: Drill
    run_dir: Path
    launches: list[subprocess.CompletedProcess[str]] = field(default_factory=list)

    @property
    def reports(self) -> dict[tuple[int, int, int], dict[str, Any]]:
        """``(launch, attempt, rank) -> report`` for every attempt the script started."""
        out = {}
        for path in (self.run_dir / "reports").glob("launch*_attempt*_rank*.json"):
            launch, attempt, rank = (int(part.lstrip("launchemptrk")) for part in path.stem.split("_"))
            out[(launch, attempt, rank)] = json.loads(path.read_text())
        return out

    @property
    def finished(self) -> list[dict[str, Any]]:
        return [r for r in self.reports.values() if r.get("final_step") == self.drill.steps]

    def weights(self) -> dict[str, torch.Tensor]:
        return torch.load(self.run_dir / "weights.pt", weights_only=True)

    def log(self) -> str:
        return "\n".join(f"---- launch {i} (rc={p.returncode})\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}"
                         for i, p in enumerate(self.launches))  # fmt: skip


def launch_command(drill: Drill, script_args: list[str]) -> list[str]:
    """The launch line of the README: torchrun with a c10d rendezvous on this host."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(drill.world_size),
        "--max-restarts", str(drill.max_restarts), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(drill.script), *script_args,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": "1",
        # a fresh rendezvous store per attempt: a restarted worker must not read the killed attempt's gloo address
        # from a shared store (pytorch/pytorch#135712)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }


class LaunchTimeout(subprocess.TimeoutExpired):
    """A launch past its bound, with where each of its processes stood before they were killed."""

    def __init__(self, cmd: list[str], timeout: float, output: str, stderr: str, stacks: str) -> None:
        super().__init__(cmd, timeout, output, stderr)
        self.stacks = stacks

    def evidence(self, frames: int = 6, lines: int = 25) -> str:
        """The tail of the launch's output and each thread's innermost ``frames`` frames: what a CI log shows."""
        tail = "\n".join(f"{self.output or ''}\n{self.stderr or ''}".strip().splitlines()[-lines:])
        return f"stacks at the bound:\n{condense(self.stacks, frames)}\nlast lines of the launch:\n{tail}"


def stacks_of(members: list[psutil.Process]) -> str:
    """``py-spy dump`` of each process (every thread's Python stack), read before a hung launch is killed."""
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if py_spy is None:
        return "(no stacks: py-spy is not installed)"
    dumps = []
    for member in members:
        try:
            done = subprocess.run(
                [py_spy, "dump", "--nonblocking", "--pid", str(member.pid)], capture_output=True, text=True, timeout=30
            )
            dumps.append(done.stdout if done.returncode == 0 else f"Process {member.pid}: py-spy failed: {done.stderr}")
        except (OSError, subprocess.TimeoutExpired) as err:
            dumps.append(f"Process {member.pid}: py-spy failed: {err}")
    return "\n".join(dumps)


def condense(stacks: str, frames: int) -> str:
    """Each process line of a ``py-spy dump``, and each of its threads with its innermost ``frames`` frames."""
    out: list[str] = []
    kept = frames
    for line in stacks.splitlines():
        if line.startswith(("Process ", "Thread ")):
            out.append(line)
            kept = 0
        elif line.startswith(" ") and kept < frames and line.strip():
            out.append(line)
            kept += 1
    return "\n".join(out)


def _run_bounded(cmd: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run``, except that past ``timeout_s`` the whole launch (launcher, ranks, loader workers) is
    SIGKILLed, not the launcher alone: torchrun puts each rank in a session of its own, and a rank would outlive it.
    Then :class:`LaunchTimeout` is raised, with every process's stacks as they stood at the bound."""
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            launcher = psutil.Process(proc.pid)
            members = [launcher, *launcher.children(recursive=True)]
            stacks = stacks_of(members)
            for member in members:
                with contextlib.suppress(psutil.NoSuchProcess):
                    member.kill()
            stdout, stderr = proc.communicate(timeout=30)
            raise LaunchTimeout(cmd, timeout_s, stdout, stderr, stacks) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_drill(drill: Drill, run_dir: Path, max_launches: int = 2, env: dict[str, str] | None = None) -> DrillResult:
    """Run ``drill`` in ``run_dir``; relaunch while the job ended early on a fault that ends it (at most
    ``max_launches`` launches); ``env`` adds to the launch's environment. Raises ``AssertionError`` with the logs
    when no launch finishes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    result = DrillResult(drill, run_dir)
    print(f"drill: {drill.describe()} in {run_dir}", flush=True)
    for launch in range(max_launches):
        args = [
            "--run-dir", str(run_dir), "--steps", str(drill.steps), "--workers", str(drill.workers),
            "--fault", drill.fault, "--fault-step", str(drill.step), "--fault-rank", str(drill.rank),
            "--launch", str(launch), "--fault-launch", "0",
        ]  # fmt: skip
        if drill.checkpoint != "local":
            args += ["--checkpoint", drill.checkpoint]
        args += drill.args
        try:
            proc = _run_bounded(launch_command(drill, args), {**_env(), **(env or {})}, drill.timeout_s)
        except LaunchTimeout as err:
            log = f"{err.output}\n---- stderr ----\n{err.stderr}\n---- stacks at the bound ----\n{err.stacks}"
            (run_dir / f"launch{launch}.log").write_text(log)
            raise
        result.launches.append(proc)
        (run_dir / f"launch{launch}.log").write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
        if proc.returncode == 0 and (run_dir / "weights.pt").exists():
            return result
        if drill.fault not in _ENDS_THE_JOB or launch > 0:
            break
    raise AssertionError(f"drill {drill.describe()} did not finish:\n{result.log()}")


def first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    """The first tensor that is not bitwise equal (with its max abs difference), or None."""
    if a.keys() != b.keys():
        return f"different keys: {sorted(a.keys() ^ b.keys())}"
    for name in a:
        if not torch.equal(a[name], b[name]):
            return f"{name}: max abs diff {(a[name].double() - b[name].double()).abs().max().item():.3g}"
    return None


def random_drills(seed: int, n: int, steps: int = 40, persist_every: int = 10) -> list[Drill]:
    """``n`` drills drawn from ``seed``: a kill or a stop (``FAULTS[1:5]``), rank, step and loader worker count at
    random. ``tests/drills/campaign.py`` draws from every fault kind and checks more."""
    rng = random.Random(seed)
    drills = []
    for _ in range(n):
        fault = rng.choice(FAULTS[1:5])
        if fault == "sigkill-persist":
            step = rng.choice(range(persist_every, steps, persist_every))
        elif fault.startswith("sigterm"):  # a stop is agreed on a step or two after the signal: leave room
            step = rng.randint(2, steps - 10)
        else:
            step = rng.randint(2, steps - 2)
        drills.append(Drill(fault=fault, step=step, rank=rng.randint(0, 1), workers=rng.choice((0, 2)), steps=steps))
    return drills
