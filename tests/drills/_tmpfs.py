"""A small tmpfs mounted for one drill: a real filesystem that runs out of space (the ``disk-full`` fault).

Mounting needs root (or CAP_SYS_ADMIN); where it is refused, :class:`TmpfsUnavailable` says why and the caller
decides (the campaign fails the drill naming it, the CI subset skips it).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

SIZE_BYTES = 4 * 2**20
"""Room for a few committed steps of the drill's model (a shard is about 60 kB) before the fault fills the rest."""


class TmpfsUnavailable(RuntimeError):
    """A tmpfs could not be mounted here."""


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int = SIZE_BYTES) -> Iterator[Path]:
    """Mount a tmpfs of ``size_bytes`` at ``path`` (created) for the duration of the block; unmounted after it."""
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)]
    try:
        subprocess.run(mount, check=True, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        raise TmpfsUnavailable(f"cannot mount a tmpfs at {path} (needs root): {detail.strip()}") from err
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True, timeout=30)
