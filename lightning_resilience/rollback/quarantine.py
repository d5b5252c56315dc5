"""The quarantine file: one JSON object per rollback, with the sample indices whose batch was skipped.

Appended with a flush and an fsync per line, so a crash leaves whole lines; :func:`read_quarantine` skips a torn last
line. Only global rank 0 writes it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

__all__ = ["append_quarantine", "quarantined_indices", "read_quarantine"]

log = logging.getLogger(__name__)


def append_quarantine(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one line of ``path`` (created with its directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_quarantine(path: Path) -> list[dict[str, Any]]:
    """Every complete record of ``path`` ([] when absent)."""
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            log.warning("%s line %d is not JSON (a write cut short?): skipped", path, n)
    return out


def quarantined_indices(path: Path) -> set[int]:
    """Every sample index the file quarantines, over all ranks and rollbacks."""
    return {int(i) for r in read_quarantine(path) for indices in r.get("skipped", {}).values() for i in indices}
