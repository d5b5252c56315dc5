"""Where a restart's time goes: from the last good step before a fault to the end of the first step after it,
split into detection, relaunch (teardown, the launcher, new processes), imports, rendezvous, setup, restore and the
first step, and the steps it lost. Built from two consecutive attempts of the ETTR ledger
(:mod:`lightning_resilience.ft.ettr`)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_resilience.ft.ettr import AttemptRecord

__all__ = ["RESTART_PARTS", "RestartCost", "describe_restart", "process_started_at", "restart_cost"]


RESTART_PARTS = ("detection", "relaunch", "imports", "rendezvous", "setup", "restore", "first_step")
"""Where the time from a fault to the first good step goes (see the module docstring), in order."""


@dataclass(frozen=True)
class RestartCost:
    """One restart: what it lost and where its seconds went."""

    attempt: int
    """The attempt that restarted (the next one after the fault)."""
    cause: str
    steps_lost: int
    """Steps trained again: the previous attempt's last step minus the step resumed from."""
    fault_to_first_good_step_s: float
    """From the last good step before the fault to the end of the first step after the restart."""
    parts: dict[str, float]
    """:data:`RESTART_PARTS` -> seconds; they add up to ``fault_to_first_good_step_s``."""
    restored_from: str | None = None

    def share(self, part: str) -> float:
        total = self.fault_to_first_good_step_s
        return self.parts.get(part, 0.0) / total if total > 0 else 0.0


def restart_cost(prev: AttemptRecord, cur: AttemptRecord, detection_s: float = 0.0) -> RestartCost | None:
    """The cost of the restart from ``prev`` to ``cur``; None until ``cur`` has run its first step. A moment the
    ledger lacks (an older ledger, a process without /proc) folds its part into the next part."""
    if cur.first_step_at is None:
        return None
    fault = prev.last_heartbeat_at or prev.started_at
    restore = float(cur.restore_s or 0.0)
    restored = cur.restored_at if cur.restored_at is not None else (cur.first_step_at if restore else None)
    detected = prev.ended_at if prev.ended_at is not None else fault
    marks = [
        ("detection", max(detected, fault + detection_s)),
        ("relaunch", cur.process_started_at),
        ("imports", cur.script_ready_at),
        ("rendezvous", cur.started_at),
        ("setup", restored - restore if restored is not None else None),
        ("restore", restored),
        ("setup", cur.first_step_at),
        ("first_step", cur.first_step_done_at if cur.first_step_done_at is not None else cur.first_step_at),
    ]
    parts = dict.fromkeys(RESTART_PARTS, 0.0)
    at = fault
    for part, mark in marks:
        if mark is None:
            continue
        mark = max(mark, at)  # clocks of different processes: never a negative part
        parts[part] += mark - at
        at = mark
    lost = max((prev.last_step or 0) - (cur.start_step or 0), 0) if prev.last_step is not None else 0
    return RestartCost(cur.index, prev.end_reason or "lost", lost, at - fault, parts, cur.restored_from)


def describe_restart(cost: Mapping[str, Any]) -> str:
    """One restart (a :class:`RestartCost` as JSON) in a line: its cause, the steps lost, and where each second
    from the fault to the first good step went."""
    total = float(cost.get("fault_to_first_good_step_s") or 0.0)
    parts = cost.get("parts") or {}
    shares = ", ".join(
        f"{name.replace('_', ' ')} {seconds:.2f}s ({100 * seconds / total:.0f}%)"
        for name, seconds in ((n, parts.get(n)) for n in RESTART_PARTS)  # in order: a JSON file may sort its keys
        if isinstance(seconds, int | float) and seconds > 0 and total > 0
    )
    source = f" from {cost['restored_from']!r}" if cost.get("restored_from") else ""
    return (
        f"{cost.get('cause')}: {cost.get('steps_lost')} steps lost, resumed{source}; fault to first good step "
        f"{total:.2f}s: {shares or '-'}"
    )


def process_started_at(pid: int | str = "self") -> float | None:
    """Wall-clock time (time.time) when a process started, from /proc (Linux, to the tick: /proc/uptime); else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # the name (field 2) may hold spaces
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
