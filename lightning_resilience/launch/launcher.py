"""The launch loop: one torchrun per attempt, restarts decided here from how the ranks ended and the committed steps.

Each attempt runs :mod:`lightning_resilience.launch.attempt` in a new process (torchrun's own ``run`` with
``--max-restarts 0``), so every attempt gets a new elastic agent and a new rendezvous store. After it ends the
launcher reads what torchrun observed and what each rank recorded, finds the culprit, collects hang stack dumps and
fault notes, reads the newest committed step, appends one record to ``<run_dir>/launch/attempts.jsonl`` and decides
(:class:`~lightning_resilience.launch.policy.RestartPolicy`): done, restart, or stop with a code for the scheduler.

A SIGTERM (or SIGINT) to the launcher is passed to the workers first, the way a scheduler's preemption notice
reaches them, so they can agree on a step and save; torchrun's agent is stopped only if they have not ended within
``term_timeout_s``. The launcher then exits with :attr:`ExitCode.PREEMPTED` (130 after SIGINT).
"""

from __future__ import annotations

import json
import logging
import os
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
from lightning_resilience.launch import attempt as attempt_module
from lightning_resilience.launch.policy import RestartPolicy
from lightning_resilience.launch.progress import newest_committed_step, read_iteration_file
from lightning_resilience.launch.records import (
    AttemptRecord,
    LaunchRecord,
    RankEnd,
    append_record,
    attribute,
    read_records,
    signal_name,
)
from lightning_resilience.launch.worker import ATTEMPT_ENV, LAUNCH_DIR_ENV, attempt_dir, read_rank_records

__all__ = ["LaunchOptions", "Launcher"]

log = logging.getLogger(__name__)

_FORWARDED = (signal.SIGTERM, signal.SIGINT)
_AGENT_STOP_MARGIN_S = 10.0  # torchrun's agent gives its workers --shutdown-timeout (30 s) after its SIGTERM
_DUMP_SEARCH = ("stacks", "*/stacks", "*/*/stacks")
_NOTE_SEARCH = ("faults", "*/faults", "*/*/faults")
_LEDGER_SEARCH = ("ft_ledger.json", "*/ft_ledger.json", "*/*/ft_ledger.json")
_NOTE_FIELDS = ("kind", "rank", "step", "detected_at", "message", "section", "detection_s", "stacks")


