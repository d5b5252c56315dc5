"""Resharding, loading: each new rank reads its slice of every sharded tensor through DCP's planner over a
synthesized global metadata, and the rest of its state from its source rank."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_resilience.checkpoint.content import without_print
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import (
    MANIFEST,
    SafeFileSystemReader,
    read_manifest,
    validate_shard,
)
from lightning_resilience.checkpoint.layout import rank_dirname, step_dirname, step_dirs
from lightning_resilience.checkpoint.reshard.plan import ReshardPlan, _dtensor_nodes, plan_reshard
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tier import TierIdentity
from lightning_resilience.checkpoint.tree import DTensorRebuilder, unflatten_state


@dataclass
class Resharded:
    """The outcome of :func:`restore_resharded`."""

    step: int
    state: Any
    meta: dict[str, Any]
    old_world_size: int
    source_rank: int
    """The source rank whose non-sharded state this rank took."""


# ------------------------------------------------------------------------------------------------- loading
class _ReshardReader(SafeFileSystemReader):
    """DCP reader over a whole step directory that serves a synthesized global metadata instead of reading one."""

    def __init__(self, step_dir: Path, metadata: Metadata) -> None:
        super().__init__(step_dir)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self._metadata


class _SlicePlanner(DefaultLoadPlanner):
    """DCP's planner for plain tensors that hold a slice of a global tensor starting at a given offset.

    DCP places a plain tensor at offset 0; here each destination tensor is one chunk at its recorded global offset,
    and DCP's own resharding algorithm (``create_read_items_for_chunk_list``) computes the reads.
    """

    def __init__(self, offsets: Mapping[str, tuple[int, ...]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._offsets = dict(offsets)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for fqn, tensor in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata)
            offsets = self._offsets.get(fqn, (0,) * tensor.dim())
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())
            reads = create_read_items_for_chunk_list(fqn, md, [chunk])
            # source pieces do not overlap, so equal volume means every element of the slice is read
            if sum(math.prod(r.lengths) for r in reads) != tensor.numel():
                raise CheckpointCorruptError(f"{fqn}: the source pieces do not cover the slice at {offsets}")
            items.extend(reads)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        tensor: torch.Tensor = self.state_dict[index.fqn]
        return tensor


def _storage_of(plan: ReshardPlan, ranks: set[int]) -> dict[int, dict[MetadataIndex, Any]]:
    """Each listed source rank's DCP storage entries, read through the allow-list unpickler."""
    out: dict[int, dict[MetadataIndex, Any]] = {}
    for rank in sorted(ranks):
        shard = plan.shard_dir(rank)
        if not plan.manifests[rank].tensors:
            out[rank] = {}
            continue
        try:
            md = SafeFileSystemReader(shard).read_metadata()
        except CheckpointCorruptError:
            raise
        except Exception as err:
            raise CheckpointCorruptError(f"{shard}: DCP metadata unreadable ({type(err).__name__}: {err})") from err
        prefix = shard.name + "/"
        out[rank] = {
            idx: type(info)(**{**vars(info), "relative_path": prefix + info.relative_path})
            for idx, info in (md.storage_data or {}).items()
        }
    return out


def _global_metadata(plan: ReshardPlan, plain_source: int, ranks: set[int]) -> Metadata:
    """One DCP metadata for the whole step: plain tensors from ``plain_source``, every sharded tensor as the chunks
    of the source ranks in ``ranks`` at their global offsets."""
    storage = _storage_of(plan, ranks | {plain_source})
    state_md: dict[str, Any] = {}
    data: dict[MetadataIndex, Any] = {}

    def lookup(rank: int, name: str, ndim: int) -> Any:
        try:
            return storage[rank][MetadataIndex(name, (0,) * ndim)]
        except KeyError as err:
            raise CheckpointCorruptError(f"{plan.shard_dir(rank)}: DCP metadata lacks tensor {name!r}") from err

    for name, spec in plan.manifests[plain_source].tensors.items():
        if name in plan.sharded:
            continue
        zero = (0,) * len(spec.shape)
        state_md[name] = _tensor_md(spec.dtype, spec.shape, [(zero, spec.shape)])
        data[MetadataIndex(name, zero)] = lookup(plain_source, name, len(spec.shape))
    for name, entry in plan.sharded.items():
        pieces = [(r, o, s) for r, o, s in entry.pieces if r in ranks]
        state_md[name] = _tensor_md(entry.dtype, entry.shape, [(o, s) for _, o, s in pieces])
        for rank, offsets, _ in pieces:
            data[MetadataIndex(name, offsets)] = lookup(rank, name, len(entry.shape))
    return Metadata(state_dict_metadata=state_md, storage_data=data)


def _tensor_md(
    dtype: torch.dtype, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype),
        size=torch.Size(shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks],
    )


def _verify(plan: ReshardPlan, ranks: set[int], verify_checksums: bool) -> None:
    for rank in sorted(ranks):
        manifest = validate_shard(plan.shard_dir(rank), verify_checksums=verify_checksums)
        if manifest.to_json() != plan.manifests[rank].to_json():
            raise CheckpointCorruptError(f"{plan.shard_dir(rank)}: {MANIFEST} changed while resharding")


