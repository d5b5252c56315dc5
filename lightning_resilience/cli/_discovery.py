"""Where checkpoint shards are: tier roots, step and shard directories, ``Trainer.save_checkpoint`` directories."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.layout import parse_rank, parse_step, rank_dirs, step_dirs
from lightning_resilience.cli._common import CliError

__all__ = ["ShardRef", "discover", "one_shard", "select"]
_SEARCH_DEPTH = 4


@dataclass(frozen=True)
class ShardRef:
    """One rank's shard of one step in one tier (committed or not: validation is the reader's job)."""

    tier: str
    """Label of the tier: its directory relative to the path given."""
    root: Path
    """Directory holding the ``step_*`` directories (or the shards, for a ``Trainer.save_checkpoint`` directory)."""
    step: int
    rank: int
    path: Path


def _rank_of(path: Path) -> int:
    rank = parse_rank(path.name)
    return -1 if rank is None else rank


def _step_from_manifest(shard: Path) -> int:
    from lightning_resilience.checkpoint.format import read_manifest

    try:
        return read_manifest(shard).step
    except CheckpointCorruptError:
        return -1


def _tier_shards(root: Path, label: str) -> Iterator[ShardRef]:
    for step, step_dir in step_dirs(root).items():
        for rank, shard in rank_dirs(step_dir).items():
            yield ShardRef(label, root, step, rank, shard)


def _is_tier_root(path: Path) -> bool:
    return bool(step_dirs(path))


def _is_standalone(path: Path) -> bool:
    return bool(rank_dirs(path))


def discover(path: Path) -> list[ShardRef]:
    """Every shard under ``path``: a shard, a step directory, a tier root, a ``Trainer.save_checkpoint``
    directory, or a directory holding several tiers (searched a few levels deep)."""
    if not path.exists():
        raise CliError(f"{path} does not exist")
    if not path.is_dir():
        raise CliError(f"{path} is not a directory")
    if parse_rank(path.name) is not None:
        parent_step = parse_step(path.parent.name)
        step = _step_from_manifest(path) if parent_step is None else parent_step
        root = path.parent.parent if parent_step is not None else path.parent
        return [ShardRef(root.name, root, step, _rank_of(path), path)]
    if parse_step(path.name) is not None:
        return [s for s in _tier_shards(path.parent, path.parent.name) if s.path.parent == path]
    found: list[ShardRef] = []

    def walk(directory: Path, depth: int) -> None:
        label = str(directory.relative_to(path)) if directory != path else directory.name
        if _is_tier_root(directory):
            found.extend(_tier_shards(directory, label))
            return
        if _is_standalone(directory):
            for rank, shard in rank_dirs(directory).items():
                found.append(ShardRef(label, directory, _step_from_manifest(shard), rank, shard))
            return
        if depth < _SEARCH_DEPTH:
            for child in sorted(directory.iterdir()):
                if child.is_dir() and not child.name.startswith("."):
                    walk(child, depth + 1)

    walk(path, 0)
    return found


def select(
    shards: list[ShardRef], where: Path, *, step: int | None, rank: int | None, tier: str | None
) -> list[ShardRef]:
    if not shards:
        raise CliError(f"no checkpoint shards under {where}")
    if tier is not None:
        tiers = sorted({s.tier for s in shards})
        shards = [s for s in shards if s.tier == tier]
        if not shards:
            raise CliError(f"no tier {tier!r} under {where}; tiers present: {', '.join(tiers)}")
    if step is not None:
        steps = sorted({s.step for s in shards})
        shards = [s for s in shards if s.step == step]
        if not shards:
            raise CliError(f"step {step} not found under {where}; steps present: {steps}")
    if rank is not None:
        ranks = sorted({s.rank for s in shards})
        shards = [s for s in shards if s.rank == rank]
        if not shards:
            raise CliError(f"rank {rank} not found for that step under {where}; ranks present: {ranks}")
    return shards


def one_shard(args: argparse.Namespace) -> ShardRef:
    """The shard that ``--step``/``--rank``/``--tier`` name (by default the newest step, the lowest rank, the first
    tier by name)."""
    where = Path(args.path)
    shards = select(discover(where), where, step=args.step, rank=None, tier=args.tier)
    if args.step is None:
        newest = max(s.step for s in shards)
        shards = [s for s in shards if s.step == newest]
    rank = min(s.rank for s in shards) if args.rank is None else args.rank  # rank 0 unless PATH is another's shard
    chosen = [s for s in shards if s.rank == rank]
    if not chosen:
        raise CliError(f"rank {rank} not found for step {shards[0].step} under {where}")
    tiers = sorted({s.tier for s in chosen})
    if len(tiers) > 1 and args.tier is None:
        print(f"step {chosen[0].step} is in tiers {', '.join(tiers)}; using {tiers[0]!r} (choose with --tier)")
    return next(s for s in chosen if s.tier == tiers[0])
