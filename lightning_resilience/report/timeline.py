"""The goodput timeline of a whole job: every attempt's progress over wall-clock time, where the time went, and why
each attempt ended.

Built from the ledger of attempts (:mod:`lightning_resilience.ft.ettr`: start, first step, pace, persists, restore,
end) and the cause of each attempt's end (:mod:`.attribution`). Times are seconds since the job's first start.
Each stretch of wall-clock time falls in one band:

* ``productive``: training that reached a step no attempt had reached before;
* ``startup``: an attempt's processes are up (the ledger's first entry) until its first step, less the restore
  (model, data, strategy setup);
* ``recompute``: training again over steps an earlier attempt had done (lost to the fault);
* ``detection``: after an attempt's last step until its end was recorded (a peer's collective failing, a hang's
  stuck time until the watchdog fired);
* ``relaunch``: from there until the next attempt's rank 0 process started (teardown, the launcher, a requeue's
  wait, new processes);
* ``imports``: from the process start until the script had built its callbacks (interpreter, imports, the script);
* ``rendezvous``: from there until the Trainer set up its callbacks (rendezvous, process group, strategy setup);
  an attempt of a ledger without these moments has them in ``relaunch``;
* ``restore``: loading the checkpoint the attempt resumed from;
* ``teardown``: after the last attempt's last step until it ended (final checkpoint flush, shutdown).

Framework-free and without matplotlib; :mod:`.timeline_plot` draws it.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_resilience.attribution.engine import Attribution
from lightning_resilience.ft.ettr import AttemptRecord, account

__all__ = ["BAND_KINDS", "AttemptTrack", "Band", "Timeline", "build_timeline"]

BAND_KINDS = (
    "productive",
    "startup",
    "recompute",
    "detection",
    "relaunch",
    "imports",
    "rendezvous",
    "restore",
    "teardown",
)


@dataclass(frozen=True)
class Band:
    start: float
    end: float
    kind: str
    attempt: int

    @property
    def seconds(self) -> float:
        return max(self.end - self.start, 0.0)


@dataclass
class AttemptTrack:
    """One attempt on the timeline (seconds since the job's first start)."""

    index: int
    restart_count: int
    launcher: str
    started: float
    first_step: float | None
    last_heartbeat: float | None
    ended: float | None
    start_step: int | None
    last_step: int | None
    progress: list[tuple[float, int]] = field(default_factory=list)
    """(time, step) points of the attempt's pace, first step to last heartbeat."""
    recompute_until: int | None = None
    """Steps up to this one redo an earlier attempt's work."""
    restored_step: int | None = None
    restored_from: str | None = None
    restore_s: float | None = None
    restored: float | None = None
    """When the restore ended (None: right before the first step)."""
    process_started: float | None = None
    """When rank 0's process started."""
    script_ready: float | None = None
    """When the script had built its callbacks."""
    first_step_done: float | None = None
    persists: list[tuple[float, int, str]] = field(default_factory=list)
    checkpoint_blocking_s: float = 0.0
    end: dict[str, Any] | None = None
    """The attribution of the attempt's end (:meth:`Attribution.to_json`)."""

    def time_at_step(self, step: int) -> float | None:
        """When this attempt reached ``step`` (interpolated between its progress points)."""
        if not self.progress:
            return None
        times = [t for t, _ in self.progress]
        steps = [s for _, s in self.progress]
        if step <= steps[0]:
            return times[0]
        if step >= steps[-1]:
            return times[-1]
        i = bisect.bisect_left(steps, step)
        (t0, s0), (t1, s1) = self.progress[i - 1], self.progress[i]
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0) if s1 != s0 else t1


