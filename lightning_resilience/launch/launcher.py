"""The launch loop: one torchrun per attempt, restarts decided here from how the ranks ended and the committed steps.

Each attempt runs :mod:`lightning_resilience.launch.attempt` in a new process (torchrun's own ``run`` with
``--max-restarts 0``), so every attempt gets a new elastic agent and a new rendezvous store. After it ends the
launcher reads what torchrun observed and what each rank recorded, finds the culprit, collects hang stack dumps and
fault notes, reads the newest committed step, appends one record to ``<run_dir>/launch/attempts.jsonl`` and decides
(:class:`~lightning_resilience.launch.policy.RestartPolicy`): done, restart, or stop with a code for the scheduler.

Restarts are warm (:mod:`.standby`): per local rank a standby worker has imported what the script imports, and each
rank of each attempt runs in a fork of it, in the environment torchrun gives the rank; the next attempt's torchrun
agent is started while the current attempt trains. An attempt process ends as soon as its outcome is written.

A SIGTERM (or SIGINT) to the launcher is passed to the workers first, the way a scheduler's preemption notice
reaches them, so they can agree on a step and save; torchrun's agent is stopped only if they have not ended within
``term_timeout_s``. The launcher then exits with :attr:`ExitCode.PREEMPTED` (130 after SIGINT).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from lightning_resilience.ft.restart import atomic_write_json
from lightning_resilience.launch.analysis import analyse, summary
from lightning_resilience.launch.policy import RestartPolicy, requeue_wanted
from lightning_resilience.launch.progress import Progress, job_progress
from lightning_resilience.launch.records import AttemptRecord, LaunchRecord, append_record, read_records
from lightning_resilience.launch.standby import AgentAhead, StandbyWorkers
from lightning_resilience.launch.worker import ATTEMPT_ENV, RANK_RECORD_ENV, TORCHELASTIC_ENV
from lightning_resilience.rundir import RUN_DIR_ENV, LaunchDir, RunDir

__all__ = ["LaunchOptions", "Launcher"]

log = logging.getLogger(__name__)

_FORWARDED = (signal.SIGTERM, signal.SIGINT)
_AGENT_STOP_MARGIN_S = 10.0  # torchrun's agent gives its workers --shutdown-timeout (30 s) after its SIGTERM
_AHEAD_AFTER_S = 30.0  # after a restart the next agent starts once the attempt committed a step, or after this long
_POLL_S = 0.5
SCHEDULER_JOB_ENVS = ("SLURM_JOB_ID",)
"""A scheduler's job id, kept by its requeues: the run id of a job launched without ``--rdzv-id``."""


@dataclass(kw_only=True)
class LaunchOptions:
    """The launcher's own settings (torchrun's come from torchrun's parser)."""

    run_dir: Path
    """Run directory (:class:`~lightning_resilience.rundir.RunDir`): records go to ``launch/``, the workers' files
    and progress records are read there."""
    max_restarts: int
    """In-job restarts (torchrun's ``--max-restarts``; torchrun itself runs each attempt with 0)."""
    max_no_progress_restarts: int = 3
    """Stop with ExitCode.NO_PROGRESS after this many consecutive attempts without a newer committed step (0: off)."""
    iteration_file: Path | None = None
    """A file holding the newest committed step (NVRx's iteration file), read besides the run directory."""
    term_timeout_s: float = 25.0
    """After SIGTERM, how long the workers get to save and end before torchrun's agent is stopped."""
    nproc_per_node: int = 1
    multi_node: bool = False
    """Records then go to ``launch/<host>/``: each node's launcher keeps its own."""
    run_id: str | None = None
    """The job's run id (torchrun's ``--rdzv-id`` when given); by default the one recorded in the run directory,
    else the scheduler's job id, else a new one."""
    standby: bool = True
    """Warm restarts: standby workers that imported what the script imports, and the next agent started ahead."""

    def __post_init__(self) -> None:
        if self.term_timeout_s <= 0:
            raise ValueError(f"term_timeout_s must be > 0, got {self.term_timeout_s}")
        RestartPolicy(max_restarts=self.max_restarts, max_no_progress_restarts=self.max_no_progress_restarts)


