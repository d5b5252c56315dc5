"""Configuration of the reliability simulator: cluster, failure processes, checkpoint tiers, restart paths, job."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_resilience._configurable import as_enum
from lightning_resilience.checkpoint.cadence_plan import Cadence, TierCosts, plan_cadences
from lightning_resilience.checkpoint.tier import BUDGET, Durability
from lightning_resilience.sim.step_cost import SuiteCostConfig

__all__ = [
    "DURABILITIES",
    "Durability",
    "FAILURE_KINDS",
    "RESTART_PATHS",
    "ClusterConfig",
    "FailureConfig",
    "FailureKindConfig",
    "JobConfig",
    "RestartConfig",
    "SimConfig",
    "SimTierConfig",
    "default_failure_kinds",
    "default_tiers",
]

DURABILITIES: tuple[str, ...] = tuple(Durability.values())
"""Where a tier's copy lives, weakest first: process memory (survives only an in-process restart), the host (RAM
shared with a persistent agent or local disk: survives a process restart, not a node loss), a peer node (survives a
single node loss), remote storage (survives everything)."""

RESTART_PATHS: tuple[str, ...] = ("in_process", "in_job", "warm_spare", "cold")
"""Ways back to training, cheapest first."""

FAILURE_KINDS: tuple[str, ...] = ("crash", "hang", "sdc", "fail_slow")

HOUR = 3600.0
DAY = 24 * HOUR


def _positive(key: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{key} must be a finite number > 0, got {value!r}")


def _non_negative(key: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")


@dataclass(kw_only=True)
class ClusterConfig:
    """The accelerators of the job, grouped into nodes that fail as units."""

    gpus: int = 1024
    """Accelerators in the job."""
    gpus_per_node: int = 8
    """Accelerators per node; a node failure takes all of them down."""
    spare_nodes: int = 0
    """Warm standby nodes; a node loss uses one (the ``warm_spare`` path) while any is left, else a cold restart."""
    spare_refill_s: float = 4 * HOUR
    """Seconds until a used spare is replaced by a repaired or newly provisioned node."""

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"cluster.gpus must be an integer >= 1, got {self.gpus!r}")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"cluster.gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")
        if not isinstance(self.spare_nodes, int) or self.spare_nodes < 0:
            raise ValueError(f"cluster.spare_nodes must be an integer >= 0, got {self.spare_nodes!r}")
        _positive("cluster.spare_refill_s", self.spare_refill_s)

    @property
    def nodes(self) -> int:
        """Nodes in the job (a partial last node counts as a node)."""
        return -(-self.gpus // self.gpus_per_node)


@dataclass(kw_only=True)
class FailureKindConfig:
    """One kind of failure: how often it is drawn, how long until it is noticed, and what it destroys."""

    name: str
    """Label in the breakdown: ``crash``, ``hang``, ``sdc`` (silent data corruption) or ``fail_slow``."""
    fraction: float
    """Share of all failures that are of this kind (the fractions of a config sum to 1)."""
    detection_s: float = 0.0
    """Seconds from the fault to its detection. A crash or hang stalls the job meanwhile (``detection`` time); an
    SDC keeps training on corrupted state (``lost`` time); a fail-slow node trains slowly (``degraded`` time)."""
    node_lost: bool = False
    """The node is removed (hardware fault, eviction): its process memory and local disk are gone, and it must be
    replaced by a warm spare or a cold restart."""
    restart: str = "in_job"
    """Restart path when the node survives: ``in_process``, ``in_job`` or ``cold``."""
    slowdown: float = 0.0
    """fail_slow only: fractional step-time increase while the slow node is in the job (0.3 = 30% slower steps)."""

    def __post_init__(self) -> None:
        if self.name not in FAILURE_KINDS:
            raise ValueError(f"failures.kinds.name must be one of {FAILURE_KINDS}, got {self.name!r}")
        key = f"failures.{self.name}"
        if not (isinstance(self.fraction, int | float) and 0 <= self.fraction <= 1):
            raise ValueError(f"{key}.fraction must be in [0, 1], got {self.fraction!r}")
        _non_negative(f"{key}.detection_s", self.detection_s)
        if self.restart not in ("in_process", "in_job", "cold"):
            raise ValueError(f"{key}.restart must be one of in_process, in_job, cold, got {self.restart!r}")
        _non_negative(f"{key}.slowdown", self.slowdown)
        if self.slowdown and self.name != "fail_slow":
            raise ValueError(f"{key}.slowdown applies to fail_slow only, got {self.slowdown!r}")


def default_failure_kinds() -> list[FailureKindConfig]:
    """A production-like mix: mostly node-killing crashes, then hangs, fail-slow nodes and a few SDCs.

    Detection delays assume second-level monitoring (ByteRobust: faults caught in 2-30 s) for crashes, a 10 min
    collective timeout for hangs, and an hour for SDCs found by periodic checks.
    """
    return [
        FailureKindConfig(name="crash", fraction=0.6, detection_s=10.0, node_lost=True),
        FailureKindConfig(name="hang", fraction=0.2, detection_s=600.0, restart="in_job"),
        FailureKindConfig(name="fail_slow", fraction=0.15, detection_s=600.0, node_lost=True, slowdown=0.3),
        FailureKindConfig(name="sdc", fraction=0.05, detection_s=3600.0, node_lost=True),
    ]


@dataclass(kw_only=True)
class FailureConfig:
    """Failure processes: one renewal process per node, its mean scaled from a reference measurement."""

    mttf_s: float = 7.9 * HOUR
    """Job-level mean time to failure measured at ``ref_gpus`` accelerators (Kokolis et al.: 7.9 h at 1,024)."""
    ref_gpus: int = 1024
    """Job size at which ``mttf_s`` was measured; the job MTTF at N accelerators is ``mttf_s * ref_gpus / N``."""
    weibull_shape: float = 1.0
    """Shape k of each node's time-between-failures distribution: 1 = exponential (Poisson failures), < 1 = infant
    mortality, > 1 = wear-out. The mean is kept at the node MTTF whatever k."""
    kinds: list[FailureKindConfig] = field(default_factory=default_failure_kinds)
    """Failure kinds with their shares, detection delays and consequences."""

    def __post_init__(self) -> None:
        _positive("failures.mttf_s", self.mttf_s)
        if not isinstance(self.ref_gpus, int) or self.ref_gpus < 1:
            raise ValueError(f"failures.ref_gpus must be an integer >= 1, got {self.ref_gpus!r}")
        _positive("failures.weibull_shape", self.weibull_shape)
        if not self.kinds:
            raise ValueError("failures.kinds must name at least one failure kind")
        names = [k.name for k in self.kinds]
        if len(set(names)) != len(names):
            raise ValueError(f"failures.kinds must not repeat a kind, got {names}")
        total = sum(k.fraction for k in self.kinds)
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"failures.kinds fractions must sum to 1, got {total:.6g} ({names})")

    def job_mttf_s(self, gpus: int) -> float:
        """Mean time between failures of a job on ``gpus`` accelerators (failure rate proportional to size)."""
        return self.mttf_s * self.ref_gpus / gpus

    def node_mttf_s(self, gpus_per_node: int) -> float:
        """Mean time between failures of one node."""
        return self.mttf_s * self.ref_gpus / gpus_per_node

    def kind(self, name: str) -> FailureKindConfig | None:
        return next((k for k in self.kinds if k.name == name), None)


@dataclass(kw_only=True)
class SimTierConfig:
    """One checkpoint tier as the simulator sees it: its cadence, what it costs and what it survives."""

    name: str
    """Label in the report."""
    every_n_steps: int | None = None
    """Cadence in optimizer steps (set this or ``every_s``); 0: the cost budget decides (``overhead_budget``), by
    the checkpoint engine's own cadence function."""
    every_s: float | None = None
    """Cadence in seconds of training, rounded to whole steps (set this or ``every_n_steps``)."""
    blocking_s: float = 0.0
    """Seconds the training loop stops per checkpoint of this tier (snapshot, synchronous save)."""
    write_s: float = 0.0
    """Seconds from the end of the blocking part until the checkpoint is committed (background persist). A failure
    before then leaves the previous checkpoint; a write longer than the interval defers the next checkpoint."""
    restore_s: float = 0.0
    """Seconds to load the checkpoint back into the job after a restart."""
    durability: Durability = Durability.remote
    """What the copy survives: ``process``, ``host``, ``peer`` or ``remote`` (see DURABILITIES)."""
    keep: int = 2
    """Committed checkpoints retained (older ones matter when an SDC corrupts the newest)."""

    def __post_init__(self) -> None:
        key = f"tiers.{self.name}"
        if (self.every_n_steps is None) == (self.every_s is None):
            raise ValueError(f"{key}: set exactly one of every_n_steps and every_s")
        if self.every_n_steps is not None and (not isinstance(self.every_n_steps, int) or self.every_n_steps < 0):
            raise ValueError(
                f"{key}.every_n_steps must be an integer >= 1, or 0 (the budget), got {self.every_n_steps!r}"
            )
        if self.every_s is not None:
            _positive(f"{key}.every_s", self.every_s)
        _non_negative(f"{key}.blocking_s", self.blocking_s)
        _non_negative(f"{key}.write_s", self.write_s)
        _non_negative(f"{key}.restore_s", self.restore_s)
        self.durability = as_enum(Durability, self.durability, key, "durability")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"{key}.keep must be an integer >= 1, got {self.keep!r}")

    @property
    def budgeted(self) -> bool:
        """The cost budget decides this tier's cadence (:meth:`SimConfig.cadences`)."""
        return self.every_n_steps == BUDGET

    def interval_steps(self, step_s: float) -> int:
        """The cadence in whole steps (at least 1) of a tier whose cadence is set."""
        if self.budgeted:
            raise ValueError(f"tiers.{self.name}: the budget decides its cadence: see SimConfig.cadences()")
        if self.every_n_steps is not None:
            return self.every_n_steps
        assert self.every_s is not None
        return max(1, round(self.every_s / step_s))


