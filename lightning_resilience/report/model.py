"""The end-of-run resilience report: one JSON file and one table of what every component did and what it cost.

Framework-free. Components hand in JSON-able ``report()`` dicts, one *section* each (``checkpoint``,
``fault_tolerance``, ``straggler``, ``sdc``, ...); :func:`assemble` derives from them the figures the reliability
simulator reads (``simulate --from-run <run dir>``, schema in :mod:`lightning_resilience.sim.from_run`), and the
report is written as ``<run dir>/resilience_report.json``::

    {
      "format": "lightning_resilience/report-v1",
      "created": 1764489600.0,
      "step_seconds": 0.12, "gpus": 16, "gpus_per_node": 8,          # simulator keys (all optional)
      "tiers": {"memory": {...}, "local": {...}},
      "restart_seconds": {"in_job": 12.3}, "detection_seconds": {"hang": 31.0},
      "failures": {"count": 1, "wall_seconds": 600.0},
      "sections": {"run": {...}, "checkpoint": {...}, "fault_tolerance": {...}, ...},
      "summaries": {"checkpoint": "tiered checkpoint: ...", ...}
    }

:func:`render_table` turns a report into a ``rich`` renderable and :func:`plot` draws PNGs (matplotlib optional).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from lightning_resilience.checkpoint.manager import CheckpointStats
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.replication import PeerTier
from lightning_resilience.checkpoint.tier import Tier
from lightning_resilience.ft.restart import atomic_write_json
from lightning_resilience.sim.from_run import REPORT_NAME

__all__ = [
    "REPORT_FORMAT",
    "REPORT_NAME",
    "ResilienceReport",
    "assemble",
    "checkpoint_section",
    "format_bytes",
    "load_report",
    "plot",
    "render_table",
    "save_json",
]

REPORT_FORMAT = "lightning_resilience/report-v1"
_TIMELINE_CAP = 5000  # points of a per-step series kept in the JSON (evenly thinned beyond that)
_IN_JOB_LAUNCHERS = ("torchrun", "ft_launcher")
_FAULT_ENDS = ("exception", "hang", "lost", "sdc", "straggler")


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
        out["sections"] = _jsonable(self.sections)
        out["summaries"] = dict(self.summaries)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ResilienceReport:
        if not isinstance(data, Mapping):
            raise ValueError(f"a report must be a JSON object, got {type(data).__name__}")
        fmt = data.get("format", REPORT_FORMAT)
        if fmt != REPORT_FORMAT:
            raise ValueError(f"unknown report format {fmt!r}; expected {REPORT_FORMAT!r}")
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
            created=float(data.get("created") or 0.0),
        )


# ------------------------------------------------------------------------------------------------ assembly
def checkpoint_section(
    stats: CheckpointStats,
    tiers: Sequence[Tier],
    *,
    restores: int = 0,
    blocking_timeline: Sequence[tuple[int, float]] = (),
) -> dict[str, Any]:
    """The ``checkpoint`` section from the engine's counters and its tiers.

    A snapshot blocks training once, whichever tiers it feeds. Its cost is charged to the tiers whose cadence
    triggers snapshots: the RAM tiers when there are any (persistent tiers then copy in the background), otherwise
    every persistent tier.
    """
    triggers = {t.name for t in tiers if isinstance(t, MemoryTier)} or {t.name for t in tiers}
    out_tiers: dict[str, Any] = {}
    for tier in tiers:
        t = stats.tiers.get(tier.name)
        if t is None:
            continue
        out_tiers[tier.name] = {
            "every_n_steps": tier.every_n_steps,
            "keep": tier.keep,
            "durability": _durability(tier),
            "kind": type(tier).__name__,
            "writes": t.writes,
            "failures": t.failures,
            "deferred": t.deferred,
            "bytes": t.bytes,
            "seconds": t.seconds,
            "write_seconds": 0.0 if isinstance(tier, MemoryTier) else (t.seconds / t.writes if t.writes else 0.0),
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
        "blocking_timeline": [[int(s), float(v)] for s, v in _thin(list(blocking_timeline), _TIMELINE_CAP)],
    }


def _durability(tier: Tier) -> str:
    if isinstance(tier, MemoryTier):
        return "process"
    if isinstance(tier, PeerTier):
        return "peer"
    return "remote" if tier.durability >= 2 else "host"


def _thin(points: list[Any], cap: int) -> list[Any]:
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
        step_seconds=_finite(step_seconds),
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        created=time.time() if created is None else created,
    )
    for section in report.sections.values():
        tiers = section.get("tiers")
        if isinstance(tiers, Mapping) and all(isinstance(t, Mapping) and "every_n_steps" in t for t in tiers.values()):
            for name, t in tiers.items():
                report.tiers[str(name)] = {
                    k: t[k]
                    for k in (
                        "every_n_steps",
                        "blocking_seconds",
                        "write_seconds",
                        "restore_seconds",
                        "durability",
                        "keep",
                    )
                    if t.get(k) is not None
                }
        attempts = section.get("attempts")
        if isinstance(attempts, list) and isinstance(section.get("ettr"), Mapping):
            _ledger_figures(report, attempts, section["ettr"])
    return report


def _ledger_figures(report: ResilienceReport, attempts: list[Any], ettr: Mapping[str, Any]) -> None:
    gaps: dict[str, list[float]] = {}
    hangs: list[float] = []
    faults = 0
    for i, prev in enumerate(attempts):
        if prev.get("end_reason") in _FAULT_ENDS:
            faults += 1
        for fault in prev.get("faults") or []:
            if fault.get("kind") == "hang" and _finite(fault.get("detection_s")) is not None:
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
    wall = _finite(ettr.get("wall_s"))
    if wall:
        report.failures = {"count": faults, "wall_seconds": wall}


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _jsonable(obj: Any) -> Any:
    """A copy that ``json.dump`` accepts: NaN and infinity become null, unknown objects their ``str``."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    item = getattr(obj, "item", None)  # numpy and torch scalars
    if callable(item):
        try:
            return _jsonable(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(obj)


# ------------------------------------------------------------------------------------------------- files
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


# ----------------------------------------------------------------------------------------------- render
def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def _ms(seconds: Any) -> str:
    v = _finite(seconds)
    return "-" if v is None else f"{v * 1e3:.2f} ms"


def _s(seconds: Any) -> str:
    v = _finite(seconds)
    return "-" if v is None else f"{v:.2f} s"


def _kv_table(title: str, rows: Iterable[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("figure", style="bold")
    table.add_column("value")
    for k, v in rows:
        table.add_row(k, v)
    return table


def render_table(report: ResilienceReport) -> RenderableType:
    """The report as ``rich`` tables: overview, checkpoint tiers, fault tolerance (ETTR), detections, and any
    other section's scalar figures. Sections that are absent are left out."""
    parts: list[RenderableType] = [Text("Resilience report", style="bold underline")]
    overview = [
        ("step time", _ms(report.step_seconds)),
        ("gpus", "-" if report.gpus is None else str(report.gpus)),
        ("gpus per node", "-" if report.gpus_per_node is None else str(report.gpus_per_node)),
    ]
    if report.failures:
        overview.append(("failures", f"{report.failures.get('count')} in {_s(report.failures.get('wall_seconds'))}"))
    for path, v in report.restart_seconds.items():
        overview.append((f"restart ({path})", _s(v)))
    for kind, v in report.detection_seconds.items():
        overview.append((f"detection ({kind})", _s(v)))
    parts.append(_kv_table("Run", overview))
    shown = set()
    ckpt = report.sections.get("checkpoint")
    if ckpt is not None:
        parts.extend(_checkpoint_tables(ckpt))
        shown.add("checkpoint")
    for name, section in report.sections.items():
        if isinstance(section.get("ettr"), Mapping) or "attempts" in section:
            parts.append(_ft_table(name, section))
            shown.add(name)
    detections = _detection_rows(report.sections)
    if detections:
        parts.append(_kv_table("Detections", detections))
    for name, section in report.sections.items():
        if name in shown:
            continue
        rows = [(k, _scalar(v)) for k, v in section.items() if isinstance(v, bool | int | float | str) or v is None]
        if rows:
            parts.append(_kv_table(name, rows))
    return Group(*parts)


def _scalar(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _checkpoint_tables(ckpt: Mapping[str, Any]) -> list[RenderableType]:
    table = Table(title="Checkpoints per tier", title_justify="left")
    for col in ("tier", "every", "durability", "writes", "failures", "deferred", "bytes written", "mean write"):
        table.add_column(col, justify="left" if col in ("tier", "durability") else "right")
    table.add_column("blocking/ckpt", justify="right")
    table.add_column("restore", justify="right")
    for name, t in (ckpt.get("tiers") or {}).items():
        table.add_row(
            name,
            str(t.get("every_n_steps", "-")),
            str(t.get("durability", "-")),
            str(t.get("writes", "-")),
            str(t.get("failures", "-")),
            str(t.get("deferred", "-")),
            format_bytes(t.get("bytes")),
            _ms(t.get("write_seconds")),
            _ms(t.get("blocking_seconds")),
            _ms(t.get("restore_seconds")) if t.get("restore_seconds") else "-",
        )
    rows = [
        ("snapshots", str(ckpt.get("captures", "-"))),
        ("state size", format_bytes(ckpt.get("state_bytes"))),
        ("host buffers", format_bytes(ckpt.get("host_bytes"))),
        (
            "blocking",
            f"total {_s(ckpt.get('blocking_seconds_total'))}, mean {_ms(ckpt.get('blocking_seconds_mean'))}, "
            f"max {_ms(ckpt.get('blocking_seconds_max'))}",
        ),
        ("restores", str(ckpt.get("restores", 0))),
    ]
    if ckpt.get("restored_step") is not None:
        source, seconds = ckpt.get("restored_from"), _ms(ckpt.get("restore_seconds"))
        rows.append(("restored", f"step {ckpt['restored_step']} from {source!r} in {seconds}"))
    for msg in ckpt.get("skipped_corrupt") or []:
        rows.append(("skipped", str(msg)))
    return [table, _kv_table("Checkpoint engine", rows)]


def _ft_table(name: str, ft: Mapping[str, Any]) -> Table:
    rows: list[tuple[str, str]] = []
    ettr = ft.get("ettr") or {}
    if ettr:
        value = ettr.get("ettr")
        rows += [
            ("ETTR", "-" if value is None else f"{value:.3f}"),
            ("wall", _s(ettr.get("wall_s"))),
            ("productive", _s(ettr.get("productive_s"))),
            ("startup", _s(ettr.get("startup_s"))),
            ("restart gaps", _s(ettr.get("restart_gap_s"))),
            ("detection", _s(ettr.get("detection_s"))),
            ("recomputation", f"{_s(ettr.get('recompute_s'))} ({ettr.get('recomputed_steps', 0)} steps)"),
            ("checkpoint blocking", _s(ettr.get("checkpoint_blocking_s"))),
            ("attempts / restarts", f"{ettr.get('attempts', '-')} / {ettr.get('restarts', '-')}"),
        ]
        if ettr.get("causes"):
            rows.append(("restart causes", ", ".join(map(str, ettr["causes"]))))
    for key in ("preempted_at", "emergency_saved", "exception", "exit_code"):
        if ft.get(key) is not None:
            rows.append((key.replace("_", " "), str(ft[key])))
    timeouts = ft.get("timeouts_s")
    if isinstance(timeouts, Mapping) and timeouts:
        rows.append(("timeouts", ", ".join(f"{k} {_s(v)}" for k, v in timeouts.items())))
    return _kv_table(f"Fault tolerance ({name})", rows)


def _detection_rows(sections: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    rows = []
    for name, section in sections.items():
        for key in ("verdicts", "decisions", "events"):
            value = section.get(key)
            if isinstance(value, list):
                rows.append((f"{name} {key}", str(len(value))))
        detections = section.get("detections")
        if isinstance(detections, Mapping):
            total = sum(v for v in detections.values() if isinstance(v, int | float))
            detail = ", ".join(f"{k} {v}" for k, v in detections.items())
            rows.append((f"{name} detections", f"{total:g}" + (f" ({detail})" if detail else "")))
    return rows


# -------------------------------------------------------------------------------------------------- plots
def plot(report: ResilienceReport, out_dir: str | Path) -> list[Path]:
    """Write PNGs for the series the report holds; returns the files written ([] without matplotlib).

    * ``step_times_per_rank.png``: median step time per rank, from any section with ``step_time_median_s``
      (the straggler section) or ``step_times_s`` (rows of per-rank times per step, drawn as lines).
    * ``checkpoint_blocking.png``: blocking time per snapshot over steps, from ``blocking_timeline``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, section in report.sections.items():
        series = section.get("step_times_s")
        medians = section.get("step_time_median_s")
        if isinstance(series, list) and series and all(isinstance(r, list) for r in series):
            fig, ax = plt.subplots(figsize=(8, 4))
            ranks = max(len(r) for r in series)
            for rank in range(ranks):
                ys = [r[rank] if rank < len(r) and r[rank] is not None else math.nan for r in series]
                ax.plot(range(len(series)), [y * 1e3 for y in ys], label=f"rank {rank}", linewidth=0.8)
            ax.set_xlabel("sample")
            ax.set_ylabel("step time (ms)")
            if ranks <= 16:
                ax.legend(fontsize="small")
        elif isinstance(medians, list) and medians:
            fig, ax = plt.subplots(figsize=(8, 4))
            ys = [float(v) * 1e3 if isinstance(v, int | float) and math.isfinite(v) else 0.0 for v in medians]
            ax.bar(range(len(ys)), ys)
            ax.set_xlabel("rank")
            ax.set_ylabel("median step time (ms)")
        else:
            continue
        ax.set_title(f"step time per rank ({name})")
        path = out / "step_times_per_rank.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
        break
    timeline = (report.sections.get("checkpoint") or {}).get("blocking_timeline")
    if isinstance(timeline, list) and timeline:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([p[0] for p in timeline], [p[1] * 1e3 for p in timeline], marker=".", linewidth=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("checkpoint blocking (ms)")
        ax.set_title("checkpoint blocking per snapshot")
        path = out / "checkpoint_blocking.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
