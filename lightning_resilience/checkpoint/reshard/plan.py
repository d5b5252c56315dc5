"""Resharding, planning: from manifests and skeletons only, whether and how a step written by N ranks maps onto M
(the mesh, each DTensor's pieces, which source rank each new rank reads)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from lightning_resilience.checkpoint.delta_tier import DELTA_OF
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import (
    SKELETON,
    Manifest,
    read_manifest,
)
from lightning_resilience.checkpoint.layout import rank_dirname, rank_dirs

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
