"""Build a report from the components' sections, deriving the figures the reliability simulator reads.

Components hand in JSON-able ``report()`` dicts, one *section* each (``checkpoint``, ``fault_tolerance``,
``straggler``, ``sdc``, ...); :func:`checkpoint_section` turns the checkpoint engine's counters into one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_resilience.checkpoint.manager import CheckpointStats
from lightning_resilience.checkpoint.tier import Tier
from lightning_resilience.ft.ettr import FAULT_ENDS
from lightning_resilience.report.model import ResilienceReport, finite

__all__ = ["assemble", "checkpoint_section", "thin"]

_SERIES_CAP = 5000  # points of a per-step series kept in the JSON (evenly thinned beyond that)
_IN_JOB_LAUNCHERS = ("torchrun", "ft_launcher")
_SIM_TIER_KEYS = ("every_n_steps", "blocking_seconds", "write_seconds", "restore_seconds", "durability", "keep")


def checkpoint_section(
    stats: CheckpointStats,
    tiers: Sequence[Tier],
    *,
    restores: int = 0,
    blocking_timeline: Sequence[tuple[int, float]] = (),
    cadence: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``checkpoint`` section from the engine's counters and its tiers.

    A snapshot blocks training once, whichever tiers it feeds. Its cost is charged to the tiers whose cadence
    triggers snapshots: the RAM tiers when there are any (persistent tiers then copy in the background), otherwise
    every persistent tier. ``cadence``: the engine's cadence report (``CadenceController.report``); a tier's
    ``every_n_steps`` is then the cadence it followed last, and the section says why under ``cadence``.
    """
    chosen = (cadence or {}).get("tiers", {})
    ram = {t.name for t in tiers if t.ram}
    triggers = ram or {t.name for t in tiers}
    out_tiers: dict[str, Any] = {}
    for tier in tiers:
        t = stats.tiers.get(tier.name)
        if t is None:
            continue
        out_tiers[tier.name] = {
            "every_n_steps": (chosen.get(tier.name) or {}).get("every_n_steps") or tier.every_n_steps or None,
            "keep": tier.keep,
            "durability": str(tier.durability),
            "kind": type(tier).__name__,
            "writes": t.writes,
            "failures": t.failures,
            "deferred": t.deferred,
            "bytes": t.bytes,
            "seconds": t.seconds,
            "write_seconds": 0.0 if tier.name in ram else (t.seconds / t.writes if t.writes else 0.0),
            "blocking_seconds": stats.capture_seconds_mean if tier.name in triggers else 0.0,
            "restore_seconds": stats.restore_seconds if stats.restored_from == tier.name else 0.0,
            "last_step": t.last_step,
            "last_error": t.last_error,
        }
    return {
        "captures": stats.captures,
        "state_bytes": stats.state_bytes,
        "host_bytes": stats.host_bytes,
        "blocking_seconds_total": stats.capture_seconds,
        "blocking_seconds_mean": stats.capture_seconds_mean,
        "blocking_seconds_max": stats.capture_seconds_max,
        "wait_seconds": stats.wait_seconds,
        "restores": restores,
        "restored_step": stats.restored_step,
        "restored_from": stats.restored_from,
        "restore_seconds": stats.restore_seconds,
        "skipped_corrupt": list(stats.skipped_corrupt),
        "tiers": out_tiers,
        "blocking_timeline": [[int(s), float(v)] for s, v in thin(list(blocking_timeline), _SERIES_CAP)],
        **({"cadence": dict(cadence)} if cadence else {}),
    }


def thin(points: list[Any], cap: int) -> list[Any]:
    """At most ``cap`` of ``points``, evenly spaced, the first one kept."""
    if len(points) <= cap:
        return points
    stride = len(points) / cap
    return [points[int(i * stride)] for i in range(cap)]


def assemble(
    sections: Mapping[str, Mapping[str, Any]],
    *,
    summaries: Mapping[str, str] | None = None,
    step_seconds: float | None = None,
    gpus: int | None = None,
    gpus_per_node: int | None = None,
    created: float | None = None,
) -> ResilienceReport:
    """Build a report from component sections, deriving the simulator's figures from them.

    * ``tiers``: the ``tiers`` of any section that has them (the checkpoint section).
    * ``restart_seconds``, ``detection_seconds``, ``failures``: from a section holding the ledger of attempts
      (``attempts`` and ``ettr``, the fault-tolerance section): the mean gap between an attempt's last step and
      the next one's first step, per restart path (``in_job`` under torchrun or ft_launcher, else ``cold``); the
      mean detection time of hangs; the attempts that ended in a fault over the wall time.
    """
    report = ResilienceReport(
        sections={str(k): dict(v) for k, v in sections.items()},
        summaries=dict(summaries or {}),
        step_seconds=finite(step_seconds),
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        created=time.time() if created is None else created,
    )
    for section in report.sections.values():
        tiers = section.get("tiers")
        if isinstance(tiers, Mapping) and all(isinstance(t, Mapping) and "every_n_steps" in t for t in tiers.values()):
            for name, t in tiers.items():
                report.tiers[str(name)] = {k: t[k] for k in _SIM_TIER_KEYS if t.get(k) is not None}
        attempts = section.get("attempts")
        if isinstance(attempts, list) and isinstance(section.get("ettr"), Mapping):
            _ledger_figures(report, attempts, section["ettr"])
    return report


def _ledger_figures(report: ResilienceReport, attempts: list[Any], ettr: Mapping[str, Any]) -> None:
    gaps: dict[str, list[float]] = {}
    hangs: list[float] = []
    faults = 0
    for i, prev in enumerate(attempts):
        if prev.get("end_reason") in FAULT_ENDS:
            faults += 1
        for fault in prev.get("faults") or []:
            if fault.get("kind") == "hang" and finite(fault.get("detection_s")) is not None:
                hangs.append(float(fault["detection_s"]))
        if i + 1 >= len(attempts):
            continue
        cur = attempts[i + 1]
        end, start = prev.get("last_heartbeat_at") or prev.get("started_at"), cur.get("first_step_at")
        if end is None or start is None:
            continue
        in_job = cur.get("launcher") in _IN_JOB_LAUNCHERS and int(cur.get("restart_count") or 0) > 0
        gaps.setdefault("in_job" if in_job else "cold", []).append(max(float(start) - float(end), 0.0))
    report.restart_seconds = {path: statistics.fmean(v) for path, v in gaps.items()}
    if hangs:
        report.detection_seconds["hang"] = statistics.fmean(hangs)
    wall = finite(ettr.get("wall_s"))
    if wall:
        report.failures = {"count": faults, "wall_seconds": wall}