@dataclass(kw_only=True)
class LaunchOptions:
    """The launcher's own settings (torchrun's come from torchrun's parser)."""

    run_dir: Path
    """Run directory: records go to ``launch/``; committed steps are searched under it."""
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
        self.launch_dir = options.run_dir.absolute() / "launch"  # the ranks may change their working directory
        if options.multi_node:
            self.launch_dir = self.launch_dir / self.host
        self.launch_id = uuid.uuid4().hex[:12]
        self._signalled: int | None = None
        self._agent: subprocess.Popen[bytes] | None = None

    # ---------------------------------------------------------------- progress
    def newest_step(self) -> int | None:
        steps = [newest_committed_step(self.options.run_dir, local_ranks=self.options.nproc_per_node)]
        if self.options.iteration_file is not None:
            steps.append(read_iteration_file(self.options.iteration_file))
        known = [s for s in steps if s is not None]
        return max(known) if known else None

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signalled is None:
            self._signalled = signum
            _say(f"got {signal.Signals(signum).name}: passing it to the workers (they save and stop)")
            if self._agent is not None:
                _signal_workers(self._agent.pid, signum)

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
            ),
        )
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in _FORWARDED}
        try:
            restarts = 0
            while True:
                record = self._attempt(attempt, restarts, no_progress)
                append_record(self.launch_dir, record)
                _say(_summary(record, self.launch_dir))
                if record.decision != "restart":
                    assert record.exit_code is not None
                    return record.exit_code
                no_progress, attempt, restarts = record.no_progress_count, attempt + 1, restarts + 1
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _attempt(self, attempt: int, restarts: int, no_progress: int) -> AttemptRecord:
        folder = attempt_dir(self.launch_dir, attempt)
        shutil.rmtree(folder, ignore_errors=True)  # a requeued job may reuse the index of an attempt never recorded
        folder.mkdir(parents=True)
        spec = folder / "spec.json"
        atomic_write_json(spec, {"attempt": attempt, "torchrun": self.torchrun})
        step_at_start = self.newest_step()
        env = {**os.environ, ATTEMPT_ENV: str(attempt), LAUNCH_DIR_ENV: str(self.launch_dir)}
        started = time.time()
        _say(f"attempt {attempt} starting (newest committed step: {_step(step_at_start)})")
        agent = subprocess.Popen(
            [sys.executable, str(Path(attempt_module.__file__).resolve()), str(spec)],
            env=env,
            start_new_session=True,  # its own process group: stopped as a whole, and Ctrl-C reaches the launcher only
            preexec_fn=_end_with_parent,
        )
        self._agent = agent
        if self._signalled is not None:  # a signal that came between two attempts
            _signal_workers(agent.pid, self._signalled)
        deadline: float | None = None
        while agent.poll() is None:
            if self._signalled is not None and deadline is None:
                deadline = time.monotonic() + self.options.term_timeout_s
            if deadline is not None and time.monotonic() > deadline:
                _say(f"workers still running {self.options.term_timeout_s:.0f} s after the signal: stopping torchrun")
                self._stop_agent(agent)
                break
            try:
                agent.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        self._agent = None
        agent_status = agent.wait()
        ended = time.time()
        outcome = _read_json(folder / "outcome.json") or {"result": "launcher_error", "failures": {}}
        notes = self._fault_notes(attempt)
        ranks = _rank_ends(outcome, read_rank_records(folder))
        # every rank finished (its own record says exit 0), even if one then aborted in interpreter teardown
        finished = len(ranks) >= self.options.nproc_per_node and all(r.exit_code == 0 and not r.signal for r in ranks)
        succeeded = outcome.get("result") == "succeeded" or finished
        detected: dict[int, float] = {}
        for note in notes:  # oldest first: the first detection of each rank
            if isinstance(note["rank"], int) and note["detected_at"]:
                detected.setdefault(note["rank"], float(note["detected_at"]))
        cause = None if succeeded else attribute(ranks, detected)
        step_at_end = self.newest_step()
        progress = step_at_end is not None and (step_at_start is None or step_at_end > step_at_start)
        no_progress = 0 if progress or succeeded else no_progress + 1
        decision = self.policy.decide(
            succeeded=succeeded,
            restarts_done=restarts,
            no_progress_count=no_progress,
            culprit_exit_code=cause.exit_code if cause else None,
            signalled=self._signalled,
        )
        if self._signalled is not None and not succeeded:
            result = "interrupted"
        else:
            result = "succeeded" if succeeded else str(outcome.get("result", "launcher_error"))
        return AttemptRecord(
            launch_id=self.launch_id,
            attempt=attempt,
            started_at=started,
            ended_at=ended,
            outcome=result,
            agent_exit_code=agent_status,
            ranks=ranks,
            cause=cause,
            step_at_start=step_at_start,
            step_at_end=step_at_end,
            progress=progress,
            no_progress_count=no_progress,
            decision=decision.action,
            exit_code=decision.exit_code,
            reason=decision.reason,
            hang_dumps=self._collect_dumps(attempt, folder),
            fault_notes=notes,
            agent_error=outcome.get("error"),
        )

    # ------------------------------------------------------------- collection
    def _collect_dumps(self, attempt: int, folder: Path) -> list[str]:
        """Copy the stack dumps hung ranks wrote for this attempt (``<dir>/stacks/attempt<n>_rank<r>.txt``)."""
        copied = []
        for pattern in _DUMP_SEARCH:
            for dump in sorted(self.options.run_dir.glob(f"{pattern}/attempt{attempt}_rank*.txt")):
                target = folder / f"stacks_{dump.stem.split('_', 1)[1]}.txt"
                try:
                    shutil.copyfile(dump, target)
                except OSError as err:
                    log.warning("could not collect %s: %s", dump, err)
                    continue
                copied.append(str(target))
        return copied

    def _fault_notes(self, attempt: int) -> list[dict[str, Any]]:
        """The notes ranks left for this attempt: in ``faults/`` (other ranks) and in the ETTR ledger (rank 0's, and
        the others' once a later attempt folded them in), oldest first, each once."""
        found: list[dict[str, Any]] = []
        for pattern in _NOTE_SEARCH:
            for path in sorted(self.options.run_dir.glob(f"{pattern}/attempt{attempt}_rank*.json")):
                found.extend(filter(None, [_read_json(path)]))
        for pattern in _LEDGER_SEARCH:
            for path in sorted(self.options.run_dir.glob(pattern)):
                for entry in (_read_json(path) or {}).get("attempts", []):
                    if entry.get("restart_count") == attempt:
                        found.extend(f for f in entry.get("faults", []) if isinstance(f, dict))
        notes: dict[tuple[Any, ...], dict[str, Any]] = {}
        for data in found:
            note = {k: data.get(k) for k in _NOTE_FIELDS}
            notes.setdefault((note["kind"], note["rank"], note["step"], note["detected_at"]), note)
        return sorted(notes.values(), key=lambda n: n["detected_at"] or 0.0)


