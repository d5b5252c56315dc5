"""PeerTier: snapshots in node-local RAM (tmpfs), each also held by peer ranks on other nodes.

A node loss takes its processes, their memory and their local disk; Gemini-style replication keeps every rank's
newest checkpoints in the RAM of ``replicas`` other nodes, so the lost ranks restore from their peers instead of an
older copy on remote storage.

The copies live in a node-local tmpfs directory (``/dev/shm`` by default), not in the worker processes:
``torchrun`` (and NVRx's launcher) restart *every* worker of the job when one fails, so RAM inside the workers
would be gone after any restart. A file in tmpfs outlives the worker and dies with the node, which is exactly the
failure a peer copy must cover.

Layout in each node's directory (the :class:`LocalTier` layout; a node holds its own ranks' shards and the
replicas it keeps for peers side by side)::

    <path>/step_000000000120/rank_00000/     committed by rank 0 (its own shard)
    <path>/step_000000000120/rank_00002/     rank 2's shard, received from rank 2 on the other node

Placement is a ring over nodes: rank ``r`` sends its shard to ``(r + k * ranks_per_node) % world`` for
``k = 1..replicas``, i.e. the same local rank on each of the next ``replicas`` nodes. Shards travel as the
committed files (manifest included) over a dedicated gloo group from the persist worker thread, so the transfer
overlaps training and never interleaves with the training collectives; the receiver commits them with the same
atomic protocol as its own. Before a restore, :meth:`PeerTier.prepare_restore` (collective) finds the newest step
of which some surviving node holds every rank's shard and sends each missing shard to its owner.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning_resilience._configurable import ConfigError
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.filesystems import warn_unless_in_ram
from lightning_resilience.checkpoint.format import MANIFEST, write_synced
from lightning_resilience.checkpoint.layout import rank_dirname, rank_dirs, step_dirname, step_dirs
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tier import Durability, TierIdentity, Written
from lightning_resilience.collective import Deadline, SideGroup

__all__ = ["PLACEMENTS", "PeerTier", "ReplicaPlacement", "default_peer_path"]

log = logging.getLogger(__name__)


def default_peer_path() -> str:
    """Node-local tmpfs, one directory per job (``TORCHELASTIC_RUN_ID`` keeps concurrent jobs apart)."""
    return f"/dev/shm/lightning_resilience/{os.environ.get('TORCHELASTIC_RUN_ID', 'default')}"


PLACEMENTS = ("ring", "spread")


class ReplicaPlacement:
    """Which ranks hold whose shards: nodes are ``ranks_per_node`` consecutive ranks (torchrun's order), and a rank's
    copies go to the same local rank on other nodes.

    Args:
        world_size: ranks in the job.
        ranks_per_node: ranks sharing one node (and so one failure domain).
        replicas: peer copies of each shard, each on a different other node.
        placement: ``"ring"``: the next ``replicas`` nodes (Gemini's ring; neighbours exchange, so transfers stay
            local to a switch when nodes are numbered by rack); ``"spread"``: nodes evenly spaced around the job
            (``num_nodes / (replicas + 1)`` apart), so one copy survives the loss of a contiguous block of nodes
            such as a rack.
    """

    def __init__(self, world_size: int, ranks_per_node: int, replicas: int, placement: str = "ring") -> None:
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"tiers.peer.ranks_per_node must divide the world size {world_size}, got {ranks_per_node}")
        if placement not in PLACEMENTS:
            raise ValueError(f"tiers.peer.placement must be one of {list(PLACEMENTS)}, got {placement!r}")
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.num_nodes = world_size // ranks_per_node
        self.replicas = min(replicas, self.num_nodes - 1)
        if placement == "ring":
            self.offsets = list(range(1, self.replicas + 1))
        else:
            self.offsets = [k * self.num_nodes // (self.replicas + 1) for k in range(1, self.replicas + 1)]
        self.placement = placement

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def targets(self, rank: int) -> list[int]:
        """Ranks that hold a copy of ``rank``'s shard."""
        return [(rank + k * self.ranks_per_node) % self.world_size for k in self.offsets]

    def sources(self, rank: int) -> list[int]:
        """Ranks whose shards ``rank`` holds, in the same order as :meth:`targets` (the same node offsets)."""
        return [(rank - k * self.ranks_per_node) % self.world_size for k in self.offsets]


class PeerTier(LocalTier):
    """Node-local RAM copies of every rank's shard, replicated to peers on other nodes.

    Takes a :class:`PeerTier.Config`, or its fields as arguments: ``PeerTier(every_n_steps=5, replicas=1)``.
    """

    @dataclass(kw_only=True)
    class Config(LocalTier.Config):
        """Node-local RAM (tmpfs) copies, replicated to peer ranks on other nodes: survives the loss of a node."""

        path: str = ""
        """Node-local tmpfs directory ('{node}' becomes the node index); empty: /dev/shm/lightning_resilience/<run
        id>."""
        every_n_steps: int = 1
        """Replication cadence in optimizer steps (each sends one shard per replica over the network)."""
        keep: int = 2
        """Committed steps retained (own shards and the replicas held for peers)."""
        name: str = "peer"
        """Label in logs, metrics and the report."""
        replicas: int = 1
        """Peer copies of each rank's shard, each on a different other node (capped at nodes - 1)."""
        placement: str = "ring"
        """'ring' (the next nodes) or 'spread' (nodes evenly spaced around the job: a copy survives a rack's
        loss)."""
        ranks_per_node: int | None = None
        """Ranks per node (failure domain); default LOCAL_WORLD_SIZE as set by torchrun."""
        timeout_s: float = 300.0
        """Bound on one shard transfer between two peers."""

        def __post_init__(self) -> None:
            super().__post_init__()
            owner = f"tiers.{self.name}"
            if self.placement not in PLACEMENTS:
                raise ConfigError(owner, "placement", f"must be one of {list(PLACEMENTS)}, got {self.placement!r}")
            if self.replicas < 0:
                raise ConfigError(owner, "replicas", f"must be >= 0, got {self.replicas}")
            if self.ranks_per_node is not None and self.ranks_per_node < 1:
                raise ConfigError(owner, "ranks_per_node", f"must be >= 1, got {self.ranks_per_node}")
            if not self.timeout_s > 0:
                raise ConfigError(owner, "timeout_s", f"must be > 0, got {self.timeout_s}")

        def _check_path(self) -> None:
            pass  # empty: the default tmpfs directory of this job

        def build(self) -> PeerTier:
            return PeerTier(self)

    durability = Durability.peer
    collective = True
    ram = False

    def __init__(self, *args: Any, **settings: Any) -> None:
        super().__init__(*args, **settings)
        config = self.config
        assert isinstance(config, PeerTier.Config)
        self.path_template = config.path or default_peer_path()
        self.root = Path(self.path_template).expanduser()
        self.replicas = config.replicas
        self.replica_placement = config.placement
        self.ranks_per_node = config.ranks_per_node
        self.timeout = timedelta(seconds=config.timeout_s)
        self.placement = ReplicaPlacement(1, 1, 0)
        self._group = SideGroup(f"tiers.{self.name}", self.timeout, local=True)  # peers come with bind
        self.sent_bytes = 0
        self.received_bytes = 0
        self.recovered: list[tuple[int, int, int]] = []
        """(step, owner rank, holder rank) of every shard fetched from a peer by :meth:`prepare_restore`."""

    def __repr__(self) -> str:
        return (
            f"PeerTier({self.path_template!r}, every_n_steps={self.every_n_steps}, keep={self.keep}, "
            f"replicas={self.replicas})"
        )

    def bind(self, identity: TierIdentity) -> None:
        """Resolve this node's directory and, when distributed, create the transfer group (collective)."""
        per_node = self.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", identity.world_size))
        if identity.world_size % per_node:
            per_node = identity.world_size  # an uneven job: treat it as one node, with nothing to replicate to
        self.placement = ReplicaPlacement(identity.world_size, per_node, self.replicas, self.replica_placement)
        self.root = Path(self.path_template.format(node=self.placement.node_of(identity.rank))).expanduser()
        warn_unless_in_ram(self.root, f"tiers.{self.name}.path", "each copy it commits is written to that disk")
        if self.replicas and self.placement.replicas < self.replicas:
            log.warning(
                "tiers.%s.replicas=%d but the job spans %d node(s): keeping %d peer copies",
                self.name,
                self.replicas,
                self.placement.num_nodes,
                self.placement.replicas,
            )
        self._group = SideGroup(f"tiers.{self.name}", self.timeout)
        super().bind(identity)
        for source in self.placement.sources(identity.rank):
            self._remove_leftovers(rank_dirname(source))

    # ------------------------------------------------------------------ write
    def write(self, snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        """Commit our shard in node RAM, then exchange shards with our ring neighbours (every rank, same step).

        Whatever the local commit does (an I/O error, a bug, the deadline), this rank still takes part in the
        exchange, sending "nothing" instead of its shard: its partners never wait for a shard that will not come.
        The exchange is bounded by ``deadline`` (and the tier's timeout); a partner that does not come is a
        :class:`~lightning_resilience.collective.CollectiveError` within that bound.
        """
        error: Exception | None = None
        written = Written(snap.step, 0)
        try:
            written = super().write(snap, deadline)
        except Exception as err:
            error = err
        if self._group.distributed:
            me = self._identity.rank
            sources = self.placement.sources(me)
            payload = None if error is not None else self._packed(snap.step, me)
            frames = self._group.exchange(
                _frame(snap.step, payload),
                send_to=self.placement.targets(me),
                recv_from=sources,
                op="peer.exchange",
                step=snap.step,
                deadline=deadline,
            )
            if payload is not None:
                self.sent_bytes += len(payload) * len(self.placement.targets(me))
            for source, frame in zip(sources, frames):
                received = _unframe(frame, snap.step, source)
                if received is not None:
                    self.received_bytes += len(received)
                    self._commit_replica(snap.step, source, received)
        if error is not None:
            raise error
        return written

    def write_local(self, snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        """This rank's own copy in node RAM, no exchange (a rank-local emergency save: peers may be gone)."""
        return super().write(snap, deadline)

    def _commit_replica(self, step: int, owner: int, payload: bytes) -> None:
        self._commit(step, lambda tmp: _unpack(payload, tmp), rank_name=rank_dirname(owner))

    # --------------------------------------------------------------- retention
    def delete(self, step: int) -> None:
        """Remove our shard of ``step`` and the replicas we hold for it (retention is agreed by all ranks)."""
        for source in self.placement.sources(self._identity.rank):
            shard = self.root / step_dirname(step) / rank_dirname(source)
            if shard.exists():
                self._discard(shard)
        super().delete(step)

    # ----------------------------------------------------------------- restore
    def inventory(self) -> dict[int, list[int]]:
        """Committed shards in this node's directory: owner rank -> steps."""
        held: dict[int, list[int]] = {}
        for step, step_dir in step_dirs(self.root).items():
            for owner, shard in rank_dirs(step_dir).items():
                if (shard / MANIFEST).is_file():
                    held.setdefault(owner, []).append(step)
        return held

    def prepare_restore(self, deadline: Deadline | None = None) -> list[int]:
        """Collective: bring every rank its shards of the steps that the surviving nodes hold in full.

        Every rank reports what its node holds; for each step of which every rank's shard is held somewhere
        (newest first), each rank whose node lacks its own shard receives it from the lowest-ranked holder.
        Returns those steps. A shard that fails to arrive, or arrives corrupt, leaves its step unloadable for
        that rank, and the collective restore falls back to an older step or another tier.
        """
        if not self._group.distributed:
            return []
        world = self._identity.world_size
        gathered = self._group.all_gather_object(self.inventory(), op="peer.inventory", deadline=deadline)
        holders: dict[tuple[int, int], list[int]] = {}
        for rank, held in enumerate(gathered):
            for owner, steps in held.items():
                for step in steps:
                    holders.setdefault((owner, step), []).append(rank)
        complete = sorted(
            (s for s in {s for (_, s) in holders} if all((owner, s) in holders for owner in range(world))),
            reverse=True,
        )
        me = self._identity.rank
        for step in complete:  # one global order of transfers: every send meets its receive
            for owner in range(world):
                if step in gathered[owner].get(owner, []):
                    continue  # its own node still has it
                holder = min(holders[(owner, step)])
                if me == holder:
                    packed = self._packed(step, owner)
                    self._group.exchange(
                        _frame(step, packed), send_to=[owner], recv_from=[], op="peer.recover", deadline=deadline
                    )
                    self.sent_bytes += len(packed or b"")
                elif me == owner:
                    (frame,) = self._group.exchange(
                        None, send_to=[], recv_from=[holder], op="peer.recover", deadline=deadline
                    )
                    self._keep_recovered(step, holder, frame)
        return complete

    def _keep_recovered(self, step: int, holder: int, frame: bytes | None) -> None:
        me = self._identity.rank
        try:  # keep pairing the remaining transfers whatever happens to this one
            payload = _unframe(frame, step, holder)
            if payload is None:
                log.warning("rank %d: peer rank %d could not send the shard of step %d", me, holder, step)
                return
            self.received_bytes += len(payload)
            self._commit_replica(step, me, payload)
        except OSError as err:
            log.warning("rank %d: shard of step %d from peer rank %d not kept: %s", me, step, holder, err)
            return
        self.recovered.append((step, me, holder))
        log.warning("rank %d: shard of step %d recovered from peer rank %d", me, step, holder)

    def _packed(self, step: int, owner: int) -> bytes | None:
        try:
            return _pack(self.root / step_dirname(step) / rank_dirname(owner))
        except (OSError, CheckpointCorruptError) as err:
            log.warning("cannot send the shard of rank %d step %d: %s", owner, step, err)
            return None


def _frame(step: int, payload: bytes | None) -> bytes:
    """What travels: the step (8 bytes), then the packed shard (nothing: "I have no shard to send")."""
    return step.to_bytes(8, "little") + (payload or b"")


def _unframe(frame: bytes | None, step: int, source: int) -> bytes | None:
    if frame is None or len(frame) < 8:
        raise OSError(f"peer rank {source} sent a malformed frame while step {step} was being replicated")
    got = int.from_bytes(frame[:8], "little")
    if got != step:
        raise OSError(f"peer rank {source} sent step {got} while step {step} was being replicated")
    return frame[8:] or None


def _pack(shard: Path) -> bytes:
    """A committed shard's files as one buffer: a JSON index, then the bytes of each file, the manifest last."""
    names = sorted((p.name for p in shard.iterdir() if p.is_file()), key=lambda n: (n == MANIFEST, n))
    if MANIFEST not in names:
        raise CheckpointCorruptError(f"{shard}: not committed, nothing to replicate")
    blobs = [(shard / n).read_bytes() for n in names]
    index = json.dumps([[n, len(b)] for n, b in zip(names, blobs)]).encode()
    return b"".join([len(index).to_bytes(8, "little"), index, *blobs])


def _unpack(payload: bytes, directory: Path) -> None:
    """Write a packed shard into a new private directory (the manifest last, every file fsynced)."""
    try:
        size = int.from_bytes(payload[:8], "little")
        index = json.loads(payload[8 : 8 + size])
    except (ValueError, UnicodeDecodeError) as err:
        raise OSError(f"malformed replica received ({err})") from err
    directory.mkdir(parents=True, exist_ok=False)
    offset = 8 + size
    for name, length in index:
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise OSError(f"replica names an unsafe file {name!r}")
        write_synced(directory / name, payload[offset : offset + int(length)])
        offset += int(length)
    if offset != len(payload):
        raise OSError(f"replica is {len(payload)} bytes, its index accounts for {offset}")
