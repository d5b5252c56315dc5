"""ETTR accounting: a JSON ledger in the run directory, kept across restarts, of where the wall-clock time went.

One writer (global rank 0) appends an *attempt* per process start and moves its heartbeat forward at step
boundaries; every write is atomic, so the file a restart reads is always whole. From the attempts:

* **training** time of an attempt: first step start to last heartbeat;
* **restart gap**: last heartbeat of an attempt to the first step of the next (detection, teardown, relaunch,
  re-rendezvous, restore; a requeue's queue wait too). The part the faulty rank spent being detected (a hang's
  stuck time) is reported separately as **detection**;
* **per restart** (:class:`RestartCost`): the steps lost, and where each second from the last good step before the
  fault to the first good step after it went: detection, relaunch (teardown, the launcher, new processes), imports
  (the interpreter and the script up to its callbacks), rendezvous (process group, strategy setup), setup (the
  callbacks, side groups, data loaders), restore, and the first step itself;
* **recomputation**: steps redone after a resume (last step reached minus the step resumed from), and steps undone
  by in-process rollbacks, x the step time;
* **checkpoint blocking**: what the checkpoint engine reports as blocking the training loop (and, per attempt, the
  cadences its cost budget chose, and why);
* **ETTR** = productive time / wall time, productive = training - recomputation - checkpoint blocking.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lightning_resilience.ft.restart import FaultNote, atomic_write_text, read_fault_notes
from lightning_resilience.ft.restart_cost import RestartCost, describe_restart, restart_cost
from lightning_resilience.rundir import RunDir

__all__ = [
    "FAULT_ENDS",
    "AttemptRecord",
    "EttrLedger",
    "EttrReport",
    "failure_history",
]

log = logging.getLogger(__name__)

LEDGER_FILE = RunDir(Path()).ledger.name
_VERSION = 1
_POINTS_CAP = 256  # progress points and persists kept per attempt (every other one dropped beyond that)
_COMPACT: dict[str, Any] = {"sort_keys": True, "separators": (",", ":")}
"""The ledger's JSON: without indentation the C encoder writes it (several times faster than an indented dump)."""


