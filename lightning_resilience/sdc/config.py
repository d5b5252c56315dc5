"""Configuration of silent data corruption (SDC) verification: guards, dual-run replay, cross-replica checks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

from lightning_resilience._configurable import ConfigError, StrEnum, as_enum

__all__ = ["Compare", "ReplayScope", "SDCConfig"]


class ReplayScope(StrEnum):
    """Which batches a scheduled replay round checks."""

    all = "all"
    rotate = "rotate"
    devices = "devices"


class Compare(StrEnum):
    """How a replay is compared with the original step."""

    bitwise = "bitwise"
    tolerance = "tolerance"


@dataclass(kw_only=True)
class SDCConfig:
    """What SDC verification checks, how often, and what it does about a confirmed corruption."""

    guards: bool = True
    """Check every step for NaN/Inf and robust spikes in the loss and the gradient norm (one fused norm on the
    device; see ``guard_read_lag`` for when the values reach the host)."""
    guard_read_lag: int = 1
    """Steps between a guard's values and their check. 1: copied to the host without blocking and checked at the
    next step, so the step path never waits for the device; a guard that fires then asks for a replay round of the
    next step and a non-finite loss or gradient, whose update is applied by then, asks for a rollback. 0: checked
    before the optimizer step (one host read per step on a GPU), so a guard-triggered replay can recompute a corrupt
    gradient in place."""
    guard_window: int = 64
    """Recent values kept per guard for the robust baseline (median / MAD)."""
    guard_min_history: int = 8
    """Values needed before spike guards may fire (NaN/Inf guards fire from the first step)."""
    guard_threshold: float = 8.0
    """Robust z-score (|x - median| / (1.4826 * MAD)) above which a value is a spike."""
    guard_quiet_steps: int = 50
    """Steps after a replay found a guard's spike genuine during which the same guard's spikes ask for no replay
    (a training instability spikes for many steps in a row, and the replay just showed the devices reproduce); they
    are still counted and still reach the policy as spikes, and a non-finite value always acts. Likewise after a
    clean reconciliation that a parameter-norm jump asked for: the next jumps ask for none (the scheduled
    reconciliations go on). 0: every spike asks for a replay and every jump for a reconciliation."""
    guard_grad_norm_stride: int = 4
    """Under DDP every rank holds the same gradients after the all-reduce, so one rank's gradient norm speaks for the
    job (the step's agreement carries what it finds to every rank): the norm of step ``s`` is computed by the ranks
    ``r`` with ``r % k == s % k``, ``k = min(world_size, guard_grad_norm_stride)``. Every step is still checked, by a
    ``1/k`` share of the ranks, and each rank's baseline still sees every ``k``-th step. 1: every rank, every step.
    Gradients that are not replicated (no DDP wrapper) are checked on every rank. Gradients corrupted on one rank
    after the all-reduce make the replicas differ, which the reconciliation finds."""
    param_norm_every_n_steps: int = 10
    """Steps between two parameter-norm checks (a jump against the baseline of norm changes fires the guard);
    0 disables the check."""
    replay_every_n_steps: int = 200
    """Steps between two dual-run replays (a guard that fires triggers one at once); 0: only when a guard fires."""
    replay_scope: ReplayScope = ReplayScope.all
    """Which batches a scheduled replay round checks: 'all' (every rank's, each by its own rank and with
    ``partner_replay`` its neighbour); 'devices' (with ``partner_replay``: every other rank's batch, by its rank and
    its neighbour, from an offset that moves by one each round, so that every device replays once a round, one of
    them twice when the number of ranks is odd; without it, as 'all'): a round costs one forward and backward at 2
    ranks and at 10,000, and meets a device that corrupts every step at every round; or 'rotate' (one rank's batch
    per round, by turns: replayed by that rank and by its neighbour, with more opinions only when they disagree),
    the same wall time a round with the other ranks idle, which meets such a device once in ``world_size - 1``
    rounds. A round a restore asks for checks every batch; one a guard asks for checks every device (as 'devices'),
    or only the batches of the ranks whose own losses spiked (see docs/sdc.md)."""
    replay_after_restore: bool = True
    """Replay the first step after every restore (an in-process rollback, a resume), with partner, as torchtitan's
    SDC replay does: a device that corrupts every step is named at once (a non-finite value it caused only rolls
    back), and a restored state that does not reproduce is found before training builds on it."""
    partner_replay: bool = True
    """With more than one rank, each replay also recomputes a neighbour rank's batch (catches a faulty device)."""
    max_opinions: int = 5
    """Upper bound on the replays spent on one batch before it is declared unresolved."""
    compare: Compare = Compare.bitwise
    """'bitwise' (deterministic algorithms on) or 'tolerance' (sums and norms within rtol/atol, for
    non-deterministic kernels; misses flips below the tolerance)."""
    rtol: float = 1e-5
    """Relative tolerance of the 'tolerance' comparison."""
    atol: float = 1e-8
    """Absolute tolerance of the 'tolerance' comparison."""
    ddp_fingerprint: bool = True
    """Under DDP, digest each gradient bucket before its all-reduce (a communication hook) so that a replay can be
    compared with the local gradients this rank actually contributed."""
    reconcile_every_n_steps: int = 50
    """Steps between two cross-replica comparisons of parameter and optimizer-state digests; 0 disables them."""
    stop_on_suspect: bool = False
    """A fault that a replay cannot fix (persistent device, unresolved vote) stops the job at least with a
    rollback (exit code ExitCode.SDC, the verdict file names the suspects), even where the policy's
    ``sdc_mismatch`` would only alert or log."""
    run_dir: str | None = None
    """Directory of the verdict file (sdc_verdict.json) a launcher reads; None: no file."""
    rollback_tiers: list[str] | None = None
    """Checkpoint tiers whose steps may be rollback targets (None: all; name persistent tiers when the rollback
    goes through a process restart)."""
    timeout_s: float = 300.0
    """Bound on each agreement between ranks (all-gathers on the side gloo group), in seconds."""

    def __post_init__(self) -> None:
        if self.guard_window < 4:
            raise ConfigError("sdc", "guard_window", f"must be >= 4, got {self.guard_window}")
        if not 2 <= self.guard_min_history <= self.guard_window:
            raise ConfigError(
                "sdc",
                "guard_min_history",
                f"must be in [2, sdc.guard_window={self.guard_window}], got {self.guard_min_history}",
            )
        if not (math.isfinite(self.guard_threshold) and self.guard_threshold > 0):
            raise ConfigError("sdc", "guard_threshold", f"must be a finite number > 0, got {self.guard_threshold}")
        if self.guard_grad_norm_stride < 1:
            raise ConfigError("sdc", "guard_grad_norm_stride", f"must be >= 1, got {self.guard_grad_norm_stride}")
        for key in (
            "guard_read_lag",
            "guard_quiet_steps",
            "param_norm_every_n_steps",
            "replay_every_n_steps",
            "reconcile_every_n_steps",
        ):
            if getattr(self, key) < 0:
                raise ConfigError("sdc", key, f"must be >= 0, got {getattr(self, key)}")
        if self.max_opinions < 3:
            raise ConfigError("sdc", "max_opinions", f"must be >= 3 (a vote needs three), got {self.max_opinions}")
        self.compare = as_enum(Compare, self.compare, "sdc", "compare")
        self.replay_scope = as_enum(ReplayScope, self.replay_scope, "sdc", "replay_scope")
        for key in ("rtol", "atol"):
            if not getattr(self, key) >= 0:
                raise ConfigError("sdc", key, f"must be >= 0, got {getattr(self, key)}")
        if not self.timeout_s > 0:
            raise ConfigError("sdc", "timeout_s", f"must be > 0, got {self.timeout_s}")

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)
