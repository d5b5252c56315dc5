"""What a simulation reports: where the wall-clock time went (ETTR and its breakdown), for one run and many."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["CATEGORIES", "Breakdown", "MonteCarloResult", "SimResult"]

CATEGORIES: tuple[str, ...] = (
    "productive",
    "suite",
    "checkpoint",
    "lost",
    "detection",
    "restart",
    "restore",
    "degraded",
)


@dataclass
class Breakdown:
    """Where the wall-clock time went, in seconds."""

    productive: float = 0.0
    """Steps that are part of the final result."""
    suite: float = 0.0
    """The resilience suite's own time on the steps that are part of the final result (its step path)."""
    checkpoint: float = 0.0
    """Training loop stopped for checkpoints (blocking part only)."""
    lost: float = 0.0
    """Steps computed and then rolled back (including training on corrupted state before an SDC was detected)."""
    detection: float = 0.0
    """Stalled between a crash or hang and its detection."""
    restart: float = 0.0
    """Restart paths (respawn, requeue, spare swap)."""
    restore: float = 0.0
    """Loading checkpoints back."""
    degraded: float = 0.0
    """Extra step time while a fail-slow node was in the job."""

    @property
    def total(self) -> float:
        return sum(getattr(self, c) for c in CATEGORIES)

    def as_dict(self) -> dict[str, float]:
        return {c: float(getattr(self, c)) for c in CATEGORIES}

    def fractions(self) -> dict[str, float]:
        total = self.total
        return {c: (getattr(self, c) / total if total > 0 else 0.0) for c in CATEGORIES}


@dataclass
class SimResult:
    """The outcome of one simulated job."""

    wall_s: float
    """Wall-clock seconds simulated (the horizon, or the time the target step was reached)."""
    breakdown: Breakdown
    final_step: int
    failures: dict[str, int]
    """Failures handled, by kind."""
    restarts: dict[str, int]
    """Restarts begun, by path (an interrupted recovery counts again)."""
    restores: dict[str, int]
    """Restores, by tier name (``scratch`` when no checkpoint was left)."""
    job_mttf_s: float
    seed: int | None
    sim_seconds: float = 0.0
    """Host seconds the simulation took."""

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive time / wall time."""
        return self.breakdown.productive / self.wall_s if self.wall_s > 0 else 0.0

    def report(self) -> dict[str, Any]:
        return {
            "ettr": self.ettr,
            "wall_s": self.wall_s,
            "final_step": self.final_step,
            "breakdown_s": self.breakdown.as_dict(),
            "breakdown_fraction": self.breakdown.fractions(),
            "failures": dict(self.failures),
            "restarts": dict(self.restarts),
            "restores": dict(self.restores),
            "job_mttf_s": self.job_mttf_s,
            "seed": self.seed,
            "sim_seconds": self.sim_seconds,
        }

    def summary(self) -> str:
        fr = self.breakdown.fractions()
        parts = ", ".join(f"{c} {100 * fr[c]:.2f}%" for c in CATEGORIES)
        return (
            f"ETTR {self.ettr:.4f} over {self.wall_s / 86400:.2f} days, {sum(self.failures.values())} failures "
            f"(job MTTF {self.job_mttf_s / 3600:.2f} h): {parts}"
        )


@dataclass
class MonteCarloResult:
    """Several independent replications of one configuration."""

    runs: list[SimResult] = field(default_factory=list)

    @property
    def ettrs(self) -> np.ndarray:
        return np.array([r.ettr for r in self.runs], dtype=float)

    @property
    def ettr_mean(self) -> float:
        return float(self.ettrs.mean())

    @property
    def ettr_stderr(self) -> float:
        n = len(self.runs)
        return float(self.ettrs.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0

    def breakdown_fractions(self) -> dict[str, float]:
        """Mean share of wall time per category over the replications."""
        return {c: float(np.mean([r.breakdown.fractions()[c] for r in self.runs])) for c in CATEGORIES}

    def report(self) -> dict[str, Any]:
        return {
            "replications": len(self.runs),
            "ettr_mean": self.ettr_mean,
            "ettr_stderr": self.ettr_stderr,
            "ettr_min": float(self.ettrs.min()),
            "ettr_max": float(self.ettrs.max()),
            "breakdown_fraction": self.breakdown_fractions(),
            "failures_mean": float(np.mean([sum(r.failures.values()) for r in self.runs])),
            "sim_seconds_total": float(sum(r.sim_seconds for r in self.runs)),
        }
