"""The report's data: :class:`ResilienceReport`, its JSON form, and reading and writing the file.

A report is written as ``<run dir>/resilience_report.json``::

    {
      "format": "lightning_resilience/report-v1",
      "created": 1764489600.0,
      "step_seconds": 0.12, "gpus": 16, "gpus_per_node": 8,          # simulator keys (all optional)
      "tiers": {"memory": {...}, "local": {...}},
      "restart_seconds": {"in_job": 12.3}, "detection_seconds": {"hang": 31.0},
      "failures": {"count": 1, "wall_seconds": 600.0},
      "attempts": [{"attempt": 0, "outcome": "fault", "cause": {...}, "victims": [...]}, ...],
      "timeline": {"attempts": [...], "events": [...], "ettr": {...}},
      "sections": {"run": {...}, "checkpoint": {...}, "fault_tolerance": {...}, ...},
      "summaries": {"checkpoint": "tiered checkpoint: ...", ...}
    }

The simulator reads the top-level figures (schema in :mod:`lightning_resilience.sim.from_run`); ``attempts`` holds
the cause of every attempt's end (:mod:`.attribution`) and ``timeline`` the whole job's goodput timeline
(:mod:`.timeline`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_resilience.ft.restart import atomic_write_json
from lightning_resilience.sim.from_run import REPORT_NAME

__all__ = ["REPORT_FORMAT", "REPORT_NAME", "ResilienceReport", "finite", "jsonable", "load_report", "save_json"]

REPORT_FORMAT = "lightning_resilience/report-v1"


@dataclass
class ResilienceReport:
    """What a run's resilience components did; the top-level figures are the simulator's inputs (seconds)."""

    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    summaries: dict[str, str] = field(default_factory=dict)
    step_seconds: float | None = None
    gpus: int | None = None
    gpus_per_node: int | None = None
    tiers: dict[str, dict[str, Any]] = field(default_factory=dict)
    restart_seconds: dict[str, float] = field(default_factory=dict)
    detection_seconds: dict[str, float] = field(default_factory=dict)
    failures: dict[str, Any] | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """The cause of each attempt's end, culprit and victims (:meth:`.attribution.Attribution.to_json`)."""
    timeline: dict[str, Any] | None = None
    """The goodput timeline of the whole job (:meth:`.timeline.Timeline.to_json`)."""
    created: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": REPORT_FORMAT, "created": self.created}
        if self.step_seconds is not None:
            out["step_seconds"] = self.step_seconds
        if self.gpus is not None:
            out["gpus"] = self.gpus
        if self.gpus_per_node is not None:
            out["gpus_per_node"] = self.gpus_per_node
        if self.tiers:
            out["tiers"] = self.tiers
        if self.restart_seconds:
            out["restart_seconds"] = self.restart_seconds
        if self.detection_seconds:
            out["detection_seconds"] = self.detection_seconds
        if self.failures is not None:
            out["failures"] = self.failures
        if self.attempts:
            out["attempts"] = jsonable(self.attempts)
        if self.timeline is not None:
            out["timeline"] = jsonable(self.timeline)
        out["sections"] = jsonable(self.sections)
        out["summaries"] = {str(k): str(v) for k, v in self.summaries.items()}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ResilienceReport:
        if not isinstance(data, Mapping):
            raise ValueError(f"a report must be a JSON object, got {type(data).__name__}")
        fmt = data.get("format", REPORT_FORMAT)
        if fmt != REPORT_FORMAT:
            raise ValueError(f"unknown report format {fmt!r}; expected {REPORT_FORMAT!r}")
        timeline = data.get("timeline")
        return cls(
            sections={str(k): dict(v) for k, v in (data.get("sections") or {}).items() if isinstance(v, Mapping)},
            summaries={str(k): str(v) for k, v in (data.get("summaries") or {}).items()},
            step_seconds=data.get("step_seconds"),
            gpus=data.get("gpus"),
            gpus_per_node=data.get("gpus_per_node"),
            tiers={str(k): dict(v) for k, v in (data.get("tiers") or {}).items()},
            restart_seconds=dict(data.get("restart_seconds") or {}),
            detection_seconds=dict(data.get("detection_seconds") or {}),
            failures=data.get("failures"),
            attempts=[dict(a) for a in data.get("attempts") or [] if isinstance(a, Mapping)],
            timeline=dict(timeline) if isinstance(timeline, Mapping) else None,
            created=float(data.get("created") or 0.0),
        )


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite, non-negative number, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def jsonable(obj: Any) -> Any:
    """A copy that ``json.dump`` accepts: NaN and infinity become null, unknown objects their ``str``."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    item = getattr(obj, "item", None)  # numpy and torch scalars
    if callable(item):
        try:
            return jsonable(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(obj)


def save_json(report: ResilienceReport, path: str | Path) -> Path:
    """Write the report atomically (a reader sees the previous file or this one); a directory gets
    ``resilience_report.json`` inside it. Returns the file written."""
    target = Path(path)
    if target.is_dir():
        target = target / REPORT_NAME
    atomic_write_json(target, report.to_json())
    return target


def load_report(path: str | Path) -> ResilienceReport:
    """Read a report file, or the ``resilience_report.json`` of a run directory.

    Raises:
        FileNotFoundError: no report there.
        ValueError: not a report (the message says why).
    """
    target = Path(path)
    if target.is_dir():
        target = target / REPORT_NAME
    if not target.is_file():
        raise FileNotFoundError(f"no resilience report at {target}")
    try:
        data = json.loads(target.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{target} is not valid JSON: {err}") from err
    try:
        return ResilienceReport.from_json(data)
    except ValueError as err:
        raise ValueError(f"{target}: {err}") from err
