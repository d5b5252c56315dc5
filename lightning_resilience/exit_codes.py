"""The process exit codes of the suite: one enum, one meaning per code, read by launchers and schedulers.

A code tells the launcher what to do next: restart the group (torchrun ``--max-restarts``), requeue the job
(Slurm ``--requeue``, a Kubernetes ``podFailurePolicy``), or stop for good. Codes stay clear of a crash (1), a
signal (128+n) and a clean end (0). ``docs/exit-codes.md`` gives the launcher recipes.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["DecidedExit", "ExitCode"]


class ExitCode(IntEnum):
    """Why the suite ended the process."""

    OK = 0
    """Training finished (or stopped because the user asked)."""
    STRAGGLER = 83
    """Stopped for a persistent straggler, after a checkpoint: restart without the slow node."""
    SDC = 84
    """The training state is corrupt (a device computes wrong results), or in-process rollbacks could not help (no
    RAM snapshot old enough; a fault that came back at the same step whatever the batch): restart from the newest
    verified step, excluding the node the verdict names (if any). Never 0, whatever the policy did about it."""
    HANG = 86
    """The watchdog ended a hung rank (stack dumps written): restart the group."""
    PREEMPTED = 87
    """A preemption notice was handled and the state saved: requeue the job."""
    NO_PROGRESS = 88
    """The launcher gave up: restarts brought no newer committed step; do not requeue."""
    DIVERGED = 89
    """Training kept going wrong (non-finite or spiking values, at different steps) after the in-process rollbacks
    allowed per window, or was set to stop on the first: the last good state was saved. A restart would likely fail
    the same way: look at the data (the quarantine file) and the hyperparameters before requeueing."""


class DecidedExit(SystemExit):
    """Raised at the end of ``fit`` when the suite decided to stop the job: the process ends with ``code``.

    A ``SystemExit``, so an uncaught one ends the interpreter with the code and no traceback; catch it to run code
    after ``fit`` (the recipes write their report) and raise it again.
    """

    def __init__(self, code: ExitCode, reason: str) -> None:
        super().__init__(int(code))
        self.exit_code = code
        self.reason = reason

    def __str__(self) -> str:
        return f"exit code {int(self.exit_code)} ({self.exit_code.name}): {self.reason}"
