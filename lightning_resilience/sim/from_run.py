"""Measured costs of a real run, read from its report, to feed the simulator (``simulate --from-run``).

A run directory holds ``resilience_report.json`` (schema below; every key optional), or, failing that, the
``report.jsonl`` that ``recipes.pretrain_gpt`` appends per attempt (its last line is used)::

    {
      "step_seconds": 0.12,             # median optimizer step, checkpointing excluded
      "gpus": 16,                       # scale of the run (informational; the simulated scale is --gpus)
      "gpus_per_node": 8,
      "tiers": {                        # one entry per checkpoint tier, in restore-preference-free order
        "memory": {"every_n_steps": 1, "blocking_seconds": 0.002, "write_seconds": 0.0,
                   "restore_seconds": 0.01, "durability": "process", "keep": 2},
        "local":  {"every_n_steps": 20, "blocking_seconds": 0.0, "write_seconds": 0.3,
                   "restore_seconds": 0.05, "durability": "host"}
      },
      "restart_seconds": {"in_job": 12.3},          # per restart path: in_process, in_job, warm_spare, cold
      "detection_seconds": {"crash": 1.0},          # per failure kind: crash, hang, sdc, fail_slow
      "failures": {"count": 3, "wall_seconds": 600} # observed failures: sets the MTTF when --mttf is not given
    }

Missing keys keep the simulator's defaults; a tier without ``durability`` gets one from its name (``memory`` ->
process, ``local`` -> host, ``peer``/``replica`` -> peer, ``remote``/``s3``/``gcs`` -> remote, otherwise host);
``every_n_steps`` defaults to 1, ``keep`` to 2, costs to 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_resilience.rundir import RunDir
from lightning_resilience.sim.config import RESTART_PATHS, SimConfig, SimTierConfig

__all__ = ["REPORT_NAME", "RunCosts", "apply_run_costs", "load_run_costs"]

REPORT_NAME = RunDir(Path()).report.name
LEGACY_NAME = "report.jsonl"


@dataclass
class RunCosts:
    """What a run measured; None or empty where it said nothing."""

    source: str
    step_s: float | None = None
    gpus: int | None = None
    gpus_per_node: int | None = None
    tiers: list[SimTierConfig] = field(default_factory=list)
    restart_s: dict[str, float] = field(default_factory=dict)
    detection_s: dict[str, float] = field(default_factory=dict)
    failures: int | None = None
    failure_wall_s: float | None = None

    @property
    def observed_mttf_s(self) -> float | None:
        if self.failures and self.failure_wall_s:
            return self.failure_wall_s / self.failures
        return None


def _durability(name: str) -> str:
    low = name.lower()
    if "memory" in low or low == "ram":
        return "process"
    if "peer" in low or "replica" in low:
        return "peer"
    if any(w in low for w in ("remote", "s3", "gcs", "blob")):
        return "remote"
    return "host"


def _num(value: Any, key: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")
    return float(value)


def _from_report(data: dict[str, Any], source: str) -> RunCosts:
    costs = RunCosts(source=source, step_s=_num(data.get("step_seconds"), "step_seconds"))
    if costs.step_s == 0:
        costs.step_s = None
    costs.gpus = data.get("gpus")
    costs.gpus_per_node = data.get("gpus_per_node")
    for name, t in (data.get("tiers") or {}).items():
        t = t or {}
        costs.tiers.append(
            SimTierConfig(
                name=str(name),
                every_n_steps=int(t.get("every_n_steps", 1)),
                blocking_s=_num(t.get("blocking_seconds"), f"tiers.{name}.blocking_seconds") or 0.0,
                write_s=_num(t.get("write_seconds"), f"tiers.{name}.write_seconds") or 0.0,
                restore_s=_num(t.get("restore_seconds"), f"tiers.{name}.restore_seconds") or 0.0,
                durability=t.get("durability", _durability(str(name))),
                keep=int(t.get("keep", 2)),
            )
        )
    for path, value in (data.get("restart_seconds") or {}).items():
        if path not in RESTART_PATHS:
            raise ValueError(f"restart_seconds.{path}: unknown restart path; expected one of {RESTART_PATHS}")
        costs.restart_s[path] = _num(value, f"restart_seconds.{path}") or 0.0
    for kind, value in (data.get("detection_seconds") or {}).items():
        costs.detection_s[str(kind)] = _num(value, f"detection_seconds.{kind}") or 0.0
    fails = data.get("failures") or {}
    costs.failures = fails.get("count")
    costs.failure_wall_s = _num(fails.get("wall_seconds"), "failures.wall_seconds")
    return costs


def _from_legacy(line: dict[str, Any], source: str) -> RunCosts:
    """The per-attempt line of ``recipes.pretrain_gpt``: step time, capture blocking, tier write and restore times."""
    costs = RunCosts(source=source)
    if line.get("median_step_ms"):
        costs.step_s = float(line["median_step_ms"]) / 1e3
    costs.gpus = line.get("world_size")
    tiers = line.get("tiers") or {}
    final_step = int(line.get("final_step") or 0)
    busiest = max(tiers, key=lambda n: tiers[n].get("writes", 0), default=None)
    for name, t in tiers.items():
        writes = int(t.get("writes") or 0)
        every = max(1, round(final_step / writes)) if writes and final_step else 1
        blocking = float(line.get("blocking_ms_mean") or 0.0) / 1e3 if name == busiest else 0.0
        restore = float(line.get("restore_ms") or 0.0) / 1e3 if line.get("restored_from") == name else 0.0
        costs.tiers.append(
            SimTierConfig(
                name=name,
                every_n_steps=every,
                blocking_s=blocking,
                write_s=float(t.get("seconds") or 0.0) / writes if writes else 0.0,
                restore_s=restore,
                durability=_durability(name),  # type: ignore[arg-type]
            )
        )
    return costs


def load_run_costs(run_dir: str | Path) -> RunCosts:
    """Read the measured costs of a run directory (or of a report file given directly).

    Raises:
        FileNotFoundError: neither ``resilience_report.json`` nor ``report.jsonl`` is there.
        ValueError: the report is not valid JSON or holds a bad value (the message names the key).
    """
    path = Path(run_dir)
    candidates = [path] if path.is_file() else [path / REPORT_NAME, path / LEGACY_NAME]
    for file in candidates:
        if not file.is_file():
            continue
        text = file.read_text()
        try:
            if file.suffix == ".jsonl":
                lines = [json.loads(x) for x in text.splitlines() if x.strip()]
                if not lines:
                    raise ValueError(f"{file} is empty")
                return _from_legacy(lines[-1], str(file))
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{file} is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
        return _from_report(data, str(file))
    raise FileNotFoundError(f"no {REPORT_NAME} or {LEGACY_NAME} under {path}")


def apply_run_costs(cfg: SimConfig, costs: RunCosts) -> SimConfig:
    """A copy of ``cfg`` with what the run measured: step time, tiers, restart and detection seconds."""
    job = dataclasses.replace(cfg.job, step_s=costs.step_s) if costs.step_s else cfg.job
    restart = dataclasses.replace(cfg.restart, **costs.restart_s) if costs.restart_s else cfg.restart
    kinds = [
        dataclasses.replace(k, detection_s=costs.detection_s[k.name]) if k.name in costs.detection_s else k
        for k in cfg.failures.kinds
    ]
    failures = dataclasses.replace(cfg.failures, kinds=kinds)
    tiers = list(costs.tiers) if costs.tiers else cfg.tiers
    return dataclasses.replace(cfg, job=job, restart=restart, failures=failures, tiers=tiers)
