"""What the launcher does after an attempt: done, restart in the job, or stop with a code for the scheduler."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from lightning_resilience.exit_codes import ExitCode

__all__ = ["FAILED", "INTERRUPTED", "NEVER_REQUEUE", "Decision", "RestartPolicy", "requeue_wanted"]

FAILED = 1
"""The launcher's status when the job failed and restarts are used up (torchrun's own status for a failed job)."""
INTERRUPTED = 128 + signal.SIGINT
"""The launcher's status after Ctrl-C (SIGINT): the user stopped the job."""

NEVER_REQUEUE = (int(ExitCode.OK), int(ExitCode.NO_PROGRESS), int(ExitCode.DIVERGED), INTERRUPTED)
"""Launcher exit codes a scheduler must not requeue: finished, no progress, diverged (look at the data first),
stopped by hand (docs/launching.md)."""


def requeue_wanted(exit_code: int) -> bool:
    """Whether a scheduler should requeue a job whose launcher ended with ``exit_code``: every failure the launcher
    gave up on but those of :data:`NEVER_REQUEUE` (83 and 84 on other nodes)."""
    return exit_code not in NEVER_REQUEUE


# verdicts that want other hardware or a scheduler's decision: an in-job restart on the same node would bring the
# slow or faulty device straight back
_NEEDS_SCHEDULER = (ExitCode.STRAGGLER, ExitCode.SDC)


@dataclass(frozen=True)
class Decision:
    action: str
    """'done', 'restart' or 'stop'."""
    exit_code: int | None
    """The launcher's exit status for 'done' and 'stop'."""
    reason: str


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    """Restart budget and progress-based termination (NVRx 0.6's ``--ft-max-no-progress-cycles``)."""

    max_restarts: int
    """In-job restarts this launch may make (torchrun's ``--max-restarts``)."""
    max_no_progress_restarts: int = 3
    """Stop with :attr:`ExitCode.NO_PROGRESS` once this many consecutive attempts (the first one included) ended
    without committing a newer step; 0 turns progress-based termination off."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.max_no_progress_restarts < 0:
            raise ValueError(f"max_no_progress_restarts must be >= 0, got {self.max_no_progress_restarts}")

    def decide(
        self,
        *,
        succeeded: bool,
        restarts_done: int,
        no_progress_count: int,
        culprit_exit_code: int | None,
        signalled: int | None = None,
    ) -> Decision:
        """Args:
        succeeded: every rank of the attempt exited 0.
        restarts_done: in-job restarts this launch already made.
        no_progress_count: consecutive failed attempts without a newer committed step, the last one included.
        culprit_exit_code: exit status of the rank that ended the attempt (None: a signal or nothing known).
        signalled: the signal the launcher itself received during the attempt (SIGTERM: preemption).
        """
        if succeeded:
            return Decision("done", int(ExitCode.OK), "every rank finished")
        if signalled == signal.SIGINT:
            return Decision("stop", INTERRUPTED, "interrupted (SIGINT)")
        if signalled is not None:
            return Decision(
                "stop", int(ExitCode.PREEMPTED), f"the launcher got {signal.Signals(signalled).name}: requeue the job"
            )
        if culprit_exit_code in _NEEDS_SCHEDULER:
            verdict = ExitCode(culprit_exit_code)
            return Decision("stop", int(verdict), f"{verdict.name}: restart elsewhere (not on the same node)")
        if culprit_exit_code == ExitCode.DIVERGED:
            return Decision("stop", int(ExitCode.DIVERGED), "DIVERGED: in-process rollbacks kept failing: no restart")
        if self.max_no_progress_restarts and no_progress_count >= self.max_no_progress_restarts:
            return Decision(
                "stop",
                int(ExitCode.NO_PROGRESS),
                f"{no_progress_count} attempts in a row committed no newer step: giving up (do not requeue)",
            )
        if restarts_done >= self.max_restarts:
            code = culprit_exit_code if culprit_exit_code in set(map(int, ExitCode)) - {0} else FAILED
            return Decision("stop", int(code), f"restarts used up ({restarts_done} of {self.max_restarts})")
        return Decision("restart", None, f"restart {restarts_done + 1} of {self.max_restarts}")