def default_tiers() -> list[SimTierConfig]:
    """Peer-replicated host RAM every 5 minutes of training, remote storage every hour (asynchronous writes)."""
    return [
        SimTierConfig(
            name="peer", every_s=300.0, blocking_s=0.5, write_s=10.0, restore_s=10.0, durability=Durability.peer
        ),
        SimTierConfig(name="remote", every_s=3600.0, blocking_s=2.0, write_s=300.0, restore_s=94.0),
    ]


@dataclass(kw_only=True)
class RestartConfig:
    """Seconds each restart path takes from detection until training can load its state (restore excluded)."""

    in_process: float = 10.0
    """Restart inside the surviving processes (NVRx in-process restart): no spawn, no imports."""
    in_job: float = 60.0
    """Workers respawned by the launcher on the same nodes (torchrun --max-restarts; ByteRobust hot update 46-65 s)."""
    warm_spare: float = 30.0
    """A failed node swapped for a pre-warmed standby (TrainMover: < 30 s after a failure at 1,024 GPUs)."""
    cold: float = 294.0
    """The whole job requeued and rebuilt (TrainMover: 6.47 min at 8,192 GPUs, of which ~94 s is checkpoint load,
    billed to the restore tier instead)."""

    def __post_init__(self) -> None:
        for name in RESTART_PATHS:
            _non_negative(f"restart.{name}", getattr(self, name))

    def seconds(self, path: str) -> float:
        return float(getattr(self, path))


