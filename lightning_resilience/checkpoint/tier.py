"""The storage tier protocols: every place a checkpoint can live implements :class:`Tier`; a tier that holds the
snapshot buffers themselves implements :class:`RamTier`, one that exchanges with peers :class:`CollectiveTier`.

The manager never asks a tier what it is (no ``isinstance``, no ``getattr``): what it needs to know is in the
protocol. ``durability`` says what a copy survives, ``ram`` that the tier holds the snapshot buffers themselves (a
:class:`RamTier`: first in the restore order, whether its buffers live in process memory or outlive the process in
shared memory), ``collective`` says that every rank must call :meth:`Tier.write` together (a
:class:`CollectiveTier`), ``write`` returns what it committed, and :meth:`Tier.reshard_root` and :meth:`Tier.reject`
have an answer on every tier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from lightning_resilience._configurable import ConfigError, StrEnum
from lightning_resilience.checkpoint.snapshot import HostBuffers, HostSnapshot, StagedSnapshot
from lightning_resilience.collective import Deadline

__all__ = [
    "BUDGET",
    "CollectiveTier",
    "Durability",
    "RamTier",
    "Tier",
    "TierIdentity",
    "Written",
    "check_cadence",
    "restore_order",
]


BUDGET = 0
"""A tier's ``every_n_steps`` left to the cost budget (``checkpoint.overhead_budget``): the engine chooses the cadence
from what checkpointing costs on this run (:mod:`~lightning_resilience.checkpoint.cadence`)."""


class Durability(StrEnum):
    """What a copy survives, weakest first (the reliability simulator uses the same words)."""

    process = "process"
    """Process memory: a restore within the process (rollback, retry) only."""
    host = "host"
    """The node (local disk, shared memory outliving the workers): a process restart, not the loss of the node."""
    peer = "peer"
    """Copies on other nodes too: the loss of a node."""
    remote = "remote"
    """Off-node storage: everything short of losing the store."""

    @property
    def level(self) -> int:
        return list(Durability).index(self)


class TierIdentity:
    """Where this process sits in the job; a tier stores and lists the shard of its own rank only."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
        self.rank = rank
        self.world_size = world_size


@dataclass(frozen=True)
class Written:
    """What one :meth:`Tier.write` committed."""

    step: int
    nbytes: int
    """Bytes the tier now holds for this shard (a delta tier holds fewer than the snapshot's)."""
    base: int | None = None
    """The full step a delta shard was made against; None for a full shard."""


@runtime_checkable
class Tier(Protocol):
    """A place that holds committed checkpoints of this rank.

    Attributes:
        name: short unique label used in logs, metrics and the report (``memory``, ``local``, ``s3``...).
        every_n_steps: how often a snapshot is sent to this tier; :data:`BUDGET` (0): as often as the cost budget
            allows (the manager's cadence controller decides).
        keep: how many committed steps this tier retains.
        durability: what a copy survives.
        ram: True for a :class:`RamTier` (it adopts the snapshot buffers instead of being written a copy).
        collective: True when :meth:`write` exchanges with peers: every rank must call it for the same step,
            whatever happened before (a failed local commit is carried into the exchange, never skips it).
    """

    name: str
    every_n_steps: int
    keep: int
    durability: Durability
    ram: bool
    collective: bool

    def bind(self, identity: TierIdentity) -> None:
        """Called once before use with this process's rank and the world size (collective for a collective
        tier: every rank calls it, in the same order)."""

    def write(self, snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        """Commit ``snap`` atomically: after a crash at any instant the step is either fully there or absent.

        ``deadline`` bounds the write (an emergency save passes what is left of its budget): a tier that cannot
        finish in time raises :class:`TimeoutError` (an ``OSError``) and commits nothing.
        """

    def read(self, step: int) -> StagedSnapshot:
        """Return the validated snapshot of ``step``; the caller owns its tensors.

        Raises:
            CheckpointCorruptError: the step is missing, partial or fails validation.
        """

    def list_steps(self) -> list[int]:
        """Committed steps of this rank, oldest first. Cheap and local: it never waits on a network (a remote
        tier answers from what it knows; validation happens in :meth:`read`)."""

    def delete(self, step: int) -> None:
        """Remove a committed step; a reader never sees it half-deleted."""

    def reject(self, step: int, reason: str) -> None:
        """Take committed ``step`` out for good: a verdict found the state it holds corrupt
        (:mod:`~lightning_resilience.checkpoint.certify`). It is never listed or read again; a tier that outlives the
        process leaves a record of the rejection (``reason``) in the step's directory, where ``ckpt ls`` finds it."""

    def reshard_root(self) -> Path | None:
        """The directory whose steps every rank can read whole, for restoring a step written by another world
        size; None for a tier that cannot serve one."""


@runtime_checkable
class RamTier(Tier, Protocol):
    """A tier that holds the snapshot buffers themselves (``ram`` is True): no copy to keep a step, none to restore
    it. Its durability is ``process``, or ``host`` when the buffers outlive the process (shared memory)."""

    def buffers(self, slots: int) -> HostBuffers:
        """Where the snapshot pool's ``slots`` buffers are allocated (process or shared memory)."""

    def adopt(self, slot: HostSnapshot, release: Callable[[HostSnapshot], None]) -> Written:
        """Hold a pool slot (already retained for this tier); ``release`` gives it back when evicted."""

    def holds(self, step: int) -> bool:
        """True when ``step`` can be taken (cheap; consumes nothing)."""

    def take(self, step: int) -> StagedSnapshot:
        """Hand ``step``'s buffers over to the caller for good; only after every rank agreed on the step."""

    def close(self, *, keep: bool) -> None:
        """The engine is done with the tier; ``keep`` False (the job finished) also removes what would outlive
        the process."""


@runtime_checkable
class CollectiveTier(Tier, Protocol):
    """A tier whose writes exchange with peers (``collective`` is True). Its :meth:`Tier.bind` creates its side
    group (every rank, same order); its :meth:`Tier.write` is entered by every rank for the same step; before a
    restore every rank calls :meth:`prepare_restore`."""

    def prepare_restore(self, deadline: Deadline | None = None) -> list[int]:
        """Collective: make this rank's copies loadable, e.g. fetch the shards that peers hold for it. Returns the
        steps it made available."""

    def write_local(self, snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        """Commit this rank's own copy only, exchanging nothing: a rank-local save, when peers may be gone."""


def restore_order(tiers: list[Tier]) -> list[Tier]:
    """Fastest first: RAM tiers (process or shared memory), then node-local tiers in the order given (local disk...),
    then off-node stores. Restores try tiers in this order; persists and emergency saves write in it."""

    def rank(tier: Tier) -> int:
        if tier.ram:
            return 0
        return 2 if tier.durability is Durability.remote else 1

    return sorted(tiers, key=rank)


def check_cadence(owner: str, every_n_steps: int, keep: int) -> None:
    """A tier's cadence and retention, checked by its config (``owner`` is ``tiers.<name>``)."""
    if every_n_steps < 0:
        raise ConfigError(
            owner, "every_n_steps", f"must be >= 1, or {BUDGET} (the cost budget decides), got {every_n_steps}"
        )
    if keep < 1:
        raise ConfigError(owner, "keep", f"must be >= 1, got {keep}")
