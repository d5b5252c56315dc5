"""``lightning-resilience launch``: torchrun underneath, one attempt at a time, with restarts decided from how the
ranks ended and the committed steps, and a versioned record of every attempt (docs/launching.md).

Framework-free (torch only). Modules: :mod:`.launcher` (the loop), :mod:`.attempt` (one torchrun run, in its own
process), :mod:`.worker` (what each rank runs: the user's script, recording how it ended), :mod:`.standby` (what
the launcher keeps ready for warm restarts), :mod:`.fork_server` (a standby worker: the ranks run in its forks),
:mod:`.preimport` (what it imports, and when a fork would not be exact), :mod:`.policy` (restart, stop, exit code),
:mod:`.progress` (the newest committed step), :mod:`.records` (the JSON-lines format), :mod:`.analysis` (how an
attempt ended and who ended it, by the suite's one attribution engine).
"""

from lightning_resilience.launch.launcher import Launcher, LaunchOptions
from lightning_resilience.launch.policy import Decision, RestartPolicy
from lightning_resilience.launch.progress import Progress, job_progress, read_iteration_file
from lightning_resilience.launch.records import SCHEMA, AttemptRecord, Cause, LaunchRecord, RankEnd, read_records

__all__ = [
    "SCHEMA",
    "AttemptRecord",
    "Cause",
    "Decision",
    "LaunchOptions",
    "LaunchRecord",
    "Launcher",
    "Progress",
    "RankEnd",
    "RestartPolicy",
    "job_progress",
    "read_iteration_file",
    "read_records",
]