@dataclass(kw_only=True)
class JobConfig:
    """The training job: step time, how long it runs, and the randomness."""

    step_s: float = 2.0
    """Seconds per optimizer step without checkpointing."""
    horizon_s: float = 90 * DAY
    """Wall-clock seconds simulated."""
    target_steps: int | None = None
    """Stop earlier, once this many steps are done (a job of fixed length)."""
    seed: int = 0
    """Seed of the failure draws (replication r uses seed + r)."""

    def __post_init__(self) -> None:
        _positive("job.step_s", self.step_s)
        _positive("job.horizon_s", self.horizon_s)
        if self.target_steps is not None and (not isinstance(self.target_steps, int) or self.target_steps < 1):
            raise ValueError(f"job.target_steps must be an integer >= 1, got {self.target_steps!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"job.seed must be an integer, got {self.seed!r}")


@dataclass(kw_only=True)
class SimConfig:
    """Everything one simulation needs."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The accelerators and nodes."""
    failures: FailureConfig = field(default_factory=FailureConfig)
    """Failure processes and kinds."""
    tiers: list[SimTierConfig] = field(default_factory=default_tiers)
    """Checkpoint tiers (may be empty: every failure restarts from step 0)."""
    restart: RestartConfig = field(default_factory=RestartConfig)
    """Restart path costs."""
    job: JobConfig = field(default_factory=JobConfig)
    """Step time, horizon and seed."""
    overhead_budget: float = 0.02
    """Blocking per step the budgeted tiers (``every_n_steps=0``) may cost, a fraction of the step time."""
    suite: SuiteCostConfig = field(default_factory=SuiteCostConfig)
    """What the resilience suite's step path adds to every step (fixed, plus a round that outlasts the step)."""

    def __post_init__(self) -> None:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers must have distinct names, got {names}")
        if not (isinstance(self.overhead_budget, int | float) and 0 < self.overhead_budget < 1):
            raise ValueError(f"overhead_budget must be in (0, 1), got {self.overhead_budget!r}")

    def cadences(self) -> list[Cadence]:
        """Every tier's cadence in steps, in order: as set, or chosen as the checkpoint engine chooses it
        (:func:`~lightning_resilience.checkpoint.cadence_plan.plan_cadences`) from the tier's blocking and write costs,
        the step time and the job's MTTF at this scale."""
        step_s = self.job.step_s
        costs = [
            TierCosts(
                t.name,
                t.durability is not Durability.process,
                t.blocking_s,
                t.write_s,
                BUDGET if t.budgeted else t.interval_steps(step_s),
            )
            for t in self.tiers
        ]
        mtbf_s = self.failures.job_mttf_s(self.cluster.gpus)
        return plan_cadences(costs, step_s=step_s, budget=self.overhead_budget, mtbf_s=mtbf_s)
