"""The report as ``rich`` tables: overview, why each attempt ended, checkpoint tiers, ETTR, detections.

Every text from the run (exception messages, paths, section names) is shown as plain text, never parsed as
markup: a message such as ``closing tag '[/__w/pytorch/...]'`` renders as written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from lightning_resilience.ft.restart_cost import describe_restart
from lightning_resilience.report.model import ResilienceReport, finite

__all__ = ["format_bytes", "render_table"]

_MESSAGE_WIDTH = 240  # characters of a message shown in a table cell (the JSON keeps it whole)


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
    v = finite(seconds)
    return "-" if v is None else f"{v * 1e3:.2f} ms"


def _s(seconds: Any) -> str:
    v = finite(seconds)
    return "-" if v is None else f"{v:.2f} s"


def _text(value: Any, style: str = "") -> Text:
    """Plain text (no markup, no emoji codes), cut to a table cell's worth."""
    return Text(_cut(value), style=style)


def _table(title: str, *, header: bool = True) -> Table:
    return Table(title=_text(title), show_header=header, title_justify="left")


def _kv_table(title: str, rows: Iterable[tuple[str, Any]]) -> Table:
    table = _table(title, header=False)
    table.add_column("figure", style="bold")
    table.add_column("value")
    for k, v in rows:
        table.add_row(_text(k), _text(v))
    return table


def render_table(report: ResilienceReport) -> RenderableType:
    """The report as ``rich`` tables: overview, attempts and their causes, checkpoint tiers, fault tolerance
    (ETTR), detections, and any other section's scalar figures. Sections that are absent are left out."""
    parts: list[RenderableType] = [Text("Resilience report", style="bold underline")]
    overview: list[tuple[str, Any]] = [
        ("step time", _ms(report.step_seconds)),
        ("gpus", report.gpus),
        ("gpus per node", report.gpus_per_node),
    ]
    if report.failures:
        overview.append(("failures", f"{report.failures.get('count')} in {_s(report.failures.get('wall_seconds'))}"))
    for path, v in report.restart_seconds.items():
        overview.append((f"restart ({path})", _s(v)))
    for kind, v in report.detection_seconds.items():
        overview.append((f"detection ({kind})", _s(v)))
    parts.append(_kv_table("Run", overview))
    if report.attempts:
        parts.append(_attempts_table(report.attempts))
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


def _attempts_table(attempts: list[dict[str, Any]]) -> Table:
    table = _table("Attempts: why each ended (culprit: the rank that failed first; victims: failed because of it)")
    table.add_column("attempt", justify="right")
    table.add_column("ended")
    table.add_column("culprit, how, victims", overflow="fold")
    for a in attempts:
        cause = a.get("cause") or {}
        outcome = str(a.get("outcome", "-"))
        lines = Text()
        if not cause:
            lines.append("-")
        else:
            rank = cause.get("rank")
            lines.append("no single rank" if rank is None else f"rank {rank}", style="bold")
            lines.append(f": {_cut(cause.get('detail'))}")
            if cause.get("step") is not None:
                lines.append(f" (step {cause['step']})")
            if cause.get("where"):
                lines.append(f"\n  stuck {cause['where']}")
            if cause.get("stacks"):
                lines.append(f"\n  stacks: {cause['stacks']}")
            evidence = ", ".join(cause.get("evidence") or [])
            detected = finite(a.get("detection_s"))
            lines.append(f"\n  evidence: {evidence or '-'}")
            if detected:
                lines.append(f"; detected after {detected:.1f} s")
            for victim in a.get("victims") or []:
                lines.append(f"\n  victim rank {victim.get('rank')}: ", style="dim")
                lines.append(_cut(victim.get("brief") or victim.get("detail")), style="dim")
        table.add_row(_text(a.get("attempt")), _text(outcome, "red" if outcome == "fault" else ""), lines)
    return table


def _cut(value: Any) -> str:
    s = "-" if value is None else str(value)
    return s if len(s) <= _MESSAGE_WIDTH else s[: _MESSAGE_WIDTH - 1] + "…"