def load_resharded(plan: ReshardPlan, new_rank: int, *, verify_checksums: bool = True) -> StagedSnapshot:
    """This rank's flat state on the new world size: skeleton and plain tensors of its source rank, sharded tensors
    as the plain local slice it owns on the new mesh (layout in the skeleton updated to the new mesh).

    No collective: each rank loads alone (DCP ``no_dist``). Before anything is loaded, the shards this rank reads and
    every source rank ``j`` with ``j % M == new_rank`` are validated (sizes and checksums), so across the M ranks
    every source shard is checked once; a caller that restores collectively must agree on the outcome.

    Raises:
        CheckpointCorruptError: a source shard failed validation or could not be read.
    """
    if not 0 <= new_rank < plan.new_world_size:
        raise ValueError(f"new_rank must be in [0, {plan.new_world_size}), got {new_rank}")
    source = plan.source_rank(new_rank)
    reads = plan.ranks_read_by(new_rank)
    _verify(plan, reads | set(range(new_rank, plan.old_world_size, plan.new_world_size)), verify_checksums)
    metadata = _global_metadata(plan, source, reads)
    tensors: dict[str, torch.Tensor] = {}
    offsets: dict[str, tuple[int, ...]] = {}
    skeleton = json.loads(json.dumps(plan.skeletons[source]))  # a private copy: its DT layouts are rewritten
    for name, spec in plan.manifests[source].tensors.items():
        if name not in plan.sharded:
            tensors[name] = torch.empty(spec.shape, dtype=spec.dtype)
    for name, layouts in _dtensor_nodes(skeleton, {}).items():
        entry = plan.sharded[name]
        offsets[name], sizes = plan.target_slice(entry, new_rank)
        tensors[name] = torch.empty(sizes, dtype=entry.dtype)
        for layout in layouts:
            layout["mesh_shape"] = list(entry.target_mesh_shape)
            layout["coord"] = list(plan.target_coord(entry, new_rank))
    try:
        if tensors:
            dcp.load(
                tensors,
                storage_reader=_ReshardReader(plan.step_dir, metadata),
                planner=_SlicePlanner(offsets),
                no_dist=True,
            )
    except (Exception, CheckpointException) as err:  # DCP raises CheckpointException, a BaseException
        raise CheckpointCorruptError(f"{plan.step_dir}: resharded load failed ({type(err).__name__}: {err})") from err
    return StagedSnapshot(plan.step, skeleton, tensors, dict(plan.manifests[source].meta))


def load_into(plan: ReshardPlan, state_dict: dict[str, torch.Tensor], *, process_group: Any = None) -> None:
    """Collectively load sharded tensors into ``state_dict`` of DTensors already laid out on the new mesh.

    Keys are the checkpoint's tensor names (``model/layer.weight``); values DTensors (or plain tensors, which get
    the source rank 0 copy). Uses DCP's stock :class:`DefaultLoadPlanner` over the synthesized global metadata: a
    collective over ``process_group`` (default: the default group); every rank of it must call. Source shards are
    not validated here: validate them first (e.g. with :func:`load_resharded`, or ``format.validate_shard``).
    """
    metadata = _global_metadata(plan, 0, set(range(plan.old_world_size)))
    dcp.load(
        state_dict,
        storage_reader=_ReshardReader(plan.step_dir, metadata),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        process_group=process_group,
    )


def _local_slice_as_tensor(local: torch.Tensor, layout: Mapping[str, Any]) -> torch.Tensor:
    return local


def restore_resharded(
    tier_root: str | Path,
    step: int,
    identity: TierIdentity,
    rebuild_dtensor: DTensorRebuilder | None = None,
    *,
    plan: ReshardPlan | None = None,
    verify_checksums: bool = True,
) -> Resharded:
    """Restore ``step`` of a tier directory written by another world size, as rank ``identity.rank`` of
    ``identity.world_size``.

    Every rank of the new job calls it (no collective inside); the caller agrees on the outcome across ranks.
    ``rebuild_dtensor`` turns each local slice and its new layout (``mesh_shape``, ``coord`` of the new mesh) into
    a DTensor, e.g. ``dtensor_rebuilder(mesh)`` of the model-parallel strategy; without it sharded entries come back
    as plain tensors holding this rank's slice.

    Raises:
        ReshardError: the step cannot be expressed on this world size (from :func:`plan_reshard`).
        CheckpointCorruptError: a source shard is missing, corrupt or unreadable.
    """
    step_dir = Path(tier_root) / step_dirname(step)
    plan = plan or plan_reshard(step_dir, identity.world_size)
    if plan.new_world_size != identity.world_size or plan.step_dir != step_dir:
        raise ValueError(
            f"plan is for {plan.step_dir} on {plan.new_world_size} ranks, not {step_dir} on {identity.world_size}"
        )
    snap = load_resharded(plan, identity.rank, verify_checksums=verify_checksums)
    state = unflatten_state(snap.skeleton, snap.tensors, rebuild_dtensor=rebuild_dtensor or _local_slice_as_tensor)
    # the content print describes the source rank's shard, not the resharded tensors: it is not handed on
    return Resharded(step, state, without_print(snap.meta), plan.old_world_size, plan.source_rank(identity.rank))


def reshardable_steps(tier_root: str | Path, world_size: int) -> list[int]:
    """Steps under ``tier_root`` whose rank-0 shard was written by a job of another world size (cheap: one manifest
    per step; :func:`plan_reshard` checks the rest). Oldest first."""
    steps = []
    for step, step_dir in step_dirs(Path(tier_root)).items():
        try:
            manifest = read_manifest(step_dir / rank_dirname(0))
        except CheckpointCorruptError:
            continue
        if manifest.world_size != world_size:
            steps.append(step)
    return steps
