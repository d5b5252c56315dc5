"""What the job has committed, told to the launcher: one small record per rank in the run directory.

The checkpoint engine knows when a tier's write of a step is committed (local disk, a peer's RAM, an object store,
wherever its path is), on the persist worker's thread, so a hung training thread hides no commit;
:class:`ProgressRecorder` listens to it (``CheckpointManager.add_commit_listener``) and keeps
``<run_dir>/progress/rank_<r>.json`` with the newest step each tier that outlives the process committed on this rank.
The launcher reads the records of every rank (:func:`newest_committed`): a step counts once every rank committed it
to some tier. Tiers of process durability (RAM inside the worker) do not count: a restart cannot load them.

The record only grows: a restarted attempt starts from the record it finds (and from what its tiers list), so an
attempt that dies before its first commit leaves the previous attempt's progress as it was.

Format (schema 1)::

    {"schema": 1, "rank": 0, "world_size": 2, "updated_at": 1767225600.0,
     "tiers": {"local": {"step": 40, "durability": "host"}, "s3": {"step": 20, "durability": "remote"}}}
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_resilience.checkpoint.tier import Durability
from lightning_resilience.rundir import RunDir

if TYPE_CHECKING:
    from lightning_resilience.checkpoint.manager import CheckpointManager

__all__ = ["SCHEMA", "JobProgress", "ProgressRecorder", "newest_committed", "read_progress", "record_progress"]

log = logging.getLogger(__name__)

SCHEMA = 1


class ProgressRecorder:
    """Keeps this rank's progress record; call it as ``recorder(tier_name, step)`` for each committed write.

    Args:
        run_dir: where the record goes (the launcher's run directory in a launched job).
        rank, world_size: this process in the job.
        durability: ``tier name -> durability`` of the job's tiers; process-durability tiers are not recorded.
        listed: ``tier name -> steps`` the tiers hold at start (a restarted attempt's view of its tiers).
    """

    def __init__(
        self,
        run_dir: RunDir,
        rank: int,
        world_size: int,
        durability: Mapping[str, Durability],
        listed: Mapping[str, list[int]] | None = None,
    ) -> None:
        self.path = run_dir.progress_record(rank)
        self.rank, self.world_size = rank, world_size
        self.durability = {name: d for name, d in durability.items() if d is not Durability.process}
        previous = _read(self.path)
        kept = previous.get("tiers", {}) if previous and previous.get("world_size") == world_size else {}
        self.steps: dict[str, int] = {}
        for name in self.durability:
            found = list((listed or {}).get(name, []))
            old = kept.get(name, {}).get("step") if isinstance(kept.get(name), dict) else None
            if isinstance(old, int):
                found.append(old)
            if found:
                self.steps[name] = max(found)
        self._failed = False
        self._lock = threading.Lock()  # commits are told from the persist worker and from emergency saves

    def start(self) -> None:
        """Write the record now: the launcher then knows this job reports its progress, even before a commit."""
        with self._lock:
            self._write()

    def __call__(self, tier: str, step: int) -> None:
        with self._lock:
            if tier not in self.durability or step <= self.steps.get(tier, -1):
                return
            self.steps[tier] = step
            self._write()

    def _write(self) -> None:
        record = {
            "schema": SCHEMA,
            "rank": self.rank,
            "world_size": self.world_size,
            "updated_at": time.time(),
            "tiers": {n: {"step": s, "durability": self.durability[n].value} for n, s in self.steps.items()},
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(record, sort_keys=True))
            os.replace(tmp, self.path)  # a reader sees the old record or the new one
        except OSError as err:  # progress is for the launcher: training goes on without it, said once
            if not self._failed:
                log.warning("cannot write the progress record %s: %s (the launcher may misjudge progress)", self.path,
                            err)  # fmt: skip
            self._failed = True


@dataclass(frozen=True)
class JobProgress:
    """What the progress records of a run directory say."""

    reported: bool
    """Some rank of the job writes progress records (the job runs the checkpoint engine)."""
    step: int | None
    """The newest step every rank seen here committed to some tier; None when there is none yet."""
    tiers: dict[str, int]
    """Per tier, the newest step every rank seen here committed to it."""


def read_progress(run_dir: RunDir) -> dict[int, dict[str, Any]]:
    """``rank -> record`` of every readable progress record of this schema."""
    out = {}
    for rank, path in run_dir.progress_records().items():
        record = _read(path)
        if record is not None and record.get("schema") == SCHEMA:
            out[rank] = record
    return out


def newest_committed(run_dir: RunDir, *, local_ranks: int) -> JobProgress:
    """The newest step the job committed anywhere it writes, from the ranks' progress records.

    A tier's step counts when every rank's record is here and names it (the smallest of the ranks' newest steps),
    or, when the run directory is node-local in a multi-node job, at least ``local_ranks`` ranks' records.
    """
    records = read_progress(run_dir)
    if not records:
        return JobProgress(False, None, {})
    worlds = {int(r.get("world_size", 0)) for r in records.values()}
    world = max(worlds)
    ranks = [r for r in records.values() if int(r.get("world_size", 0)) == world]
    if len(ranks) < world and len(ranks) < min(local_ranks, world):
        return JobProgress(True, None, {})
    tiers: dict[str, int] = {}
    names = set().union(*(r.get("tiers", {}).keys() for r in ranks))
    for name in sorted(names):
        steps = [r.get("tiers", {}).get(name, {}).get("step") for r in ranks]
        if all(isinstance(s, int) for s in steps):
            tiers[name] = min(steps)  # type: ignore[type-var]
    return JobProgress(True, max(tiers.values()) if tiers else None, tiers)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def record_progress(manager: CheckpointManager, run_dir: RunDir) -> ProgressRecorder:
    """Keep this rank's progress record for ``manager`` (after its ``setup``): written now, then at every commit."""
    recorder = ProgressRecorder(
        run_dir,
        manager.identity.rank,
        manager.world_size,
        {t.name: t.durability for t in manager.tiers},
        manager.steps(),
    )
    recorder.start()
    manager.add_commit_listener(recorder)
    return recorder
