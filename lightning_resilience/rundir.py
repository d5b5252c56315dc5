"""The run directory: one value that names every file the suite writes for a job, and the one place they are listed.

A job's workers (the callbacks), ``lightning-resilience launch`` and ``lightning-resilience report`` all reach the
run directory through :class:`RunDir`: the workers write at its paths, the launcher and the report read at the same
paths, and nobody searches the tree for them. Which directory it is comes from one rule (:meth:`RunDir.resolve`):
a component's own ``run_dir`` setting, else the launcher's (exported to the workers as
``LIGHTNING_RESILIENCE_RUN_DIR``), else ``<default_root_dir>/resilience``.

Layout (docs/launching.md has the formats)::

    ft_ledger.json                 the ETTR ledger (rank 0)
    faults/attempt<n>_rank<r>_<kind>_<pid>.json   fault notes, folded into the ledger by the next attempt
    stacks/attempt<n>_rank<r>.txt  stack dumps of hung ranks
    progress/rank_<r>.json         the newest step each tier committed, per rank (read by the launcher)
    restore_bound.json             the newest step a restart may restore after a corrupt state was found
    sdc_verdict.json               the last SDC verdict (rank 0)
    quarantine.jsonl               in-process rollbacks and the samples they skipped
    resilience_report.json         the end-of-run report (and its pictures next to it)
    launch/[<host>/]               the launcher's records (one folder per node of a multi-node job):
        attempts.jsonl             one line per launch and per attempt
        run_id                     the run id every attempt's workers see (TORCHELASTIC_RUN_ID)
        verdict.json               the launcher's last decision: exit code, requeue or not (for schedulers)
        attempt_<nnnn>/            spec.json, outcome.json, rank_<rrrrr>.json, stacks_rank<r>.txt

Framework-free, standard library only.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_SUBDIR", "RUN_DIR_ENV", "LaunchDir", "RunDir"]

log = logging.getLogger(__name__)

RUN_DIR_ENV = "LIGHTNING_RESILIENCE_RUN_DIR"
"""Set by ``lightning-resilience launch`` in every worker: the run directory the launcher reads."""

DEFAULT_SUBDIR = "resilience"
"""Under the Trainer's ``default_root_dir`` when nothing names a run directory."""

_NOTE = re.compile(r"^attempt(\d+)_rank(\d+)_[a-z_]+(?:_\d+)?\.json$")
_PROGRESS = re.compile(r"^rank_(\d+)\.json$")
_RANK_RECORD = re.compile(r"^rank_(\d+)\.json$")
_RANK_RECORD_NAME = "rank_{rank:05d}.json"


@dataclass(frozen=True)
class LaunchDir:
    """The launcher's records of one node (``<run_dir>/launch`` or ``<run_dir>/launch/<host>``)."""

    root: Path

    @property
    def attempts(self) -> Path:
        """One JSON line per launch and per attempt (appended, fsynced)."""
        return self.root / "attempts.jsonl"

    @property
    def run_id(self) -> Path:
        """The run id of the job, kept across attempts and requeues of this run directory."""
        return self.root / "run_id"

    @property
    def verdict(self) -> Path:
        """The launcher's last decision (exit code, whether to requeue): a scheduler reads it, since ``srun`` may
        rewrite the exit status."""
        return self.root / "verdict.json"

    def attempt(self, attempt: int) -> Path:
        """Where one attempt's files go."""
        return self.root / f"attempt_{attempt:04d}"

    def spec(self, attempt: int) -> Path:
        return self.attempt(attempt) / "spec.json"

    def outcome(self, attempt: int) -> Path:
        """What torchrun's agent observed (written by the attempt's process when it ends)."""
        return self.attempt(attempt) / "outcome.json"

    def rank_record(self, attempt: int, rank: int) -> Path:
        """How one rank ended (written by the rank's wrapper)."""
        return self.attempt(attempt) / _RANK_RECORD_NAME.format(rank=rank)

    def rank_record_template(self, attempt: int) -> str:
        """:meth:`rank_record` with ``{rank}`` left to fill in, for the ranks' wrapper (which imports nothing)."""
        folder = str(self.attempt(attempt).absolute()).replace("{", "{{").replace("}", "}}")
        return f"{folder}/{_RANK_RECORD_NAME}"

    def rank_records(self, attempt: int) -> dict[int, Path]:
        """``rank -> path`` of every rank record of an attempt."""
        return _numbered(self.attempt(attempt), _RANK_RECORD)

    def stack_copy(self, attempt: int, rank: int) -> Path:
        """A hung rank's stack dump, copied with the attempt's records."""
        return self.attempt(attempt) / f"stacks_rank{rank}.txt"


