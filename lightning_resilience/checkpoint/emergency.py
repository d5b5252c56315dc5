"""Emergency save: persist the newest RAM snapshot before the process goes (a preemption notice, an exception).

Two modes, chosen by the caller and never mixed up:

* **collective** (a preemption agreed by every rank): every rank reaches the same agreements, on every path. A rank
  that cannot write (its persist worker is still busy, it holds no snapshot) still takes part and says so; the
  ranks agree on the step (the newest that every rank holds in RAM), and before each collective tier (peer
  exchange) they vote to write it together or not at all. Retention then keeps what every rank committed.
* **rank-local** (after an exception, when other ranks may be dead or stuck): no collective is reachable. A
  collective tier keeps only this rank's own copy (:meth:`PeerTier.write_local`), without exchanging. A tier that
  survives no more than the RAM tier already does (the local disk, when the snapshots are in shared memory) is
  skipped: the step is already there for the restart, and the process ends sooner.

Every write gets what is left of the budget as its deadline (a remote upload or a peer exchange stops at it, not
at its own timeout); every agreement is bounded by the budget too, with a short floor so that a rank whose budget
ran out can still say "no".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import cast

from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.retention import apply_retention, committed_everywhere, missing_anywhere
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.stats import CheckpointStats
from lightning_resilience.checkpoint.tier import CollectiveTier, RamTier, Tier
from lightning_resilience.collective import CollectiveError, Deadline, SideGroup

__all__ = ["EmergencySave"]

log = logging.getLogger(__name__)

VOTE_FLOOR = timedelta(seconds=5)
"""Shortest bound of one agreement of an emergency save: a rank out of budget still answers "no" in time."""


@dataclass
class _View:
    """What one rank brings to the agreement."""

    ok: bool
    ram: list[int]
    tiers: dict[str, list[int]] = field(default_factory=dict)


class EmergencySave:
    """One emergency save of one rank.

    Args:
        ram: the RAM tiers (where the snapshot is).
        persistent: the tiers to save to, fastest first.
        group: the manager's side group for the collective mode; None for a rank-local save.
        budget: the whole save's deadline.
        stats: where writes and failures are counted.
    """

    def __init__(
        self,
        ram: Sequence[RamTier],
        persistent: Sequence[Tier],
        group: SideGroup | None,
        budget: Deadline,
        stats: CheckpointStats,
    ) -> None:
        self.ram = list(ram)
        self.persistent = list(persistent)
        self.group = group
        self.budget = budget
        self.stats = stats

    def run(self, ok: bool, on_commit: Callable[[str, int], None] | None = None) -> int | None:
        """Save; ``ok`` is False when this rank must not write (its worker is still busy); ``on_commit(tier,
        step)`` is told of every write committed. Returns the step persisted to at least one tier (or already
        there), or None."""
        held = sorted({s for tier in self.ram for s in tier.list_steps()})
        mine = _View(ok, held, {t.name: t.list_steps() for t in self.persistent})
        views = self._agree(mine)
        if views is not None:
            common = set.intersection(*(set(v.ram) for v in views))
            step = max(common) if common else (held[-1] if held else None)
            together = bool(common) and all(v.ok for v in views)
        else:
            step, together = (held[-1] if held else None), False
        if step is None:
            log.warning("emergency save: no snapshot in RAM to save")
        tier_views = [v.tiers for v in views] if views is not None else []
        protect = committed_everywhere(tier_views, [t.name for t in self.persistent])
        snap: StagedSnapshot | None = None
        saved = False
        kept = max((t.durability.level for t in self.ram if step is not None and t.holds(step)), default=-1)
        for target in self.persistent:
            have = step is not None and step in mine.tiers[target.name]
            if views is None and target.durability.level <= kept:
                saved = True  # already where this tier would keep it: the RAM tier's shared memory
                continue
            if target.collective and views is not None:
                # every rank votes, whatever it holds: the exchange runs on all ranks or on none
                wanted = together and step is not None and missing_anywhere(tier_views, target.name, step)
                if wanted and ok and snap is None:
                    snap = self._snapshot(step)
                if not self._vote(wanted and snap is not None and not self.budget.expired, step):
                    saved = saved or have
                    continue
            elif step is None or not ok or have:
                saved = saved or have
                continue
            elif self.budget.expired:
                log.error("emergency save: deadline reached before tier %r got step %d", target.name, step)
                continue
            snap = snap or self._snapshot(step)
            if snap is None:
                continue
            if self._write(target, snap, local_only=target.collective and views is None):
                saved = True
                if on_commit is not None:
                    on_commit(target.name, snap.step)
                if views is not None:
                    apply_retention(target, protect.get(target.name))
        return step if saved else None

    def _agree(self, mine: _View) -> list[_View] | None:
        if self.group is None:
            return None
        try:
            return cast(
                list[_View],
                self.group.all_gather_object(mine, op="checkpoint.emergency", deadline=self._vote_deadline()),
            )
        except CollectiveError as err:
            log.error("emergency save: ranks could not agree (%s); saving this rank's copies alone", err)
            return None

    def _vote(self, yes: bool, step: int | None) -> bool:
        assert self.group is not None
        try:
            return self.group.all_true(yes, op="checkpoint.emergency.tier", step=step, deadline=self._vote_deadline())
        except CollectiveError as err:
            log.error("emergency save: vote on a collective tier failed (%s)", err)
            return False

    def _vote_deadline(self) -> Deadline:
        left = self.budget.remaining()
        return Deadline(None if left is None else max(left, VOTE_FLOOR))

    def _snapshot(self, step: int | None) -> StagedSnapshot | None:
        if step is None:
            return None
        for tier in self.ram:
            if tier.holds(step):
                return tier.read(step)
        log.error("emergency save: step %d left RAM before it could be saved", step)
        return None

    def _write(self, target: Tier, snap: StagedSnapshot, *, local_only: bool) -> bool:
        start = time.perf_counter()
        stats = self.stats.tiers[target.name]
        try:
            if local_only:  # peers may be gone: keep this rank's own copy, exchange nothing
                written = cast(CollectiveTier, target).write_local(snap, self.budget)
            else:
                written = target.write(snap, self.budget)
        except (OSError, CheckpointCorruptError, CollectiveError) as err:
            log.error(
                "emergency save of step %d to tier %r failed: %s", snap.step, target.name, stats.record_failure(err)
            )
            return False
        stats.record_write(snap.step, written.nbytes, time.perf_counter() - start)
        log.warning("emergency save: step %d committed to tier %r", snap.step, target.name)
        return True
