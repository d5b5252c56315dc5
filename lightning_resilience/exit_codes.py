"""The process exit codes of the suite: one enum, one meaning per code, read by launchers and schedulers.

A code tells the launcher what to do next: restart the group (torchrun ``--max-restarts``), requeue the job
(Slurm ``--requeue``, a Kubernetes ``podFailurePolicy``), or stop for good. Codes stay clear of a crash (1), a
signal (128+n) and a clean end (0).
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ExitCode"]


class ExitCode(IntEnum):
    """Why the suite ended the process."""

    OK = 0
    """Training finished (or stopped because the user asked)."""
    STRAGGLER = 83
    """Stopped for a persistent straggler, after a checkpoint: restart without the slow node."""
    SDC = 84
    """A device computes wrong results: restart from the newest verified step, excluding the node."""
    POLICY_STOP = 85
    """The policy decided checkpoint-and-stop (or a rollback it could not do in process): restart."""
    HANG = 86
    """The watchdog ended a hung rank (stack dumps written): restart the group."""
    PREEMPTED = 87
    """A preemption notice was handled and the state saved: requeue the job."""
    NO_PROGRESS = 88
    """The launcher gave up: restarts brought no newer committed step; do not requeue."""
