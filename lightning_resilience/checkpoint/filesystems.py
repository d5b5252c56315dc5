"""What kind of filesystem a directory is on: the RAM tiers (``MemoryTier`` in shared memory, ``PeerTier``) belong on
a tmpfs, and a directory on a disk turns each of their commits into disk writes."""

from __future__ import annotations

import logging
import os
from pathlib import Path

__all__ = ["MOUNTINFO", "RAM_FILESYSTEMS", "existing_ancestor", "filesystem_type", "warn_unless_in_ram"]

log = logging.getLogger(__name__)

RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
"""Filesystems whose files live in RAM: a snapshot there is never written back to a disk."""
MOUNTINFO = Path("/proc/self/mountinfo")


def existing_ancestor(path: Path) -> Path:
    """``path`` if it exists, else its nearest ancestor that does (a directory a tier creates later)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem ``path`` is on (its nearest existing ancestor; ``tmpfs``, ``ext4``...), read from
    the mount table (:data:`MOUNTINFO`): the longest mount point above it. None where there is none (not Linux)."""
    try:
        lines = MOUNTINFO.read_text().splitlines()
    except OSError:
        return None
    path = existing_ancestor(Path(os.path.abspath(path))).resolve()
    best, found = -1, None
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not tail:
            continue
        point = Path(parts[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\"))
        if (point == path or point in path.parents) and len(point.parts) >= best:  # a later mount hides an earlier
            best, found = len(point.parts), tail.split()[0]
    return found


def warn_unless_in_ram(path: Path, setting: str, cost: str) -> None:
    """Say so (a warning naming ``setting``) when ``path`` is on a filesystem the mount table names and that is not in
    RAM; the directory is still used, as set. ``cost``: what a disk there costs the tier."""
    kind = filesystem_type(path)
    if kind is not None and kind not in RAM_FILESYSTEMS:
        log.warning(
            "%s=%s is on a %s filesystem, not in RAM: %s (steps wait on the disk, and it wears); a tmpfs such as "
            "/dev/shm is what it is for", setting, path, kind, cost,
        )  # fmt: skip
