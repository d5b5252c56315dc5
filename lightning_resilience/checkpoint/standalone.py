"""A single, named checkpoint written by every rank: the format behind ``Trainer.save_checkpoint(path)``.

``<path>/rank_00000/`` ... one shard per rank, each committed by an atomic rename, in the same shard format as
the tiers (manifest, checksums, DCP tensors, JSON skeleton).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import fsync_dir, read_shard, write_shard
from lightning_resilience.checkpoint.layout import leftover_name, rank_dirname
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tree import DTensorRebuilder, flatten_state, unflatten_state

__all__ = ["is_checkpoint_dir", "load_checkpoint_dir", "remove_checkpoint_dir", "save_checkpoint_dir"]


def _shard(path: Path, rank: int) -> Path:
    return path / rank_dirname(rank)


def save_checkpoint_dir(path: str | os.PathLike[str], state: Any, *, step: int, rank: int, world_size: int) -> None:
    """Write this rank's shard of ``state`` under ``path`` (synchronously; tensors may live on any device)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    flat = flatten_state(state)
    snap = StagedSnapshot(step, flat.skeleton, {n: t.detach().cpu() for n, t in flat.tensors.items()})
    tmp = root / leftover_name(rank_dirname(rank), "tmp")
    final = _shard(root, rank)
    try:
        write_shard(tmp, snap, rank=rank, world_size=world_size, rank_layout={"rank": rank, "world_size": world_size})
        if final.exists():
            remove_checkpoint_dir(root, rank=rank, keep_root=True)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_checkpoint_dir(
    path: str | os.PathLike[str], *, rank: int, world_size: int, rebuild_dtensor: DTensorRebuilder | None = None
) -> Any:
    """Validate and load this rank's shard.

    Raises:
        CheckpointCorruptError: missing, partial, corrupt, or written by another world size.
    """
    manifest, snap = read_shard(_shard(Path(path), rank))
    if manifest.world_size != world_size:
        raise CheckpointCorruptError(
            f"{path}: written by a job of world size {manifest.world_size}, this job has {world_size}"
        )
    return unflatten_state(snap.skeleton, snap.tensors, rebuild_dtensor=rebuild_dtensor)


def is_checkpoint_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / rank_dirname(0)).is_dir()


def remove_checkpoint_dir(path: str | os.PathLike[str], *, rank: int, keep_root: bool = False) -> None:
    root = Path(path)
    shard = _shard(root, rank)
    if shard.exists():
        doomed = root / leftover_name(rank_dirname(rank), "del")
        os.replace(shard, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    if not keep_root:
        try:
            root.rmdir()
        except OSError:
            pass
