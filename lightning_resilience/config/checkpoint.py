"""Configuration of the tiered checkpoint engine and its tiers."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from lightning_resilience.checkpoint.delta_tier import DeltaLocalTier
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.remote import RemoteTier
from lightning_resilience.checkpoint.replication import PeerTier

__all__ = [
    "CheckpointConfig",
    "DeltaLocalTierConfig",
    "LocalTierConfig",
    "MemoryTierConfig",
    "PeerTierConfig",
    "RemoteTierConfig",
]

_RESUME_WORDS = ("auto", "never")


@dataclass(kw_only=True)
class MemoryTierConfig:
    """Host-RAM tier."""

    every_n_steps: int = 1
    """Snapshot cadence in optimizer steps."""
    keep: int = 2
    """Snapshots held in RAM (each costs one training state of host memory)."""
    name: str = "memory"
    """Label in logs, metrics and the report."""

    def __post_init__(self) -> None:
        self.build()  # the tier validates its own arguments; fail at construction, naming the key

    def build(self) -> MemoryTier:
        return MemoryTier(every_n_steps=self.every_n_steps, keep=self.keep, name=self.name)


@dataclass(kw_only=True)
class LocalTierConfig:
    """Node-local disk tier."""

    path: str
    """Directory on node-local storage, e.g. /nvme/ckpt/run-17."""
    every_n_steps: int = 20
    """Persist cadence in optimizer steps."""
    keep: int = 3
    """Committed steps retained."""
    name: str = "local"
    """Label in logs, metrics and the report."""
    verify_checksums: bool = True
    """Recompute checksums on read before trusting a shard."""

    def __post_init__(self) -> None:
        self.build()

    def build(self) -> LocalTier:
        return LocalTier(
            self.path,
            every_n_steps=self.every_n_steps,
            keep=self.keep,
            name=self.name,
            verify_checksums=self.verify_checksums,
        )


@dataclass(kw_only=True)
class PeerTierConfig:
    """Node-local RAM (tmpfs) copies, replicated to peer ranks on other nodes: survives the loss of a node."""

    path: str | None = None
    """Node-local tmpfs directory ('{node}' becomes the node index); default /dev/shm/lightning_resilience/<run id>."""
    every_n_steps: int = 1
    """Replication cadence in optimizer steps (each sends one shard per replica over the network)."""
    keep: int = 2
    """Committed steps retained (own shards and the replicas held for peers)."""
    replicas: int = 1
    """Peer copies of each rank's shard, each on a different other node (capped at nodes - 1)."""
    placement: str = "ring"
    """'ring' (the next nodes) or 'spread' (nodes evenly spaced around the job: a copy survives a rack's loss)."""
    ranks_per_node: int | None = None
    """Ranks per node (failure domain); default LOCAL_WORLD_SIZE as set by torchrun."""
    timeout_s: float = 300.0
    """Bound on one shard transfer between two peers."""
    name: str = "peer"
    """Label in logs, metrics and the report."""
    verify_checksums: bool = True
    """Recompute checksums on read before trusting a shard."""

    def __post_init__(self) -> None:
        self.build()

    def build(self) -> PeerTier:
        return PeerTier(
            self.path,
            every_n_steps=self.every_n_steps,
            keep=self.keep,
            name=self.name,
            replicas=self.replicas,
            ranks_per_node=self.ranks_per_node,
            timeout_s=self.timeout_s,
            verify_checksums=self.verify_checksums,
            placement=self.placement,
        )


@dataclass(kw_only=True)
class DeltaLocalTierConfig(LocalTierConfig):
    """Node-local disk tier storing most steps as XOR+zstd deltas against its newest full step."""

    full_every: int = 10
    """A full shard every this many writes; deltas against it in between (1: always full)."""
    level: int = 3
    """zstd level of delta shards (1-22), single-threaded."""
    lossy_bits: int = 0
    """0 = lossless. k > 0 drops the lowest k mantissa bits of float32 deltas (relative error < 2**(k-23)) and
    breaks bitwise resume."""
    cache_base: bool = True
    """Hold the current base in host RAM (one training state) instead of re-reading it for every delta."""

    def build(self) -> DeltaLocalTier:
        return DeltaLocalTier(
            self.path,
            every_n_steps=self.every_n_steps,
            keep=self.keep,
            name=self.name,
            verify_checksums=self.verify_checksums,
            full_every=self.full_every,
            level=self.level,
            lossy_bits=self.lossy_bits,
            cache_base=self.cache_base,
        )


@dataclass(kw_only=True)
class RemoteTierConfig:
    """Off-node tier on an fsspec URL (S3, GCS, Azure, shared file system)."""

    url: str
    """fsspec URL of the bucket prefix or directory, e.g. s3://bucket/run-17."""
    every_n_steps: int = 500
    """Persist cadence in optimizer steps."""
    keep: int = 3
    """Committed steps retained."""
    name: str = "remote"
    """Label in logs, metrics and the report."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to the fsspec filesystem (key, secret, client_kwargs.endpoint_url, config_kwargs, ...)."""
    retries: int = 5
    """Extra attempts per request after a transient fault."""
    backoff_s: float = 0.5
    """Wait before the first retry; doubles per retry, with jitter."""
    max_backoff_s: float = 10.0
    """Cap on one wait between retries."""
    timeout_s: float = 60.0
    """Longest wait for one request on asynchronous backends; transfers get 1 s more per MiB."""

    def __post_init__(self) -> None:
        self.build()

    def build(self) -> RemoteTier:
        return RemoteTier(
            self.url,
            every_n_steps=self.every_n_steps,
            keep=self.keep,
            name=self.name,
            storage_options=dict(self.storage_options),
            retries=self.retries,
            backoff_s=self.backoff_s,
            max_backoff_s=self.max_backoff_s,
            timeout_s=self.timeout_s,
        )


@dataclass(kw_only=True)
class CheckpointConfig:
    """Behaviour of the checkpoint engine, independent of which tiers it drives."""

    resume: str = "auto"
    """'auto' (newest step every rank can load), 'never', or a step number to resume from."""
    if_none_valid: Literal["start_fresh", "fail"] = "start_fresh"
    """What to do when checkpoints exist but none is valid on every rank."""
    on_persist_error: Literal["warn", "raise"] = "warn"
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

    def __post_init__(self) -> None:
        if self.resume not in _RESUME_WORDS and not (self.resume.isdigit()):
            raise ValueError(f"checkpoint.resume must be 'auto', 'never' or a step number, got {self.resume!r}")
        if self.if_none_valid not in ("start_fresh", "fail"):
            raise ValueError(f"checkpoint.if_none_valid must be 'start_fresh' or 'fail', got {self.if_none_valid!r}")
        if self.on_persist_error not in ("warn", "raise"):
            raise ValueError(f"checkpoint.on_persist_error must be 'warn' or 'raise', got {self.on_persist_error!r}")
        if self.max_host_copies != 0 and self.max_host_copies < 2:
            raise ValueError(f"checkpoint.max_host_copies must be 0 (auto) or >= 2, got {self.max_host_copies}")
        for key in ("drain_timeout_s", "snapshot_timeout_s", "emergency_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"checkpoint.{key} must be > 0, got {getattr(self, key)}")

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
