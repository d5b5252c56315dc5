"""Resharding: restore a checkpoint written by N ranks on a job of M ranks.

A step directory holds one independent shard per rank (see :mod:`lightning_resilience.checkpoint.format`). Each
shard stores its DTensors as the local piece plus its layout (placements, global shape, mesh shape, the rank's
coordinate on the mesh), so the pieces of all N shards together describe every sharded tensor globally. Resharding
builds, for a new rank ``r`` of ``M``:

* **Sharded state** (DTensor entries: FSDP2 parameters and optimizer state): the slice that rank ``r`` owns on the
  new mesh, read through DCP. A global DCP :class:`~torch.distributed.checkpoint.metadata.Metadata` is synthesized
  from the N per-rank ``.metadata`` files (one chunk per distinct source piece, at its global offset, pointing at the
  source rank's file) and loaded with DCP's planner: each rank alone (``no_dist``) into plain tensors sized to its
  slice (:func:`load_resharded`, what :func:`restore_resharded` uses; no collective), or collectively into DTensors
  the caller allocated on the new mesh (:func:`load_into`, the stock :class:`DefaultLoadPlanner`).
* **Everything else** (plain tensors and the JSON skeleton: DDP model and optimizer, loop counters, RNG streams,
  data-loader positions) is taken from one source rank, ``r % N``. Replicated state (DDP) is equal on every source
  rank, so this is exact. Per-rank state (RNG streams, a sampler's position) cannot be exact across a world-size
  change: new rank ``r`` continues the streams of old rank ``r % N``.

The mesh on M ranks keeps the source mesh's inner dimensions and scales the outermost one (``(dp, tp) = (2, 2)`` on
4 ranks becomes ``(1, 2)`` on 2); rank ``r`` sits at the row-major coordinate of ``r`` on it, as with
``init_device_mesh``. :func:`plan_reshard` checks all of this from manifests and skeletons only, before any tensor is
read, and raises :class:`ReshardError` naming the first problem.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
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

from lightning_resilience.checkpoint.delta_tier import DELTA_OF
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import (
    MANIFEST,
    SKELETON,
    Manifest,
    SafeFileSystemReader,
    read_manifest,
    validate_shard,
)
from lightning_resilience.checkpoint.layout import rank_dirname, rank_dirs, step_dirname, step_dirs
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tier import TierIdentity
from lightning_resilience.checkpoint.tree import DTensorRebuilder, unflatten_state

__all__ = [
    "ReshardError",
    "ReshardPlan",
    "Resharded",
    "ShardedEntry",
    "load_into",
    "load_resharded",
    "local_slice",
    "plan_reshard",
    "reshardable_steps",
    "restore_resharded",
    "restore_resharded_agreed",
]

_DCP_METADATA = ".metadata"


class ReshardError(CheckpointCorruptError):
    """A step cannot be restored at the requested world size (missing shards, mixed world sizes, a layout the new
    world cannot express, per-rank state that cannot be remapped).

    A subclass of :class:`CheckpointCorruptError` so that every restore path that falls back to an older step on a
    bad checkpoint also falls back (collectively) on a step that cannot be resharded.
    """


@dataclass(frozen=True)
class ShardedEntry:
    """One DTensor of the checkpoint: its global description and where its pieces are."""

    name: str
    """Tensor name in every shard (the DCP key of the local piece)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    """Mesh shape when written (N ranks)."""
    target_mesh_shape: tuple[int, ...]
    """Mesh shape on M ranks."""
    pieces: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]
    """Distinct non-empty pieces as (source rank, global offsets, sizes); replicas of a piece are listed once."""


