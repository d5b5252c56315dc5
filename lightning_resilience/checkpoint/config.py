"""Configuration of the checkpoint engine (:class:`~lightning_resilience.checkpoint.manager.CheckpointManager`),
independent of the tiers it drives; each tier owns its own ``Config`` (``LocalTier.Config``...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from lightning_resilience._configurable import ConfigError, StrEnum, as_enum, check_finite

__all__ = ["ON_PERSIST_ERROR", "CheckpointConfig", "IfNoneValid"]

_RESUME_WORDS = ("auto", "never", "verified")


class IfNoneValid(StrEnum):
    """What a restore does when checkpoints exist but none is valid on every rank."""

    start_fresh = "start_fresh"
    fail = "fail"


ON_PERSIST_ERROR = ("warn", "raise")
"""What a failed background write to a tier does: log and count it, or stop training (a plain string: ``raise``
cannot name an enum member, and OmegaConf looks a YAML string up by member name)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Behaviour of the checkpoint engine, independent of which tiers it drives."""

    resume: str = "auto"
    """'auto' (newest step every rank can load), 'verified' (the newest such step whose verification state is
    'verified': a clean SDC check covered it), 'never', or a step number to resume from."""
    if_none_valid: IfNoneValid = IfNoneValid.start_fresh
    """What to do when checkpoints exist but none is valid on every rank."""
    on_persist_error: str = "warn"
    """A tier write that fails with an I/O error: log and count it and keep training, or stop."""
    max_host_copies: int = 0
    """Upper bound on host snapshot buffers; 0 picks RAM keep + 2 (enough that capture never waits)."""
    persist_on_train_end: bool = True
    """When training ends, persist the final step to every persistent tier (whatever the cadences) and wait."""
    overlap_copy: bool = True
    """Copy parameters and optimizer state into the snapshot in the background (a CPU thread, or a CUDA side stream)
    while the next forward and backward run; the next optimizer step waits for it (on a GPU the training stream
    waits, not the CPU). Turn off if something other than the optimizer changes
    parameters between steps (an in-place weight edit in a callback)."""
    allow_reshard: bool = True
    """When no step is loadable at this world size, restore the newest step written by a job of another world size
    (a directory tier every rank can read), resharded: exact for model and optimizer, not for per-rank RNG and
    data position (see docs/resharding.md)."""
    save_on_exception: bool = True
    """When training raises, persist the newest RAM snapshot (the last state captured at a step boundary, not the
    possibly broken live state) to the persistent tiers before the exception propagates. Rank-local: no collective
    runs, since other ranks may be stuck or gone."""
    emergency_timeout_s: float = 120.0
    """Time allowed to an emergency save (exception, preemption notice); slower tiers are skipped once it runs out."""
    drain_timeout_s: float = 600.0
    """Longest wait for the in-flight persist at teardown."""
    snapshot_timeout_s: float = 60.0
    """Longest wait for a free host buffer (only reached with max_host_copies set too low)."""
    overhead_budget: float = 0.02
    """What the suite may cost the training step, as a fraction of the step time: a tier whose ``every_n_steps``
    is 0 gets the cadence this allows, chosen from the costs measured on this run (RAM: every step when it fits, else
    every k steps, a snapshot costing its blocking and what it slows the step after it by; persistent tiers: Daly's
    interval from their cost and the MTBF), after the detectors' measured work on every step (straggler step ends,
    SDC guards) is taken from it. A tier with a cadence of its own keeps it."""
    mtbf_prior_s: float = 8 * 3600.0
    """The job's mean time between failures assumed until the run's own history (the fault-tolerance ledger) says
    more; it counts as one failure in this much training."""
    cadence_review_steps: int = 100
    """Steps between two choices of the budgeted cadences (one small all-reduce each)."""
    collective_timeout_s: float = 300.0
    """Longest wait for the other ranks at one agreement (persist or defer, which steps to keep, which step to
    restore); a rank that does not come in time is a CollectiveError on every rank, not a hang."""
    content_check: bool = True
    """Take a content print of each step captured for a persistent tier (one sum per tensor, where it lives, read
    late) and check it when a tier commits the step and when it is restored: a commit or a restore of tensors that
    are not that step's (stale staging buffers, another step's tensors) is refused and named."""
    verified_only: list[str] = field(default_factory=list)
    """Tiers (by name) that get only steps whose verification state is 'verified' when they are captured: a durable
    tier that must never publish a step inside an unverified window. Put its cadence on the steps SDC checks
    (a multiple of ``sdc.reconcile_every_n_steps``)."""

    def __post_init__(self) -> None:
        self.resume = str(self.resume)
        if self.resume not in _RESUME_WORDS and not self.resume.isdigit():
            raise ConfigError(
                "checkpoint", "resume", f"must be 'auto', 'verified', 'never' or a step number, got {self.resume!r}"
            )
        self.if_none_valid = as_enum(IfNoneValid, self.if_none_valid, "checkpoint", "if_none_valid")
        if self.on_persist_error not in ON_PERSIST_ERROR:
            choices = list(ON_PERSIST_ERROR)
            raise ConfigError(
                "checkpoint", "on_persist_error", f"must be one of {choices}, got {self.on_persist_error!r}"
            )
        if self.max_host_copies != 0 and self.max_host_copies < 2:
            raise ConfigError("checkpoint", "max_host_copies", f"must be 0 (auto) or >= 2, got {self.max_host_copies}")
        if not (isinstance(self.overhead_budget, int | float) and 0 < self.overhead_budget < 1):
            raise ConfigError("checkpoint", "overhead_budget", f"must be in (0, 1), got {self.overhead_budget!r}")
        check_finite("checkpoint", "mtbf_prior_s", self.mtbf_prior_s)
        if self.cadence_review_steps < 1:
            raise ConfigError("checkpoint", "cadence_review_steps", f"must be >= 1, got {self.cadence_review_steps}")
        if len(set(self.verified_only)) != len(self.verified_only) or not all(self.verified_only):
            raise ConfigError("checkpoint", "verified_only", f"must name tiers once each, got {self.verified_only}")
        for key in ("drain_timeout_s", "snapshot_timeout_s", "emergency_timeout_s", "collective_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError("checkpoint", key, f"must be > 0, got {getattr(self, key)}")

    @property
    def verified_resume(self) -> bool:
        """Resume only from a step verified clean (``resume: verified``)."""
        return self.resume == "verified"

    @property
    def resume_step(self) -> int | None:
        return int(self.resume) if self.resume.isdigit() else None

    @property
    def drain_timeout(self) -> timedelta:
        return timedelta(seconds=self.drain_timeout_s)

    @property
    def snapshot_timeout(self) -> timedelta:
        return timedelta(seconds=self.snapshot_timeout_s)

    @property
    def emergency_timeout(self) -> timedelta:
        return timedelta(seconds=self.emergency_timeout_s)

    @property
    def collective_timeout(self) -> timedelta:
        return timedelta(seconds=self.collective_timeout_s)
