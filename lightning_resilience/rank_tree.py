"""The tree the suite's agreements travel along.

Rank ``r``'s parent is ``(r - 1) // fanout`` and its children are ``fanout * r + 1`` to ``fanout * r + fanout``: a
reduction is ``2 * depth`` hops one after another (``depth`` levels below rank 0: 7 at 10,000 ranks with 4 children
a rank) and each rank talks to at most ``fanout + 1`` peers. The step agreement
(:mod:`lightning_resilience.step.agreement`) reduces every step's vector along it over its TCP links, and carries the
suite's side groups' reductions of a few integers too (an SDC reconciliation's hash at its cadence, a replay round's
flags, the cost budget's review, the restore's decisions): gloo's own all-reduce is a ring of ``2 * (N - 1)`` hops one
after another whatever the payload, about 20,000 at 10,000 ranks (0.4 s at 20 us a hop).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FANOUT", "RankTree"]

FANOUT = 4
"""Children per rank in the suite's trees."""


@dataclass(frozen=True)
class RankTree:
    """Where rank ``rank`` of ``world_size`` sits in a ``fanout``-ary tree rooted at rank 0."""

    rank: int
    world_size: int
    fanout: int = FANOUT

    def __post_init__(self) -> None:
        if self.fanout < 2:
            raise ValueError(f"a rank tree's fanout must be >= 2, got {self.fanout}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a tree of {self.world_size} ranks")

    @property
    def parent(self) -> int | None:
        return (self.rank - 1) // self.fanout if self.rank > 0 else None

    @property
    def children(self) -> list[int]:
        first = self.fanout * self.rank + 1
        return list(range(first, min(first + self.fanout, self.world_size)))

    @property
    def depth(self) -> int:
        """Levels below rank 0 (a reduction is twice as many hops)."""
        depth, reach = 0, 1
        while reach < self.world_size:
            depth, reach = depth + 1, reach * self.fanout + 1
        return depth
