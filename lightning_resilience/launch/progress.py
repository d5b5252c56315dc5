"""Progress between attempts: the newest step committed on disk, read the way a restore would trust it.

A step counts when every shard of it that this node can see is committed (``manifest.json`` written last, the
directory renamed into place) and there are as many as the ranks expected to be seen here: the whole world on a shared
or single-node file system, this node's ranks on a node-local disk. Steps being written (``.rank_*.tmp-*``) or
deleted never count. An iteration file (NVRx's ``--ft-checkpoint-iteration-file``: one integer) can be given too, for
checkpoints this node cannot list (an object store).
"""

from __future__ import annotations

import logging
from pathlib import Path

from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.format import read_manifest
from lightning_resilience.checkpoint.layout import parse_rank, rank_dirs, step_dirs

__all__ = ["newest_committed_step", "read_iteration_file"]

log = logging.getLogger(__name__)

_SEARCH_DEPTH = 4


def _step_committed(step_dir: Path, local_ranks: int) -> bool:
    if any(entry.name.startswith(".") for entry in step_dir.iterdir()):
        return False  # a shard being written or deleted: the step is not whole here
    shards = rank_dirs(step_dir)
    try:
        worlds = {read_manifest(shard).world_size for shard in shards.values()}
    except CheckpointCorruptError:
        return False
    if not shards or len(worlds) != 1:
        return False
    world = worlds.pop()
    return len(shards) == world or len(shards) >= min(local_ranks, world)


def newest_committed_step(root: Path, *, local_ranks: int) -> int | None:
    """The newest step committed under ``root`` (tier roots searched a few levels down); None if there is none.

    Args:
        root: the run directory (or a checkpoint directory).
        local_ranks: ranks on this node; a step is whole here when all its world's shards, or at least this many of
            them, are committed.
    """
    newest: int | None = None

    def walk(directory: Path, depth: int) -> None:
        nonlocal newest
        try:
            children = sorted(directory.iterdir())
            steps = step_dirs(directory)
        except OSError:
            return
        for step, path in sorted(steps.items(), reverse=True):
            if newest is not None and step <= newest:
                break
            try:
                if _step_committed(path, local_ranks):
                    newest = step
                    break
            except OSError:  # deleted by retention while we looked
                continue
        if steps or depth >= _SEARCH_DEPTH:
            return
        for child in children:
            if child.is_dir() and not child.name.startswith(".") and parse_rank(child.name) is None:
                walk(child, depth + 1)

    if root.is_dir():
        walk(root, 0)
    return newest


def read_iteration_file(path: Path) -> int | None:
    """The integer in an iteration file; None when it is missing, empty or unreadable (said once in the log)."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning("cannot read the iteration file %s: %s", path, err)
        return None
    try:
        return int(text) if text else None
    except ValueError:
        log.warning("iteration file %s does not hold an integer: %r", path, text[:40])
        return None