class Launcher:
    """Runs ``torchrun`` attempts until the job finishes or the policy stops it; :meth:`run` returns the exit code."""

    def __init__(self, options: LaunchOptions, torchrun: dict[str, Any], argv: list[str]) -> None:
        self.options = options
        self.policy = RestartPolicy(
            max_restarts=options.max_restarts, max_no_progress_restarts=options.max_no_progress_restarts
        )
        self.torchrun = torchrun
        self.argv = argv
        self.host = socket.gethostname()
        self.run_dir = RunDir(options.run_dir.absolute())  # the ranks may change their working directory
        self.launch = self.run_dir.launch(self.host if options.multi_node else None)
        self.launch_dir = self.launch.root
        self.launch_id = uuid.uuid4().hex[:12]
        self.run_id = self._run_id()
        self._signalled: int | None = None
        self._agent: subprocess.Popen[bytes] | None = None
        self._said_unknown = False
        self._agents = AgentAhead()
        self._standby: StandbyWorkers | None = None

    def _run_id(self) -> str:
        """Stable across the attempts of this launch and across requeues of the run directory."""
        recorded = _read_text(self.launch.run_id)
        chosen = self.options.run_id or recorded
        chosen = chosen or next((os.environ[e] for e in SCHEDULER_JOB_ENVS if os.environ.get(e)), None)
        chosen = chosen or f"lr-{uuid.uuid4().hex[:12]}"
        if chosen != recorded:
            self.launch.root.mkdir(parents=True, exist_ok=True)
            tmp = self.launch.run_id.with_name(f".run_id.tmp-{os.getpid()}")
            tmp.write_text(chosen + "\n")
            os.replace(tmp, self.launch.run_id)
        return chosen

    # ---------------------------------------------------------------- progress
    def progress(self) -> Progress:
        """What the job has committed anywhere it writes: the ranks' progress records, the iteration file."""
        return job_progress(self.run_dir, self.options.iteration_file, local_ranks=self.options.nproc_per_node)

    def newest_step(self) -> int | None:
        return self.progress().step

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signalled is None:
            self._signalled = signum
            _say(f"got {signal.Signals(signum).name}: passing it to the workers (they save and stop)")
            if self._agent is not None:
                _signal_workers(self._agent.pid, signum)

    def _under_way(self, at_start: Progress, started: float) -> bool:
        """The attempt trains: it committed a newer step, or it has run for a while."""
        if time.time() - started > _AHEAD_AFTER_S:
            return True
        step = self.progress().step
        return step is not None and (at_start.step is None or step > at_start.step)

    def _stop_agent(self, agent: subprocess.Popen[bytes]) -> None:
        """Bounded: the workers had ``term_timeout_s``; then torchrun's agent stops them; then everything is killed."""
        agent_stop_s = float(self.torchrun.get("shutdown_timeout") or 30.0) + _AGENT_STOP_MARGIN_S
        for sig, wait_s in ((signal.SIGTERM, agent_stop_s), (signal.SIGKILL, _AGENT_STOP_MARGIN_S)):
            try:
                os.killpg(agent.pid, sig)  # the agent and its workers: its own session
            except ProcessLookupError:
                return
            try:
                agent.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    # --------------------------------------------------------------------- run
    def run(self) -> int:
        previous = [r for r in read_records(self.launch_dir) if isinstance(r, AttemptRecord)]
        attempt = previous[-1].attempt + 1 if previous else 0
        no_progress = previous[-1].no_progress_count if previous and previous[-1].decision != "done" else 0
        append_record(
            self.launch_dir,
            LaunchRecord(
                launch_id=self.launch_id,
                started_at=time.time(),
                argv=self.argv,
                run_dir=str(self.options.run_dir),
                max_restarts=self.options.max_restarts,
                max_no_progress_restarts=self.options.max_no_progress_restarts,
                nproc_per_node=self.options.nproc_per_node,
                nnodes=str(self.torchrun.get("nnodes")),
                rdzv_backend=str(self.torchrun.get("rdzv_backend")),
                host=self.host,
                pid=os.getpid(),
                first_attempt=attempt,
                run_id=self.run_id,
            ),
        )
        _say(f"run directory {self.run_dir.root}, run id {self.run_id}, attempt records in {self.launch.attempts}")
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in _FORWARDED}
        try:
            self._start_standby()
            restarts = 0
            while True:
                record = self._attempt(attempt, restarts, no_progress)
                append_record(self.launch_dir, record)
                _say(summary(record, self.launch))
                if record.decision != "restart":
                    assert record.exit_code is not None
                    write_verdict(self.launch, record)
                    return record.exit_code
                no_progress, attempt, restarts = record.no_progress_count, attempt + 1, restarts + 1
        finally:
            self._agents.stop()
            if self._standby is not None:
                self._standby.stop()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _start_standby(self) -> None:
        if not self.options.standby:
            return
        why = StandbyWorkers.unavailable(self.torchrun)
        if why:
            _say(f"no standby workers ({why}): every attempt's ranks start cold")
            return
        self._standby = StandbyWorkers(self.torchrun, self.options.nproc_per_node, _say)
        self._standby.start()

    def _attempt(self, attempt: int, restarts: int, no_progress: int) -> AttemptRecord:
        folder = self.launch.attempt(attempt)
        shutil.rmtree(folder, ignore_errors=True)  # a requeued job may reuse the index of an attempt never recorded
        folder.mkdir(parents=True)
        spec = self.launch.spec(attempt)
        env = {
            ATTEMPT_ENV: str(attempt),
            RUN_DIR_ENV: str(self.run_dir.root),
            RANK_RECORD_ENV: self.launch.rank_record_template(attempt),
            # torchrun's per-attempt contract, which one torchrun per attempt would break: the worker puts it back
            TORCHELASTIC_ENV: json.dumps(
                {
                    "TORCHELASTIC_RESTART_COUNT": str(restarts),
                    "TORCHELASTIC_MAX_RESTARTS": str(self.options.max_restarts),
                    "TORCHELASTIC_RUN_ID": self.run_id,
                }
            ),
            **(self._standby.attempt_env() if self._standby is not None else {}),
        }
        torchrun_spec = {"attempt": attempt, "torchrun": self.torchrun, "outcome": str(self.launch.outcome(attempt))}
        atomic_write_json(spec, {**torchrun_spec, "env": env})
        at_start = self.progress()
        started = time.time()
        _say(f"attempt {attempt} starting (newest committed step: {at_start.describe()})")
        agent = self._agents.take(spec)
        self._agent = agent
        if self._signalled is not None:  # a signal that came between two attempts
            _signal_workers(agent.pid, self._signalled)
        deadline: float | None = None
        ahead = self.options.standby and restarts < self.options.max_restarts
        agent_fd = _pidfd(agent.pid)  # readable the moment the agent ends (polling would see it up to 50 ms later)
        while agent.poll() is None:
            if self._signalled is not None and deadline is None:
                deadline = time.monotonic() + self.options.term_timeout_s
            if deadline is not None and time.monotonic() > deadline:
                _say(f"workers still running {self.options.term_timeout_s:.0f} s after the signal: stopping torchrun")
                self._stop_agent(agent)
                break
            # the next attempt's agent imports now, not after a failure: at once for the launch's first attempt
            # (its ranks import anyway), once a restarted attempt trains (not on that restart's critical path)
            if ahead and self._signalled is None and (restarts == 0 or self._under_way(at_start, started)):
                self._agents.prepare()
                ahead = False
            if agent_fd is not None:
                select.select([agent_fd], [], [], _POLL_S)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    agent.wait(timeout=_POLL_S)
        if agent_fd is not None:
            os.close(agent_fd)
        self._agent = None
        agent_status = agent.wait()
        ended = time.time()
        end = analyse(self.run_dir, self.launch, attempt, nproc_per_node=self.options.nproc_per_node)
        at_end = self.progress()
        known = at_start.known or at_end.known
        progress = at_end.step is not None and (at_start.step is None or at_end.step > at_start.step)
        no_progress = 0 if progress or end.succeeded or not known else no_progress + 1
        if not known and not end.succeeded and not self._said_unknown:
            self._said_unknown = True
            _say(
                "progress unknown: no rank wrote a progress record (TieredCheckpoint) and no --iteration-file: "
                "restarts are limited by --max-restarts only"
            )
        decision = self.policy.decide(
            succeeded=end.succeeded,
            restarts_done=restarts,
            no_progress_count=no_progress,
            culprit_exit_code=end.cause.exit_code if end.cause else None,
            signalled=self._signalled,
        )
        result = "interrupted" if self._signalled is not None and not end.succeeded else end.result
        return AttemptRecord(
            launch_id=self.launch_id,
            attempt=attempt,
            started_at=started,
            ended_at=ended,
            outcome=result,
            agent_exit_code=agent_status,
            ranks=end.ranks,
            cause=end.cause,
            step_at_start=at_start.step,
            step_at_end=at_end.step,
            progress=progress,
            no_progress_count=no_progress,
            decision=decision.action,
            exit_code=decision.exit_code,
            reason=decision.reason,
            hang_dumps=end.hang_dumps,
            fault_notes=end.fault_notes,
            agent_error=end.agent_error,
            progress_known=known,
        )


def write_verdict(launch: LaunchDir, record: AttemptRecord) -> None:
    """The launcher's last word for a scheduler, in a file: its exit code and whether to requeue. ``srun`` rewrites
    a step's exit status (143 when it tears the step down), so a batch script reads this instead."""
    assert record.exit_code is not None
    atomic_write_json(
        launch.verdict,
        {
            "exit_code": record.exit_code,
            "requeue": requeue_wanted(record.exit_code),
            "reason": record.reason,
            "attempt": record.attempt,
            "launch_id": record.launch_id,
            "written_at": time.time(),
        },
    )


# ------------------------------------------------------------------- helpers
def _say(message: str) -> None:
    print(f"lightning-resilience launch: {message}", file=sys.stderr, flush=True)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` ends (Linux 5.3); None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; empty elsewhere)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _signal_workers(agent_pid: int, signum: int) -> None:
    """Send ``signum`` to torchrun's workers (the agent's children), not to the agent: the agent stays to observe and
    report how each rank ends. Without /proc, the whole process group gets it."""
    workers = _children(agent_pid)
    if not workers:
        try:
            os.killpg(agent_pid, signum)
        except ProcessLookupError:
            pass
        return
    for pid in workers:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
