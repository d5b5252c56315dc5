"""What SDC verification did on this rank and what it cost."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SDCStats"]


@dataclass
class SDCStats:
    """What verification did and what it cost (seconds are wall time on this rank)."""

    steps: int = 0
    guard_seconds: float = 0.0
    guard_fired: dict[str, int] = field(default_factory=dict)
    guard_forced_reads: int = 0
    """Guard readings the host had to wait for (the device ran too far behind); 0 on a CPU."""
    replay_rounds: int = 0
    replays: int = 0
    replay_seconds: float = 0.0
    fingerprint_seconds: float = 0.0
    """Spent in the DDP communication hook digesting buckets."""
    reconcile_rounds: int = 0
    reconcile_seconds: float = 0.0
    detections: dict[str, int] = field(default_factory=dict)
    recomputed: int = 0
    rollbacks: int = 0

    def ordinary_seconds(self) -> float:
        """The training thread's seconds so far in the work of every step (the guards); replay and reconciliation
        rounds run at the cadence the config sets, as a tier with a cadence of its own does."""
        return self.guard_seconds
