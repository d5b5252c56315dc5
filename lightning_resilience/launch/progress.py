"""Progress between attempts: the newest step the job committed anywhere it writes.

The workers say it: the checkpoint engine of every rank keeps a progress record in the run directory with the newest
step each of its tiers committed, wherever the tier is (a local disk outside the run directory, a peer's RAM, an
object store; :mod:`lightning_resilience.checkpoint.progress`). A step counts once every rank committed it. An
iteration file (NVRx's ``--ft-checkpoint-iteration-file``: one integer) can be given too, for a job that commits its
checkpoints by other means. Without either, progress is unknown: the launcher then never stops a job for the lack of
it (a "do not requeue" verdict on a job that may be progressing would drop it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from lightning_resilience.checkpoint.progress import newest_committed
from lightning_resilience.rundir import RunDir

__all__ = ["Progress", "job_progress", "read_iteration_file"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Progress:
    """What the launcher knows of the job's committed steps."""

    known: bool
    """Some source reports the job's commits (progress records or an iteration file)."""
    step: int | None
    """The newest committed step; None when none is known."""
    tiers: dict[str, int] = field(default_factory=dict)
    """Per tier (and ``iteration_file``), the newest step every rank committed there."""

    def describe(self) -> str:
        if not self.known:
            return "unknown"
        if self.step is None:
            return "none"
        where = ", ".join(f"{name} {step}" for name, step in sorted(self.tiers.items()))
        return f"{self.step}" + (f" ({where})" if where else "")


def job_progress(run_dir: RunDir, iteration_file: Path | None, *, local_ranks: int) -> Progress:
    """The newest step committed by every rank to some tier (from their progress records), or named by the
    iteration file, whichever is newer."""
    records = newest_committed(run_dir, local_ranks=local_ranks)
    tiers = dict(records.tiers)
    known = records.reported or iteration_file is not None
    if iteration_file is not None:
        step = read_iteration_file(iteration_file)
        if step is not None:
            tiers["iteration_file"] = step
    return Progress(known, max(tiers.values()) if tiers else None, tiers)


def read_iteration_file(path: Path) -> int | None:
    """The integer in an iteration file; None when it is missing, empty or unreadable (said once in the log)."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning("cannot read the iteration file %s: %s", path, err)
        return None
    try:
        return int(text) if text else None
    except ValueError:
        log.warning("iteration file %s does not hold an integer: %r", path, text[:40])
        return None