@dataclass
class AttemptRecord:
    """One process start of the job, as rank 0 saw it."""

    index: int
    restart_count: int
    launcher: str
    world_size: int
    started_at: float
    job_id: str | None = None
    first_step_at: float | None = None
    start_step: int | None = None
    """Global step when the first step of this attempt began (the resumed step)."""
    last_heartbeat_at: float | None = None
    last_step: int | None = None
    steps: int = 0
    checkpoint_blocking_s: float = 0.0
    ended_at: float | None = None
    end_reason: str | None = None
    """'finished', 'preempted', 'exception', 'hang', 'lost' (no rank left a note) or None while running."""
    faults: list[dict[str, Any]] = field(default_factory=list)
    restored_step: int | None = None
    """The checkpoint step this attempt resumed from (None: started from scratch)."""
    restored_from: str | None = None
    """The tier it was restored from."""
    restore_s: float | None = None
    """Seconds the restore took."""
    progress: list[list[float]] = field(default_factory=list)
    """[wall-clock seconds, step] at each ledger write: the attempt's pace, thinned to a few hundred points."""
    persists: list[list[Any]] = field(default_factory=list)
    """[wall-clock seconds, step, tier] when a persistent tier committed a newer step (first seen at a heartbeat)."""
    rolled_back_steps: int = 0
    """Steps undone by in-process rollbacks in this attempt (trained, then trained again)."""
    cadences: list[list[Any]] = field(default_factory=list)
    """[wall-clock seconds, step, tier, every_n_steps, why] each time the checkpoint engine chose a tier's cadence
    from its cost budget."""
    process_started_at: float | None = None
    """When rank 0's process started (before its imports)."""
    script_ready_at: float | None = None
    """When the script had built its callbacks (its imports done), before the Trainer set up."""
    restored_at: float | None = None
    """When the restore ended."""
    first_step_done_at: float | None = None
    """When the first step of the attempt ended: the first good step after a restart."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def training_s(self) -> float:
        if self.first_step_at is None or self.last_heartbeat_at is None:
            return 0.0
        return max(self.last_heartbeat_at - self.first_step_at, 0.0)

    @property
    def step_s(self) -> float | None:
        done = self.steps + self.rolled_back_steps  # the steps an in-process rollback undid were trained too
        return self.training_s / done if done else None


@dataclass(frozen=True)
class EttrReport:
    """The time accounting of a run so far (seconds)."""

    wall_s: float
    training_s: float
    productive_s: float
    startup_s: float
    restart_gap_s: float
    detection_s: float
    recompute_s: float
    recomputed_steps: int
    checkpoint_blocking_s: float
    attempts: int
    restarts: int
    causes: list[str]
    restart_costs: list[RestartCost] = field(default_factory=list)
    """Each restart's steps lost and the breakdown of its fault-to-first-good-step time."""

    @property
    def ettr(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ettr": self.ettr}

    def describe(self) -> list[str]:
        """The account in a few lines: ETTR and where the wall time went, the restarts and their causes, and each
        restart's breakdown."""
        ettr = f"{self.ettr:.3f}" if self.ettr is not None else "n/a"
        lines = [
            f"ETTR {ettr} over {self.wall_s:.1f}s wall: productive {self.productive_s:.1f}s, startup "
            f"{self.startup_s:.1f}s, restart gaps {self.restart_gap_s:.1f}s (detection {self.detection_s:.1f}s), "
            f"recomputation {self.recompute_s:.1f}s ({self.recomputed_steps} steps), checkpoint blocking "
            f"{self.checkpoint_blocking_s:.2f}s",
            f"{self.attempts} attempts, {self.restarts} restarts"
            + (f": causes {', '.join(self.causes)}" if self.causes else ""),
        ]
        return lines + [f"restart {c.attempt}: {describe_restart(asdict(c))}" for c in self.restart_costs]


class EttrLedger:
    """The ledger file of one run (write on global rank 0 only).

    Args:
        run_dir: directory that survives restarts.
        wall_clock: wall-clock seconds (time.time), injectable for tests.
        interval_s: shortest time between two heartbeat writes.
    """

    def __init__(self, run_dir: Path, *, wall_clock: Callable[[], float] = time.time, interval_s: float = 1.0) -> None:
        self.run_dir = Path(run_dir)
        self.path = RunDir(self.run_dir).ledger
        self._wall_clock = wall_clock
        self.interval_s = interval_s
        self.attempts: list[AttemptRecord] = []
        self._ended: str | None = None
        """The JSON of the attempts that have ended, each followed by a comma (they do not change once the next one
        has begun); None: not encoded yet."""
        self._last_write = -float("inf")
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text())
            self.attempts = [AttemptRecord.from_json(a) for a in data.get("attempts", [])]
        except (OSError, ValueError, TypeError) as err:
            # the file is written atomically; a broken one was edited by hand: keep it for a human, start over
            broken = self.path.with_suffix(".broken")
            self.path.replace(broken)
            log.error("ledger %s unreadable (%s): moved to %s, starting a new one", self.path, err, broken)
            self.attempts = []

    def save(self) -> None:
        """Write the ledger (atomically), as compact JSON: rank 0 writes it on its training thread at most every
        ``interval_s``, so an attempt that has ended is encoded once and only the current one at each write."""
        if self._ended is None:
            self._ended = "".join(f"{_encode(a)}," for a in self.attempts[:-1])
        current = _encode(self.attempts[-1]) if self.attempts else ""
        atomic_write_text(self.path, f'{{"attempts":[{self._ended}{current}],"version":{_VERSION}}}')
        self._last_write = self._wall_clock()

    @property
    def current(self) -> AttemptRecord | None:
        return self.attempts[-1] if self.attempts else None

    # ------------------------------------------------------------------ writes (rank 0)
    def begin_attempt(
        self,
        *,
        restart_count: int,
        launcher: str,
        world_size: int,
        job_id: str | None,
        process_started_at: float | None = None,
        script_ready_at: float | None = None,
    ) -> AttemptRecord:
        """Start a new attempt; close the previous one with the fault notes its ranks left (or as 'lost').
        ``process_started_at`` and ``script_ready_at``: when this process started and had built its callbacks."""
        now = self._wall_clock()
        notes = read_fault_notes(self.run_dir, before=now, remove=True)
        self._ended = None  # the previous attempt is closed below
        previous = self.current
        if previous is not None:
            previous.faults.extend(n.to_json() for n in notes)
            if previous.end_reason not in ("finished", "preempted"):
                previous.end_reason = _reason(previous.faults)
            if previous.ended_at is None:
                previous.ended_at = previous.last_heartbeat_at or previous.started_at
        elif notes:
            log.warning("ignoring %d fault notes older than the ledger", len(notes))
        record = AttemptRecord(
            index=len(self.attempts),
            restart_count=restart_count,
            launcher=launcher,
            world_size=world_size,
            started_at=now,
            job_id=job_id,
            process_started_at=process_started_at,
            script_ready_at=script_ready_at,
        )
        self.attempts.append(record)
        self.save()
        return record

    def first_step(
        self,
        step: int,
        *,
        restored_step: int | None = None,
        restored_from: str | None = None,
        restore_s: float | None = None,
        restored_at: float | None = None,
    ) -> None:
        """The first step of the attempt begins; ``restored_*``: the checkpoint it resumed from, if any, and when
        its restore ended."""
        record = self._require()
        record.first_step_at = self._wall_clock()
        record.start_step = record.last_step = step
        record.last_heartbeat_at = record.first_step_at
        record.restored_step, record.restored_from, record.restore_s = restored_step, restored_from, restore_s
        record.restored_at = restored_at
        _append_point(record.progress, [record.first_step_at, step])
        self.save()

    def heartbeat(
        self,
        step: int,
        *,
        checkpoint_blocking_s: float | None = None,
        persisted: Mapping[str, int | None] | None = None,
        cadences: Sequence[tuple[int, str, int, str]] = (),
        force: bool = False,
    ) -> bool:
        """Move the heartbeat to the end of ``step``; written at most every ``interval_s`` unless ``force``.

        ``persisted``: the newest step each persistent tier has committed; a newer one is recorded as a persist.
        ``cadences``: the cadences the checkpoint engine chose so far in this attempt, as (step, tier, every_n_steps,
        why); a new one is recorded (and written at once).
        """
        record = self._require()
        now = self._wall_clock()
        if step != record.last_step or record.last_heartbeat_at is None:
            # the same step again (the final flush at train end): the time since is not training
            record.last_heartbeat_at = now
        record.last_step = step
        record.steps = step - (record.start_step or 0)
        if checkpoint_blocking_s is not None:
            record.checkpoint_blocking_s = checkpoint_blocking_s
        for tier, committed in (persisted or {}).items():
            newest = max((int(p[1]) for p in record.persists if p[2] == tier), default=None)
            # a step at or below the resumed one was committed by an earlier attempt (the restored checkpoint)
            fresh = committed is not None and committed > (record.start_step if record.start_step is not None else -1)
            if fresh and committed is not None and (newest is None or committed > newest):
                _append_point(record.persists, [now, int(committed), tier])
        seen = {(int(c[1]), str(c[2]), int(c[3])) for c in record.cadences}
        for at, tier, every, why in cadences:
            if (at, tier, every) not in seen:
                record.cadences.append([now, at, tier, every, why])
                force = True
        if force or now - self._last_write >= self.interval_s:
            _append_point(record.progress, [record.last_heartbeat_at, step])
            self.save()
            return True
        return False

    def first_step_done(self) -> None:
        """The attempt's first step ended (written with the heartbeat that follows)."""
        record = self._require()
        if record.first_step_done_at is None:
            record.first_step_done_at = self._wall_clock()

    def note_rollback(self, steps_lost: int) -> None:
        """An in-process rollback undid ``steps_lost`` steps of this attempt: they count as recomputation."""
        self._require().rolled_back_steps += steps_lost
        self.save()

    def end_attempt(self, reason: str, note: FaultNote | None = None) -> None:
        record = self._require()
        record.ended_at = self._wall_clock()
        record.end_reason = reason
        if record.last_heartbeat_at is not None and record.last_step is not None:
            _append_point(record.progress, [record.last_heartbeat_at, record.last_step])
        if note is not None:
            record.faults.append(note.to_json())
        self.save()

    def _require(self) -> AttemptRecord:
        if not self.attempts:
            raise RuntimeError("ledger: begin_attempt() must run first")
        return self.attempts[-1]

    # ------------------------------------------------------------------ reads
    def report(self) -> EttrReport:
        return account(self.attempts)


