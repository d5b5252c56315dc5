"""What the resilience suite adds to every optimizer step, at the job's scale.

The suite's own work on an ordinary step does not grow with the number of ranks (``benchmarks/scale.py`` measures it
from 2 to 32 ranks): a fixed time on the training thread. The step's one agreement goes up and down a
``fanout``-ary tree of the ranks on a thread of its own, issued at the step's start and taken at its end: it costs
the step nothing unless its latency, ``2 * depth(ranks)`` hops, outlasts the step. The simulator bills this per step
(the ``suite`` part of the breakdown).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_resilience.rank_tree import RankTree

__all__ = ["SuiteCostConfig", "tree_depth"]


def tree_depth(ranks: int, fanout: int) -> int:
    """Levels below rank 0 of the ``fanout``-ary tree of ``ranks`` ranks."""
    return RankTree(0, max(ranks, 1), fanout).depth


@dataclass(kw_only=True)
class SuiteCostConfig:
    """The suite's cost per optimizer step."""

    fixed_s: float = 0.0028
    """The suite's own time on the training thread per ordinary step (its hooks, the step driver, a RAM snapshot's
    fixed part), which does not depend on the number of ranks: ``benchmarks/scale.py`` measures it (2.8 ms with the
    default preset at 2 ranks on a 2-core CPU machine, a trivial model: ``benchmarks/results/scale.json``)."""
    hop_s: float = 20e-6
    """One hop of the step agreement's tree: a network round trip between two nodes."""
    fanout: int = 4
    """Children per rank in the agreement's tree (``policy.agreement_fanout``)."""

    def __post_init__(self) -> None:
        for key in ("fixed_s", "hop_s"):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"suite.{key} must be >= 0, got {value!r}")
        if not isinstance(self.fanout, int) or self.fanout < 2:
            raise ValueError(f"suite.fanout must be an integer >= 2, got {self.fanout!r}")

    def round_s(self, ranks: int) -> float:
        """Latency of one round of the step's agreement over ``ranks`` ranks."""
        return 2 * tree_depth(ranks, self.fanout) * self.hop_s

    def per_step_s(self, ranks: int, step_s: float) -> float:
        """Seconds the suite adds to a step of ``step_s`` seconds: its fixed cost, plus the wait for a round that
        outlasts the step."""
        return self.fixed_s + max(0.0, self.round_s(ranks) - step_s)
