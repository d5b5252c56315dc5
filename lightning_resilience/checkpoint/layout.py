"""The on-disk layout of a tier: step and rank directory names, their parsing, and discovery.

One layout for every tier (local disk, peer tmpfs, an fsspec store), for resharding and for the CLI::

    <root>/step_000000000120/rank_00000/{manifest.json, skeleton.json, .metadata, __0_0.distcp}
    <root>/step_000000000120/.rank_00001.tmp-<id>/      a shard being written: never trusted
    <root>/step_000000000120/.rank_00001.del-<id>/      a shard being deleted: never trusted

Names are parsed strictly (12 step digits, 5 rank digits): anything else in a tier's directory is not ours.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

__all__ = [
    "LEFTOVER_KINDS",
    "is_leftover_of",
    "leftover_name",
    "parse_rank",
    "parse_step",
    "rank_dirname",
    "rank_dirs",
    "step_dirname",
    "step_dirs",
    "step_of_entry",
]

_STEP_RE = re.compile(r"^step_(\d{12})$")
_RANK_RE = re.compile(r"^rank_(\d{5})$")
LEFTOVER_KINDS = ("tmp", "del")
"""Private directories next to a shard: one being written (``tmp``), one being deleted (``del``)."""


def step_dirname(step: int) -> str:
    """``step_000000000120``."""
    if step < 0:
        raise ValueError(f"a checkpoint step is >= 0, got {step}")
    return f"step_{step:012d}"


def rank_dirname(rank: int) -> str:
    """``rank_00003``."""
    if rank < 0:
        raise ValueError(f"a rank is >= 0, got {rank}")
    return f"rank_{rank:05d}"


def parse_step(name: str) -> int | None:
    """The step a step directory's name stands for, or None if the name is not one."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def parse_rank(name: str) -> int | None:
    """The rank a shard directory's name stands for, or None if the name is not one."""
    match = _RANK_RE.match(name)
    return int(match.group(1)) if match else None


def step_of_entry(entry: str) -> int | None:
    """The step of a listing entry: a path or key whose last component is a step directory name."""
    return parse_step(str(entry).rstrip("/").rsplit("/", 1)[-1])


def leftover_name(rank_name: str, kind: str) -> str:
    """A new private name next to shard ``rank_name``: ``.rank_00001.tmp-<id>`` (``kind`` in LEFTOVER_KINDS)."""
    if kind not in LEFTOVER_KINDS:
        raise ValueError(f"kind must be one of {LEFTOVER_KINDS}, got {kind!r}")
    return f".{rank_name}.{kind}-{uuid.uuid4().hex[:12]}"


def is_leftover_of(name: str, rank_name: str) -> bool:
    """True for a private directory of shard ``rank_name`` (a write or a delete that did not finish)."""
    return name.startswith(tuple(f".{rank_name}.{kind}-" for kind in LEFTOVER_KINDS))


def step_dirs(root: Path) -> dict[int, Path]:
    """Step directories under ``root``, by step (empty when ``root`` does not exist)."""
    if not root.is_dir():
        return {}
    found = {}
    for entry in root.iterdir():
        step = parse_step(entry.name)
        if step is not None and entry.is_dir():
            found[step] = entry
    return dict(sorted(found.items()))


def rank_dirs(step_dir: Path) -> dict[int, Path]:
    """Shard directories of one step, by rank (committed or not: a reader checks the manifest)."""
    if not step_dir.is_dir():
        return {}
    found = {}
    for entry in step_dir.iterdir():
        rank = parse_rank(entry.name)
        if rank is not None and entry.is_dir():
            found[rank] = entry
    return dict(sorted(found.items()))
