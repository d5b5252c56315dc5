"""Tiers written against the protocol of earlier versions, adapted once (with a DeprecationWarning).

Before, a tier's ``durability`` was an int (0 RAM, 1 node, 2 remote), ``write`` returned nothing and took no
deadline, and ``collective``/``reshard_root`` did not exist. The only probing of a tier's members in the engine is
here, at construction, for such a tier.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_resilience.checkpoint.snapshot import HostSnapshot, StagedSnapshot
from lightning_resilience.checkpoint.tier import Durability, Tier, TierIdentity, Written
from lightning_resilience.collective import Deadline

__all__ = ["conform"]

_INT_DURABILITY = {0: Durability.process, 1: Durability.host, 2: Durability.remote}


def conform(tier: Any) -> Tier:
    """``tier`` itself when it implements today's :class:`Tier`; an adapter (and a DeprecationWarning) when it
    implements the earlier protocol."""
    current = isinstance(tier.durability, Durability) and hasattr(tier, "collective")
    if current and hasattr(tier, "reshard_root") and hasattr(tier, "reject"):
        return tier  # type: ignore[no-any-return]
    warnings.warn(
        f"tier {getattr(tier, 'name', tier)!r} implements the Tier protocol of an earlier version (int durability, "
        "write() returning nothing, no reject()); give it a Durability, `collective = False`, `reshard_root()`, "
        "`reject()` and make write() return a Written: the adapter will go in a later release",
        DeprecationWarning,
        stacklevel=3,
    )
    return _LegacyTier(tier)


class _LegacyTier:
    collective = False

    def __init__(self, tier: Any) -> None:
        self._tier = tier
        self.name: str = tier.name
        self.every_n_steps: int = tier.every_n_steps
        self.keep: int = tier.keep
        durability = tier.durability
        if not isinstance(durability, Durability):  # an int of the earliest protocol
            durability = _INT_DURABILITY.get(int(durability), Durability.host)
        self.durability = durability
        self._takes_deadline = "deadline" in inspect.signature(tier.write).parameters

    def __getattr__(self, name: str) -> Any:  # anything else the tier offers (take, adopt, root...)
        return getattr(self._tier, name)

    def bind(self, identity: TierIdentity) -> None:
        self._tier.bind(identity)

    def write(self, snap: StagedSnapshot, deadline: Deadline | None = None) -> Written:
        if deadline is not None:
            deadline.check(f"tier {self.name!r}: write of step {snap.step}")
        result = self._tier.write(snap, deadline) if self._takes_deadline else self._tier.write(snap)
        return result if isinstance(result, Written) else Written(snap.step, snap.nbytes)

    def read(self, step: int) -> StagedSnapshot:
        snap: StagedSnapshot = self._tier.read(step)
        return snap

    def list_steps(self) -> list[int]:
        return list(self._tier.list_steps())

    def delete(self, step: int) -> None:
        self._tier.delete(step)

    def reject(self, step: int, reason: str) -> None:
        self._tier.delete(step)  # an earlier tier keeps no record: the step is gone all the same

    def reshard_root(self) -> Path | None:
        root = getattr(self._tier, "root", None)
        return root if isinstance(root, Path) else None

    def holds(self, step: int) -> bool:
        return step in self.list_steps()

    def adopt(self, slot: HostSnapshot, release: Callable[[HostSnapshot], None]) -> Written:
        self._tier.adopt(slot, release)
        return Written(slot.step, slot.nbytes)