def _encode(record: AttemptRecord) -> str:
    return json.dumps({f.name: getattr(record, f.name) for f in fields(record)}, **_COMPACT)


def _append_point(points: list[Any], point: list[Any]) -> None:
    """Append, keeping at most _POINTS_CAP: beyond it every other point goes (the first and the newest stay)."""
    if points and points[-1] == point:
        return
    points.append(point)
    if len(points) > _POINTS_CAP:
        points[:] = [*points[:-1:2], points[-1]]


def _reason(faults: list[dict[str, Any]]) -> str:
    """The cause of an attempt's end: the earliest fault any rank noted, or 'lost' when none did."""
    if not faults:
        return "lost"
    first = min(faults, key=lambda f: f.get("detected_at", 0.0))
    return {"preemption": "preempted"}.get(first["kind"], first["kind"])


FAULT_ENDS = ("exception", "hang", "lost", "sdc", "straggler")
"""How an attempt that ended in a fault ended (its ``end_reason``)."""


def failure_history(attempts: list[AttemptRecord]) -> tuple[float, int]:
    """Wall-clock seconds of the run so far and the attempts among them that ended in a fault (the checkpoint cadence
    estimates the job's mean time between failures from these)."""
    if not attempts:
        return 0.0, 0
    failures = sum(a.end_reason in FAULT_ENDS for a in attempts[:-1])
    return account(attempts).wall_s, failures