@dataclass
class Timeline:
    """The whole job: attempts, bands of wall-clock time and the ETTR breakdown."""

    t0: float
    """Wall-clock seconds (time.time) of the job's first start."""
    attempts: list[AttemptTrack]
    bands: list[Band]
    ettr: dict[str, Any]
    """:meth:`lightning_resilience.ft.ettr.EttrReport.to_json` of the job."""

    @property
    def wall_s(self) -> float:
        return float(self.ettr.get("wall_s") or 0.0)

    def seconds_by_kind(self) -> dict[str, float]:
        out = dict.fromkeys(BAND_KINDS, 0.0)
        for band in self.bands:
            out[band.kind] = out.get(band.kind, 0.0) + band.seconds
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "t0": self.t0,
            "attempts": [asdict(a) for a in self.attempts],
            "bands": [asdict(b) for b in self.bands],
            "ettr": dict(self.ettr),
            "seconds_by_kind": self.seconds_by_kind(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Timeline:
        attempts = []
        for a in data.get("attempts") or []:
            fields = dict(a)
            fields["progress"] = [(float(t), int(s)) for t, s in fields.get("progress") or []]
            fields["persists"] = [(float(t), int(s), str(n)) for t, s, n in fields.get("persists") or []]
            attempts.append(AttemptTrack(**{k: v for k, v in fields.items() if k in AttemptTrack.__dataclass_fields__}))
        bands = [Band(**{k: b[k] for k in ("start", "end", "kind", "attempt")}) for b in data.get("bands") or []]
        return cls(float(data.get("t0") or 0.0), attempts, bands, dict(data.get("ettr") or {}))


def build_timeline(records: Sequence[AttemptRecord], attributions: Sequence[Attribution] = ()) -> Timeline:
    """The timeline of the attempts in a ledger; ``attributions[i]`` explains how attempt ``i`` ended."""
    if not records:
        return Timeline(0.0, [], [], account([]).to_json())
    t0 = records[0].started_at
    ends = {a.attempt: a for a in attributions}
    tracks: list[AttemptTrack] = []
    bands: list[Band] = []
    furthest: int | None = None  # the furthest step any earlier attempt reached
    for i, rec in enumerate(records):
        track = _track(rec, t0, ends.get(i))
        if furthest is not None and track.start_step is not None and track.start_step < furthest:
            track.recompute_until = furthest
        tracks.append(track)
        if i > 0:
            bands += _gap(tracks[i - 1], track)
        bands += _startup(track)
        bands += _training(track)
        if rec.last_step is not None:
            furthest = rec.last_step if furthest is None else max(furthest, rec.last_step)
    last = tracks[-1]
    if last.ended is not None and last.last_heartbeat is not None and last.ended > last.last_heartbeat:
        bands.append(Band(last.last_heartbeat, last.ended, "teardown", last.index))
    return Timeline(t0, tracks, [b for b in bands if b.seconds > 0], account(list(records)).to_json())


def _track(rec: AttemptRecord, t0: float, end: Attribution | None) -> AttemptTrack:
    def rel(t: float | None) -> float | None:
        return None if t is None else t - t0

    progress = sorted((float(t) - t0, int(s)) for t, s in rec.progress)
    if not progress and rec.first_step_at is not None and rec.start_step is not None:
        progress = [(rec.first_step_at - t0, rec.start_step)]
    if rec.last_heartbeat_at is not None and rec.last_step is not None:
        tail = (rec.last_heartbeat_at - t0, rec.last_step)
        if not progress or progress[-1] != tail:
            progress.append(tail)
    return AttemptTrack(
        index=rec.index,
        restart_count=rec.restart_count,
        launcher=rec.launcher,
        started=rec.started_at - t0,
        first_step=rel(rec.first_step_at),
        last_heartbeat=rel(rec.last_heartbeat_at),
        ended=rel(rec.ended_at),
        start_step=rec.start_step,
        last_step=rec.last_step,
        progress=progress,
        restored_step=rec.restored_step,
        restored_from=rec.restored_from,
        restore_s=rec.restore_s,
        restored=rel(rec.restored_at),
        process_started=rel(rec.process_started_at),
        script_ready=rel(rec.script_ready_at),
        first_step_done=rel(rec.first_step_done_at),
        persists=[(float(t) - t0, int(s), str(tier)) for t, s, tier in rec.persists],
        checkpoint_blocking_s=rec.checkpoint_blocking_s,
        end=end.to_json() if end is not None else None,
    )


def _gap(prev: AttemptTrack, cur: AttemptTrack) -> list[Band]:
    """From the previous attempt's last heartbeat to this attempt's start: detection, relaunch, imports,
    rendezvous."""
    start = prev.last_heartbeat if prev.last_heartbeat is not None else prev.started
    if cur.started <= start:
        return []
    detected = prev.ended if prev.ended is not None else start
    detection = (prev.end or {}).get("detection_s")
    if isinstance(detection, int | float) and detection > 0:
        detected = max(detected, start + float(detection))
    return _consecutive(
        start,
        [
            (detected, "detection", prev.index),
            (cur.process_started, "relaunch", cur.index),
            (cur.script_ready, "imports", cur.index),
            (cur.started, "rendezvous" if cur.script_ready is not None else "relaunch", cur.index),
        ],
        cur.started,
    )


def _consecutive(start: float, marks: list[tuple[float | None, str, int]], end: float) -> list[Band]:
    """Bands from ``start`` to each known mark in turn (clipped to ``[start, end]``, never backwards)."""
    bands, at = [], start
    for mark, kind, attempt in marks:
        if mark is None:
            continue
        mark = min(max(mark, at), end)
        bands.append(Band(at, mark, kind, attempt))
        at = mark
    return bands


def _startup(track: AttemptTrack) -> list[Band]:
    """From the attempt's first ledger entry to its first step: setup, the restore, setup again (data loaders)."""
    if track.first_step is None or track.first_step <= track.started:
        return []
    restored = track.restored if track.restored is not None else track.first_step
    restore_from = restored - float(track.restore_s or 0.0)
    marks = [(restore_from, "startup", track.index), (restored, "restore", track.index)]
    return _consecutive(track.started, [*marks, (track.first_step, "startup", track.index)], track.first_step)


def _training(track: AttemptTrack) -> list[Band]:
    if track.first_step is None or track.last_heartbeat is None:
        return []
    start, end = track.first_step, track.last_heartbeat
    if track.recompute_until is None:
        return [Band(start, end, "productive", track.index)]
    caught_up = track.time_at_step(track.recompute_until)
    cut = end if caught_up is None else min(max(caught_up, start), end)
    return [Band(start, cut, "recompute", track.index), Band(cut, end, "productive", track.index)]
