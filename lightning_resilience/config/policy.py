"""Configuration of the resilience policy: which action each kind of verdict leads to."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ACTIONS", "ALLOWED", "PolicyConfig"]

ACTIONS = ("log", "alert", "checkpoint_and_stop", "rollback", "emergency_save_and_exit", "dump_and_exit")
"""Every action, least to most severe: when several verdicts arrive together, the most severe one is taken."""

ALLOWED = {
    "sdc_mismatch": ("log", "alert", "checkpoint_and_stop", "rollback"),
    "straggler": ("log", "alert", "checkpoint_and_stop"),
    "preemption": ("log", "emergency_save_and_exit"),
    "hang": ("log", "dump_and_exit"),
}
"""The actions that make sense for each event (a hang cannot be rolled back: the stuck rank cannot take part)."""


@dataclass(kw_only=True)
class PolicyConfig:
    """What the job does when a detector reports something; every rank takes the same action at the same step."""

    sdc_mismatch: str = "rollback"
    """A confirmed silent-data-corruption mismatch caught after the optimizer step: 'rollback' (stop, and restart
    from the newest checkpoint verified clean), 'checkpoint_and_stop', 'alert' or 'log'. Caught before the
    optimizer step it is recomputed in place whatever this says."""
    straggler: str = "checkpoint_and_stop"
    """A confirmed straggler at the top of the detector's ladder: 'checkpoint_and_stop' (the launcher restarts
    without the slow node), 'alert' or 'log'."""
    preemption: str = "emergency_save_and_exit"
    """A preemption signal: 'emergency_save_and_exit' (save the newest snapshot, exit with the requeue code) or
    'log' (ignore it and let the scheduler kill the job)."""
    hang: str = "dump_and_exit"
    """A hung rank: 'dump_and_exit' (stack dumps, exit code, the launcher restarts the group) or 'log' (dump only)."""

    def __post_init__(self) -> None:
        for event, allowed in ALLOWED.items():
            value = getattr(self, event)
            if value not in allowed:
                raise ValueError(f"policy.{event} must be one of {list(allowed)}, got {value!r}")

    def action_for(self, event: str) -> str:
        if event not in ALLOWED:
            raise ValueError(f"unknown resilience event {event!r}; known: {list(ALLOWED)}")
        return str(getattr(self, event))

    def mapping(self) -> dict[str, str]:
        return {event: self.action_for(event) for event in ALLOWED}