def account(attempts: list[AttemptRecord]) -> EttrReport:
    """Time accounting over ``attempts`` (see the module docstring for the definitions)."""
    if not attempts:
        return EttrReport(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0, 0, 0, [])
    end = max(a.ended_at or a.last_heartbeat_at or a.started_at for a in attempts)
    wall = end - attempts[0].started_at
    training = sum(a.training_s for a in attempts)
    blocking = sum(a.checkpoint_blocking_s for a in attempts)
    first = attempts[0]
    startup = (first.first_step_at - first.started_at) if first.first_step_at is not None else 0.0
    gap = detection = recompute = 0.0
    redone = 0
    causes: list[str] = []
    costs: list[RestartCost] = []
    for prev, cur in itertools.pairwise(attempts):
        causes.append(prev.end_reason or "lost")
        hangs = sorted((f for f in prev.faults if f.get("kind") == "hang"), key=lambda f: f.get("detected_at", 0.0))
        hang_s = float(hangs[0].get("detection_s") or 0.0) if hangs else 0.0
        detection += hang_s  # the first rank to detect it ended the attempt; later notes are its consequences
        cost = restart_cost(prev, cur, hang_s)
        if cost is not None:
            costs.append(cost)
        if cur.first_step_at is not None:
            gap += cur.first_step_at - (prev.last_heartbeat_at or prev.started_at)
        if cur.start_step is not None and prev.last_step is not None and prev.last_step > cur.start_step:
            steps = prev.last_step - cur.start_step
            redone += steps
            recompute += steps * (prev.step_s or cur.step_s or 0.0)
    for a in attempts:  # steps undone in the process by in-process rollbacks
        redone += a.rolled_back_steps
        recompute += a.rolled_back_steps * (a.step_s or 0.0)
    productive = max(training - recompute - blocking, 0.0)
    return EttrReport(
        wall_s=wall,
        training_s=training,
        productive_s=productive,
        startup_s=startup,
        restart_gap_s=gap,
        detection_s=detection,
        recompute_s=recompute,
        recomputed_steps=redone,
        checkpoint_blocking_s=blocking,
        attempts=len(attempts),
        restarts=len(attempts) - 1,
        causes=causes,
        restart_costs=costs,
    )