@dataclass
class ReshardPlan:
    """What :func:`plan_reshard` established from manifests and skeletons; consumed by :func:`load_resharded`."""

    step: int
    step_dir: Path
    old_world_size: int
    new_world_size: int
    manifests: list[Manifest]
    skeletons: list[Any]
    sharded: dict[str, ShardedEntry] = field(default_factory=dict)

    def source_rank(self, new_rank: int) -> int:
        """The source rank whose skeleton and plain tensors new rank ``new_rank`` takes."""
        return new_rank % self.old_world_size

    def shard_dir(self, rank: int) -> Path:
        return self.step_dir / rank_dirname(rank)

    def target_coord(self, entry: ShardedEntry, new_rank: int) -> tuple[int, ...]:
        return _unravel(new_rank, entry.target_mesh_shape)

    def target_slice(self, entry: ShardedEntry, new_rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of ``entry`` that ``new_rank`` owns on the new mesh."""
        return local_slice(entry.shape, entry.target_mesh_shape, self.target_coord(entry, new_rank), entry.placements)

    def ranks_read_by(self, new_rank: int) -> set[int]:
        """Source ranks whose data files ``new_rank`` reads."""
        ranks = {self.source_rank(new_rank)}
        for entry in self.sharded.values():
            offsets, sizes = self.target_slice(entry, new_rank)
            ranks.update(r for r, o, s in entry.pieces if _overlaps(offsets, sizes, o, s))
        return ranks


@dataclass
class Resharded:
    """The outcome of :func:`restore_resharded`."""

    step: int
    state: Any
    meta: dict[str, Any]
    old_world_size: int
    source_rank: int
    """The source rank whose non-sharded state this rank took."""


# ------------------------------------------------------------------------------------------------- layout math
def local_slice(
    shape: tuple[int, ...] | list[int],
    mesh_shape: tuple[int, ...] | list[int],
    coord: tuple[int, ...] | list[int],
    placements: tuple[str, ...] | list[str],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global (offsets, sizes) of the piece of a DTensor of ``shape`` held at ``coord`` of a mesh of ``mesh_shape``.

    Same chunking as DTensor's ``Shard``: ``ceil(n / k)``-sized chunks, the last ones short or empty (an empty piece
    has offset ``shape[dim]``); mesh dims that shard the same tensor dim split it in mesh order. ``placements`` are in
    the skeleton's text form (``S0``, ``R``).
    """
    sizes = list(shape)
    offsets = [0] * len(shape)
    for mesh_dim, text in enumerate(placements):
        if text == "R":
            continue
        dim = int(text[1:])
        count, index = mesh_shape[mesh_dim], coord[mesh_dim]
        full = -(-sizes[dim] // count)
        start = full * index
        if start >= sizes[dim]:  # an empty piece sits at the end of the dim, as DTensor places it
            offsets[dim], sizes[dim] = shape[dim], 0
        else:
            sizes[dim] = min(sizes[dim], start + full) - start
            offsets[dim] += start
    return tuple(offsets), tuple(sizes)


def _unravel(rank: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    coord = []
    for size in reversed(mesh_shape):
        coord.append(rank % size)
        rank //= size
    return tuple(reversed(coord))


def _overlaps(o1: tuple[int, ...], s1: tuple[int, ...], o2: tuple[int, ...], s2: tuple[int, ...]) -> bool:
    if 0 in s1 or 0 in s2:
        return False
    return all(a < b + m and b < a + n for a, n, b, m in zip(o1, s1, o2, s2))


def _target_mesh_shape(name: str, mesh_shape: tuple[int, ...], new_world_size: int, where: Path) -> tuple[int, ...]:
    if len(mesh_shape) == 1:
        return (new_world_size,)
    inner = math.prod(mesh_shape[1:])
    if new_world_size % inner:
        raise ReshardError(
            f"{where}: {name!r} is sharded on a {len(mesh_shape)}-D mesh {mesh_shape}; on {new_world_size} ranks the "
            f"inner mesh dims {mesh_shape[1:]} ({inner} ranks) cannot be kept because {inner} does not divide "
            f"{new_world_size}; restore on a multiple of {inner} ranks"
        )
    return (new_world_size // inner, *mesh_shape[1:])


# ------------------------------------------------------------------------------------------------- planning
def _rank_dirs(step_dir: Path) -> dict[int, Path]:
    if not step_dir.is_dir():
        raise ReshardError(f"{step_dir}: no such step directory")
    return rank_dirs(step_dir)


def _read_skeleton(shard: Path, manifest: Manifest) -> Any:
    info = manifest.files.get(SKELETON)
    if info is None:
        raise ReshardError(f"{shard}: manifest lists no {SKELETON}")
    try:
        raw = (shard / SKELETON).read_bytes()
    except OSError as err:
        raise ReshardError(f"{shard}: {SKELETON} unreadable ({err})") from err
    if len(raw) != info.get("size") or xxhash.xxh3_64(raw).hexdigest() != info.get("xxh3_64"):
        raise ReshardError(f"{shard}: {SKELETON} does not match its manifest (size or checksum)")
    try:
        return json.loads(raw)
    except ValueError as err:
        raise ReshardError(f"{shard}: {SKELETON} is not JSON ({err})") from err


def _dtensor_nodes(node: Any, out: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Every ``DT`` node of a skeleton, by the name of its local tensor (tied DTensors share one)."""
    if isinstance(node, list):
        for item in node:
            _dtensor_nodes(item, out)
    elif isinstance(node, dict) and len(node) == 1:
        ((tag, val),) = node.items()
        if tag == "DT" and isinstance(val, dict):
            out.setdefault(str(val["local"]), []).append(val)
        elif tag == "d" and isinstance(val, dict):
            for item in val.values():
                _dtensor_nodes(item, out)
        elif tag in ("l", "t", "m") and isinstance(val, list):
            for item in val:
                _dtensor_nodes(item, out)
    return out


def plan_reshard(step_dir: str | Path, new_world_size: int, *, require_even: bool = False) -> ReshardPlan:
    """Decide, from manifests and skeletons only, whether ``step_dir`` can be restored on ``new_world_size`` ranks.

    Reads each shard's ``manifest.json`` and ``skeleton.json`` (the skeleton checked against its manifest checksum);
    no tensor data is read. Data files are checksummed later, by :func:`load_resharded`.

    Args:
        step_dir: a committed step directory, ``<root>/step_XXXXXXXXXXXX`` with one ``rank_NNNNN`` per source rank.
        new_world_size: ranks of the job that will load it.
        require_even: refuse a sharded dim that the new mesh cannot split evenly (for strategies that need it).

    Raises:
        ReshardError: naming the step directory and the first problem found.
    """
    step_dir = Path(step_dir)
    if new_world_size < 1:
        raise ValueError(f"new_world_size must be >= 1, got {new_world_size}")
    found = _rank_dirs(step_dir)
    if not found:
        raise ReshardError(f"{step_dir}: no committed rank shard")
    manifests: dict[int, Manifest] = {}
    for rank, shard in sorted(found.items()):
        try:
            manifests[rank] = read_manifest(shard)
        except CheckpointCorruptError as err:
            raise ReshardError(f"cannot reshard: {err}") from err
    sizes = {m.world_size for m in manifests.values()}
    if len(sizes) != 1:
        by_size = {s: sorted(r for r, m in manifests.items() if m.world_size == s) for s in sorted(sizes)}
        raise ReshardError(f"{step_dir}: shards written by jobs of different world sizes {by_size} (rank lists)")
    (old,) = sizes
    missing = sorted(set(range(old)) - set(manifests))
    if missing:
        raise ReshardError(
            f"{step_dir}: written by {old} ranks but the shards of ranks {missing} are missing here; resharding "
            "needs every source shard visible to every rank (a shared file system, or replicas)"
        )
    extra = sorted(set(manifests) - set(range(old)))
    if extra:
        raise ReshardError(f"{step_dir}: shards of ranks {extra} do not belong to a job of world size {old}")
    steps = {m.step for m in manifests.values()}
    wrong = [r for r, m in manifests.items() if m.rank != r]
    if len(steps) != 1 or wrong:
        raise ReshardError(f"{step_dir}: manifests disagree on step {sorted(steps)} or rank (ranks {wrong})")
    for rank, manifest in manifests.items():
        if manifest.tensors and (_DCP_METADATA not in manifest.files or DELTA_OF in manifest.meta):
            raise ReshardError(
                f"{found[rank]}: not a DCP shard (a delta-encoded step?); only full steps can be resharded"
            )
    ordered = [manifests[r] for r in range(old)]
    skeletons = [_read_skeleton(found[r], ordered[r]) for r in range(old)]
    plan = ReshardPlan(ordered[0].step, step_dir, old, new_world_size, ordered, skeletons)
    _plan_sharded(plan, require_even=require_even)
    return plan


def _plan_sharded(plan: ReshardPlan, *, require_even: bool) -> None:
    where = plan.step_dir
    nodes = [{name: found[0] for name, found in _dtensor_nodes(s, {}).items()} for s in plan.skeletons]
    plain = [{n: s for n, s in m.tensors.items() if n not in nodes[r]} for r, m in enumerate(plan.manifests)]
    for rank in range(1, plan.old_world_size):
        if nodes[rank].keys() != nodes[0].keys() or plain[rank].keys() != plain[0].keys():
            diff = sorted((set(nodes[rank]) | set(plain[rank])) ^ (set(nodes[0]) | set(plain[0])))[:5]
            raise ReshardError(
                f"{where}: rank {rank} holds different tensors than rank 0 (e.g. {diff}): per-rank state (pipeline "
                "stages, rank-specific modules) cannot be remapped to another world size"
            )
        changed = [n for n, s in plain[rank].items() if s != plain[0][n]][:5]
        if changed:
            raise ReshardError(
                f"{where}: tensors {changed} differ in shape or dtype between rank 0 and rank {rank}: per-rank state "
                "that cannot be remapped to another world size"
            )
    for name, first in nodes[0].items():
        if name not in plan.manifests[0].tensors:
            raise ReshardError(f"{where}: the skeleton names a sharded tensor {name!r} that the manifest lacks")
        try:
            plan.sharded[name] = _plan_entry(plan, name, [n[name] for n in nodes], first, require_even=require_even)
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise ReshardError(f"{where}: unreadable layout of {name!r} ({type(err).__name__}: {err})") from err


def _plan_entry(
    plan: ReshardPlan, name: str, layouts: list[dict[str, Any]], first: dict[str, Any], *, require_even: bool
) -> ShardedEntry:
    where = plan.step_dir
    old = plan.old_world_size
    shape = tuple(int(d) for d in first["shape"])
    placements = tuple(str(p) for p in first["placements"])
    for text in placements:
        if text != "R" and not (text.startswith("S") and text[1:].isdigit() and int(text[1:]) < len(shape)):
            raise ReshardError(f"{where}: {name!r} has placement {text!r}, which resharding cannot re-slice")
    dtype = plan.manifests[0].tensors[name].dtype
    pieces: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}
    mesh_shape: tuple[int, ...] | None = None
    for rank, layout in enumerate(layouts):
        same = (
            tuple(layout["shape"]) == shape
            and tuple(layout["placements"]) == placements
            and layout["mesh"] == first["mesh"]
            and plan.manifests[rank].tensors[name].dtype == dtype
        )
        if not same:
            raise ReshardError(
                f"{where}: {name!r} has a different global shape, placement, mesh or dtype on rank {rank} than on "
                "rank 0: per-rank state that cannot be remapped"
            )
        if "mesh_shape" in layout:
            ranks_mesh = tuple(int(d) for d in layout["mesh_shape"])
            coord = tuple(int(c) for c in layout["coord"])
        elif len(placements) == 1:  # written before mesh shapes were recorded: a 1-D mesh over the whole job
            ranks_mesh, coord = (old,), (rank,)
        else:
            raise ReshardError(
                f"{where}: {name!r} is on a {len(placements)}-D mesh and the checkpoint predates recorded mesh "
                "shapes; it can only be restored on its original world size"
            )
        if mesh_shape is None:
            mesh_shape = ranks_mesh
        if ranks_mesh != mesh_shape or len(ranks_mesh) != len(placements):
            raise ReshardError(f"{where}: {name!r} has mesh shapes {mesh_shape} and {ranks_mesh} on different ranks")
        if math.prod(ranks_mesh) != old:
            raise ReshardError(
                f"{where}: {name!r} lives on a mesh {dict(zip(first['mesh'], ranks_mesh)) or ranks_mesh} of "
                f"{math.prod(ranks_mesh)} of the {old} ranks (a tensor-parallel, pipeline or replica sub-mesh); "
                "only meshes spanning the whole job can be resharded"
            )
        if coord != _unravel(rank, ranks_mesh):
            raise ReshardError(
                f"{where}: rank {rank} sits at {coord} of the mesh of {name!r}, not at its row-major place; only "
                "meshes laid out like init_device_mesh can be resharded"
            )
        offsets, sizes = local_slice(shape, ranks_mesh, coord, placements)
        if sizes != plan.manifests[rank].tensors[name].shape:
            raise ReshardError(
                f"{where}: rank {rank}'s piece of {name!r} has shape {plan.manifests[rank].tensors[name].shape}, "
                f"its layout implies {sizes}: a sharding this version does not understand (strided or padded)"
            )
        if 0 not in sizes:
            pieces.setdefault(offsets, (rank, sizes))
    assert mesh_shape is not None
    covered = sum(math.prod(s) for _, s in pieces.values())
    if covered != math.prod(shape) and math.prod(shape) > 0:
        raise ReshardError(f"{where}: the pieces of {name!r} cover {covered} of its {math.prod(shape)} elements")
    target = _target_mesh_shape(name, mesh_shape, plan.new_world_size, where)
    if require_even:
        for mesh_dim, text in enumerate(placements):
            if text != "R" and shape[int(text[1:])] % target[mesh_dim]:
                raise ReshardError(
                    f"{where}: {name!r} dim {text[1:]} has {shape[int(text[1:])]} elements, which the new mesh "
                    f"{target} cannot split evenly over {target[mesh_dim]} ranks (require_even=True)"
                )
    return ShardedEntry(
        name=name,
        shape=shape,
        dtype=dtype,
        placements=placements,
        mesh_shape=mesh_shape,
        target_mesh_shape=target,
        pieces=tuple((r, o, s) for o, (r, s) in sorted(pieces.items())),
    )


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
    return Resharded(step, state, snap.meta, plan.old_world_size, plan.source_rank(identity.rank))


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


def restore_resharded_agreed(
    roots: Mapping[str, str | Path],
    identity: TierIdentity,
    *,
    all_gather: Callable[[Any], list[Any]],
    all_true: Callable[[bool], bool],
    rebuild_dtensor: DTensorRebuilder | None = None,
    max_step: int | None = None,
    on_skip: Callable[[str], None] | None = None,
) -> tuple[str, Resharded] | None:
    """Collectively restore the newest step, written by another world size, that every rank can reshard.

    Every rank calls it with the same ``roots`` (tier name to directory, fastest first). Per tier: the ranks agree
    on the steps all of them see (``all_gather``); from the newest down, each rank plans the step
    (:func:`plan_reshard`, manifests and skeletons only) and the ranks agree that all plans succeeded
    (``all_true``) *before* any rank loads data; then each loads its slice, and the step is taken only if all
    loads succeeded. A refused or corrupt step is reported through ``on_skip`` and the next older one is tried.
    The number of collectives is the same on every rank whatever fails, so no rank is left waiting.

    Returns:
        (tier name, result), or None when no step of another world size can be restored everywhere.
    """
    skip = on_skip or (lambda message: None)
    for name, root in roots.items():
        local = [s for s in reshardable_steps(root, identity.world_size) if max_step is None or s <= max_step]
        common = set.intersection(*(set(steps) for steps in all_gather(local)))
        for step in sorted(common, reverse=True):
            plan = None
            try:
                plan = plan_reshard(Path(root) / step_dirname(step), identity.world_size)
            except CheckpointCorruptError as err:  # ReshardError included
                skip(f"cannot reshard step {step} of tier {name!r} to {identity.world_size} ranks: {err}")
            if not all_true(plan is not None):
                continue
            result = None
            try:
                result = restore_resharded(root, step, identity, rebuild_dtensor, plan=plan)
            except (CheckpointCorruptError, OSError) as err:  # every rank must reach the agreement below
                skip(f"skipping resharded step {step} of tier {name!r}: {err}")
            if all_true(result is not None):
                assert result is not None
                return name, result
    return None