def _checkpoint_tables(ckpt: Mapping[str, Any]) -> list[RenderableType]:
    table = _table("Checkpoints per tier")
    for col in ("tier", "every", "durability", "writes", "failures", "deferred", "bytes written", "mean write"):
        table.add_column(col, justify="left" if col in ("tier", "durability") else "right")
    table.add_column("blocking/ckpt", justify="right")
    table.add_column("restore", justify="right")
    for name, t in (ckpt.get("tiers") or {}).items():
        table.add_row(
            _text(name),
            _text(t.get("every_n_steps", "-")),
            _text(t.get("durability", "-")),
            _text(t.get("writes", "-")),
            _text(t.get("failures", "-")),
            _text(t.get("deferred", "-")),
            _text(format_bytes(t.get("bytes"))),
            _text(_ms(t.get("write_seconds"))),
            _text(_ms(t.get("blocking_seconds"))),
            _text(_ms(t.get("restore_seconds")) if t.get("restore_seconds") else "-"),
        )
    rows: list[tuple[str, Any]] = [
        ("snapshots", ckpt.get("captures", "-")),
        ("state size", format_bytes(ckpt.get("state_bytes"))),
        ("host buffers", format_bytes(ckpt.get("host_bytes"))),
        (
            "blocking",
            f"total {_s(ckpt.get('blocking_seconds_total'))}, mean {_ms(ckpt.get('blocking_seconds_mean'))}, "
            f"max {_ms(ckpt.get('blocking_seconds_max'))}",
        ),
        ("restores", ckpt.get("restores", 0)),
    ]
    if ckpt.get("restored_step") is not None:
        source, seconds = ckpt.get("restored_from"), _ms(ckpt.get("restore_seconds"))
        rows.append(("restored", f"step {ckpt['restored_step']} from {source!r} in {seconds}"))
    for msg in ckpt.get("skipped_corrupt") or []:
        rows.append(("skipped", msg))
    cadence = ckpt.get("cadence") or {}
    for name, t in (cadence.get("tiers") or {}).items():
        if t.get("set_by") != "config":  # why the budget chose this cadence
            rows.append((f"cadence of {name}", f"every {t.get('every_n_steps')}: {t.get('reason')}"))
    return [table, _kv_table("Checkpoint engine", rows)]


def _ft_table(name: str, ft: Mapping[str, Any]) -> Table:
    rows: list[tuple[str, Any]] = []
    ettr = ft.get("ettr") or {}
    if ettr:
        value = ettr.get("ettr")
        rows += [
            ("ETTR (higher is better)", "-" if value is None else f"{value:.3f}"),
            ("wall", _s(ettr.get("wall_s"))),
            ("productive", _s(ettr.get("productive_s"))),
            ("startup", _s(ettr.get("startup_s"))),
            ("restart gaps", _s(ettr.get("restart_gap_s"))),
            ("detection", _s(ettr.get("detection_s"))),
            ("recomputation", f"{_s(ettr.get('recompute_s'))} ({ettr.get('recomputed_steps', 0)} steps)"),
            ("checkpoint blocking", _s(ettr.get("checkpoint_blocking_s"))),
            ("attempts / restarts", f"{ettr.get('attempts', '-')} / {ettr.get('restarts', '-')}"),
        ]
        rows += [(f"restart {c.get('attempt')}", describe_restart(c)) for c in ettr.get("restart_costs") or []]
    for key in ("preempted_at", "emergency_saved", "exception", "exit_code"):
        if ft.get(key) is not None:
            rows.append((key.replace("_", " "), ft[key]))
    timeouts = ft.get("timeouts_s")
    if isinstance(timeouts, Mapping) and timeouts:
        rows.append(("timeouts", ", ".join(f"{k} {_s(v)}" for k, v in timeouts.items())))
    return _kv_table(f"Fault tolerance ({name})", rows)