# ------------------------------------------------------------------- helpers
def _say(message: str) -> None:
    print(f"lightning-resilience launch: {message}", file=sys.stderr, flush=True)


def _step(step: int | None) -> str:
    return "none" if step is None else str(step)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _end_with_parent() -> None:
    """In the torchrun child: get SIGTERM if the launcher dies (Linux), so no attempt outlives its launcher."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


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


def _rank_ends(outcome: dict[str, Any], records: dict[int, dict[str, Any]]) -> list[RankEnd]:
    """Merge what torchrun's agent observed (authoritative exit status or signal) with each rank's own record."""
    failures = {int(k): v for k, v in outcome.get("failures", {}).items()}
    succeeded = outcome.get("result") == "succeeded"
    ends = []
    for rank in sorted(set(failures) | set(records)):
        own, seen = records.get(rank, {}), failures.get(rank)
        end = RankEnd(rank=rank, local_rank=own.get("local_rank"), pid=own.get("pid"), host=own.get("host"))
        end.exception = own.get("exception")
        end.ended_at = own.get("ended_at")
        if seen is not None:
            status = int(seen["exitcode"])
            if "exit_code" in own:  # it recorded its end: a signal seen after that came during teardown
                end.exit_code, end.teardown_signal = int(own["exit_code"]), signal_name(status)
            else:
                end.signal, end.exit_code = signal_name(status), (status if status >= 0 else None)
            end.local_rank = seen.get("local_rank", end.local_rank)
            end.pid = seen.get("pid", end.pid)
            if end.exception is None and seen.get("exception_type"):
                end.exception = {"type": seen["exception_type"], "message": seen.get("message", "")}
            if end.ended_at is None:
                end.ended_at = float(seen.get("timestamp") or 0) or None
        elif "exit_code" in own:
            end.exit_code = int(own["exit_code"])
        elif succeeded:
            end.exit_code = 0
        else:
            end.stopped_by_launcher = True
        ends.append(end)
    return ends


def _summary(record: AttemptRecord, launch_dir: Path) -> str:
    took = record.ended_at - record.started_at
    head = f"attempt {record.attempt} {record.outcome} after {took:.1f} s"
    if record.cause is not None:
        c = record.cause
        how = {
            "signal": f"killed by {c.detail}",
            "verdict": f"ended: {c.detail} (exit {c.exit_code})",
            "exit": f"exited with status {c.detail}",
        }.get(c.kind, f"{c.detail}" + (f": {c.message.splitlines()[0][:160]}" if c.message else ""))
        victims = [f"rank {r.rank}" for r in record.ranks if r.role == "victim"]
        head += f"; cause: rank {c.rank} {how}" + (f" (then {', '.join(victims)})" if victims else "")
    elif record.agent_error:
        head += f"; torchrun: {record.agent_error[:200]}"
    steps = f"newest committed step {_step(record.step_at_end)} (was {_step(record.step_at_start)})"
    if record.hang_dumps:
        steps += f"; stack dumps: {', '.join(record.hang_dumps)}"
    tail = f"{record.decision}: {record.reason}"
    if record.exit_code is not None:
        tail += f"; exit {record.exit_code}"
    return f"{head}; {steps}; {tail} [{launch_dir / 'attempts.jsonl'}]"