@dataclass(frozen=True)
class RunDir:
    """A job's run directory: the path of every file the suite writes there."""

    root: Path

    @classmethod
    def resolve(cls, explicit: str | os.PathLike[str] | None, default_root_dir: str | os.PathLike[str]) -> RunDir:
        """The run directory of a component: its own setting, else the launcher's, else under ``default_root_dir``.

        A setting of its own that is not the launcher's is honoured with a warning: the launcher reads its run
        directory only, so it will not see the fault notes, progress and verdicts written elsewhere."""
        launched = os.environ.get(RUN_DIR_ENV)
        if explicit:
            if launched and os.path.realpath(explicit) != os.path.realpath(launched):
                log.warning(
                    "run_dir %s is not the launcher's run directory %s: the launcher will not see the fault notes, "
                    "progress records and verdicts written there (leave run_dir unset to use the launcher's)",
                    explicit,
                    launched,
                )
            return cls(Path(explicit))
        if launched:
            return cls(Path(launched))
        return cls(Path(default_root_dir) / DEFAULT_SUBDIR)

    @classmethod
    def from_environment(cls) -> RunDir | None:
        """The launcher's run directory, in a worker it started; None otherwise."""
        launched = os.environ.get(RUN_DIR_ENV)
        return cls(Path(launched)) if launched else None

    @classmethod
    def locate(cls, path: str | os.PathLike[str]) -> RunDir:
        """The run directory a user names: ``path`` itself, or its ``resilience/`` folder when only that holds the
        suite's files (``path`` is then a Trainer's ``default_root_dir``)."""
        root = Path(path)
        if not cls(root).holds_records() and cls(root / DEFAULT_SUBDIR).holds_records():
            return cls(root / DEFAULT_SUBDIR)
        return cls(root)

    def holds_records(self) -> bool:
        """Whether the suite or the launcher left records here."""
        return (
            self.ledger.is_file() or self.launch().root.is_dir() or self.faults.is_dir() or self.quarantine().is_file()
        )

    # ------------------------------------------------------------------ the workers' files
    @property
    def ledger(self) -> Path:
        """The ETTR ledger of the job's attempts (rank 0)."""
        return self.root / "ft_ledger.json"

    @property
    def faults(self) -> Path:
        """Fault notes ranks leave for the next attempt."""
        return self.root / "faults"

    def fault_note(self, attempt: int, rank: int, kind: str, pid: int) -> Path:
        return self.faults / f"attempt{attempt}_rank{rank}_{kind}_{pid}.json"

    def fault_notes(self, attempt: int | None = None) -> list[Path]:
        """The fault notes present (of one attempt, or all), in name order."""
        try:
            names = sorted(p.name for p in self.faults.iterdir())
        except OSError:
            return []
        out = []
        for name in names:
            match = _NOTE.match(name)
            if match is not None and (attempt is None or int(match.group(1)) == attempt):
                out.append(self.faults / name)
        return out

    @property
    def stacks(self) -> Path:
        return self.root / "stacks"

    def stack_dump(self, attempt: int, rank: int) -> Path:
        """Where a hung rank dumps its threads' stacks."""
        return self.stacks / f"attempt{attempt}_rank{rank}.txt"

    @property
    def progress(self) -> Path:
        return self.root / "progress"

    def progress_record(self, rank: int) -> Path:
        """The newest step each tier committed on ``rank``."""
        return self.progress / f"rank_{rank:05d}.json"

    def progress_records(self) -> dict[int, Path]:
        """``rank -> path`` of every progress record present."""
        return _numbered(self.progress, _PROGRESS)

    @property
    def restore_bound(self) -> Path:
        """Written when the state was found corrupt: the next attempt restores at most its step."""
        return self.root / "restore_bound.json"

    @property
    def sdc_verdict(self) -> Path:
        return self.root / "sdc_verdict.json"

    def quarantine(self, name: str = "quarantine.jsonl") -> Path:
        """In-process rollbacks and the sample indices they skipped (``policy.rollback.quarantine_file``)."""
        return self.root / name

    @property
    def report(self) -> Path:
        """The end-of-run report."""
        return self.root / "resilience_report.json"

    # ------------------------------------------------------------------ the launcher's files
    def launch(self, host: str | None = None) -> LaunchDir:
        """The launcher's records: ``launch/``, or ``launch/<host>/`` for one node of a multi-node job."""
        root = self.root / "launch"
        return LaunchDir(root / host if host else root)

    def launch_dirs(self) -> list[LaunchDir]:
        """Every node's launcher records: ``launch/`` itself when it holds them, else each ``launch/<host>/``."""
        single = self.launch()
        if single.attempts.is_file():
            return [single]
        try:
            hosts = sorted(p.name for p in single.root.iterdir() if p.is_dir() and not p.name.startswith("attempt_"))
        except OSError:
            return []
        return [d for d in (self.launch(h) for h in hosts) if d.attempts.is_file()]


def _numbered(folder: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return {}
    out = {}
    for name in names:
        match = pattern.match(name)
        if match is not None:
            out[int(match.group(1))] = folder / name
    return out
