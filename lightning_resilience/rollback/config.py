"""Configuration of in-process rollback: how far back, skipping the offending batch, the cool-down, the cap."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_resilience._configurable import ConfigError

__all__ = ["RollbackConfig"]


@dataclass(kw_only=True)
class RollbackConfig:
    """In-process rollback (the policy action ``rollback_in_process``): restore the newest RAM snapshot that precedes
    the bad step in the running process, skip the offending batch, and go on; no restart, no read from disk."""

    steps_back: int = 0
    """Extra steps to go back before the bad step (0: restore the state the bad step started from). The RAM tier must
    keep that many more snapshots (``MemoryTier keep >= steps_back + 2`` with a guard read lag of 1)."""
    skip_batch: bool = True
    """Skip (quarantine) the batch of the bad step on every rank: its sample indices go to the quarantine file and the
    loaders never yield them again in that epoch. False: train on it again (a transient fault)."""
    lr_cooldown_steps: int = 0
    """Steps after a rollback whose learning rates are scaled by ``lr_cooldown_factor`` (0: none)."""
    lr_cooldown_factor: float = 0.1
    """Multiplier of every learning rate during the cool-down, in (0, 1]."""
    max_rollbacks: int = 3
    """Rollbacks allowed within ``window_steps`` steps; one more escalates: the last good state is restored, persisted
    to the persistent tiers and the job stops (exit code ``DIVERGED``, or ``SDC`` for an SDC mismatch)."""
    window_steps: int = 1000
    """The window of the cap, in training steps (counted at the bad steps)."""
    quarantine_file: str = "quarantine.jsonl"
    """File in the run directory (SDC's ``run_dir``, else ``<default_root_dir>/resilience``) that lists each rollback
    and the sample indices it skipped, one JSON object per line."""

    def __post_init__(self) -> None:
        for key in ("steps_back", "lr_cooldown_steps"):
            if getattr(self, key) < 0:
                raise ConfigError("policy.rollback", key, f"must be >= 0, got {getattr(self, key)}")
        if not (math.isfinite(self.lr_cooldown_factor) and 0 < self.lr_cooldown_factor <= 1):
            raise ConfigError(
                "policy.rollback", "lr_cooldown_factor", f"must be in (0, 1], got {self.lr_cooldown_factor}"
            )
        if self.max_rollbacks < 0:
            raise ConfigError("policy.rollback", "max_rollbacks", f"must be >= 0, got {self.max_rollbacks}")
        if self.window_steps < 1:
            raise ConfigError("policy.rollback", "window_steps", f"must be >= 1, got {self.window_steps}")
        if not self.quarantine_file or "/" in self.quarantine_file or self.quarantine_file in (".", ".."):
            raise ConfigError(
                "policy.rollback", "quarantine_file", f"must be a plain file name, got {self.quarantine_file!r}"
            )