def _detection_rows(sections: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    rows = []
    for name, section in sections.items():
        if _is_straggler_section(section):
            rows += _straggler_rows(name, section)
        else:
            for key in ("verdicts", "decisions", "events"):
                value = section.get(key)
                if isinstance(value, list):
                    rows.append((f"{name} {key}", str(len(value))))
        if name == "rollback" or "rollback" not in sections:  # the run directory's list covers every attempt
            rows += _rollback_rows(name, section.get("rollback") if name != "rollback" else section)
        rows += _certification_rows(name, section)
        detections = section.get("detections")
        if isinstance(detections, Mapping):
            total = sum(v for v in detections.values() if isinstance(v, int | float))
            detail = ", ".join(f"{k} {v}" for k, v in detections.items())
            rows.append((f"{name} detections", f"{total:g}" + (f" ({detail})" if detail else "")))
    return rows


def _certification_rows(name: str, section: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The newest step verified clean and the checkpoint steps a verdict rejected (SDC's section)."""
    rows = []
    verified = section.get("newest_verified_step")
    if isinstance(verified, int):
        rows.append((f"{name} newest verified step", str(verified)))
    rejected = section.get("rejected_steps")
    if isinstance(rejected, list) and rejected:
        rows.append((f"{name} rejected checkpoint steps", ", ".join(str(s) for s in rejected) + " (every tier)"))
    return rows


def _rollback_rows(name: str, rollback: Any) -> list[tuple[str, str]]:
    """Each in-process rollback (step, cause, steps lost, time, samples skipped) and an escalation, if any."""
    if not isinstance(rollback, Mapping):
        return []
    done = [r for r in rollback.get("rollbacks") or [] if isinstance(r, Mapping)]
    escalated = rollback.get("escalated")
    rows = []
    for r in [*done, *([escalated] if isinstance(escalated, Mapping) else [])]:
        skipped = sum(len(v) for v in (r.get("skipped") or {}).values() if isinstance(v, list))
        rows.append(
            (
                "in-process rollback" if name == "rollback" else f"{name} rollback",
                f"step {r.get('detected_at')} ({r.get('cause')}, bad step {r.get('bad_step')}): restored step "
                f"{r.get('target')} in {_ms(r.get('seconds'))}, {r.get('steps_lost')} step(s) lost, "
                f"{skipped} sample(s) quarantined" + (": escalated, job stopped" if r.get("escalated") else ""),
            )
        )
    return rows


def _is_straggler_section(section: Mapping[str, Any]) -> bool:
    if isinstance(section.get("noise_level"), list):
        return True
    decisions = section.get("decisions")
    return isinstance(decisions, list) and any(_decision_verdict(d) is not None for d in decisions)


def _decision_verdict(d: Any) -> Mapping[str, Any] | None:
    verdict = d.get("verdict") if isinstance(d, Mapping) else None
    return verdict if isinstance(verdict, Mapping) and "slowdown" in verdict else None


def _who(v: Mapping[str, Any]) -> str:
    return "the whole job" if v.get("scope") == "job" or v.get("rank") == -1 else f"rank {v.get('rank')}"


def _straggler_rows(name: str, section: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Findings (a slowdown that reached the ``alert`` rung or beyond) apart from what only reached ``log`` and
    from confirmations within the run-to-run jitter (never acted on): those are noted, not findings."""
    decisions = [d for d in section.get("decisions") or [] if _decision_verdict(d) is not None]
    findings = [d for d in decisions if d.get("action") != "log"]
    logged = [d["verdict"] for d in decisions if d.get("action") == "log"]
    noise = [v for v in section.get("noise_level") or [] if isinstance(v, Mapping)]
    rows = []
    for d in findings[-8:]:
        v = d["verdict"]
        rows.append(
            (
                f"{name} finding",
                f"step {d.get('step')}: {d.get('action')}: {_who(v)} {_x(v.get('slowdown'))} slower in "
                f"{v.get('section')!r} since ~step {v.get('onset_step')}",
            )
        )
    if not findings:
        rows.append((f"{name} findings", "none (no slowdown reached the alert level)"))
    for label, items, why in (
        ("noted (log only)", logged, "below the alert level, not a finding"),
        ("within noise", noise, "within the run-to-run jitter, not acted on, not a finding"),
    ):
        if items:
            worst = max((v.get("slowdown") or 0.0 for v in items), default=0.0)
            who = sorted({_who(v) for v in items})
            rows.append((f"{name} {label}", f"{len(items)} slowdown(s) up to {_x(worst)} on {', '.join(who)}: {why}"))
    return rows


def _x(value: Any) -> str:
    return f"{value:.2f}x" if isinstance(value, int | float) else "?"
