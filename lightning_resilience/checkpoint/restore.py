"""Collective restore: every rank loads the same step, the newest that all of them can load.

Each rank lists the committed steps of all its tiers; the candidates are the steps every rank has. From the newest
down, every rank looks for its shard in its fastest tier that has a loadable one, and the step is taken only if all
ranks found theirs (one agreement per candidate). Nothing is consumed before that agreement: a RAM tier is asked
whether it *holds* the step, and hands its buffers over only once every rank said yes, so a step another rank
refuses is still there for the next candidate. When no step is loadable at this world size (or a newer one was
written by a job of another size), the step is restored resharded (:mod:`lightning_resilience.checkpoint.reshard`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

from lightning_resilience.checkpoint.certify import Verification, verification_of
from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.content import check_content, without_print
from lightning_resilience.checkpoint.errors import CheckpointCorruptError, NoValidCheckpointError
from lightning_resilience.checkpoint.reshard import reshardable_steps, restore_resharded_agreed
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.stats import CheckpointStats, Restored
from lightning_resilience.checkpoint.tier import CollectiveTier, RamTier, Tier, TierIdentity
from lightning_resilience.checkpoint.tree import DTensorRebuilder, unflatten_state
from lightning_resilience.collective import SideGroup

__all__ = ["CollectiveRestore"]

log = logging.getLogger(__name__)


class CollectiveRestore:
    """The restore procedure of one :class:`~lightning_resilience.checkpoint.manager.CheckpointManager`.

    Args:
        tiers: all tiers, fastest first (:func:`~lightning_resilience.checkpoint.tier.restore_order`).
        group: the manager's side group (every agreement below runs on it, reached by every rank).
        identity: this rank and the world size.
        config: the engine's config (``if_none_valid``, ``allow_reshard``).
        stats: where restores and skipped checkpoints are recorded.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        group: SideGroup,
        identity: TierIdentity,
        config: CheckpointConfig,
        stats: CheckpointStats,
        clock: Callable[[], float],
    ) -> None:
        self.tiers = list(tiers)
        self.group = group
        self.identity = identity
        self.config = config
        self.stats = stats
        self.clock = clock
        self._in_process = False

    def run(
        self,
        step: int | None,
        max_step: int | None,
        rebuild_dtensor: DTensorRebuilder | None,
        *,
        in_process: bool = False,
    ) -> Restored | None:
        """``in_process``: an in-process rollback (no resharding; the resume figures in ``stats`` are left alone)."""
        start = self.clock()
        self._in_process = in_process
        self._prepare()
        where: dict[int, list[Tier]] = {}
        for tier in self.tiers:
            for s in tier.list_steps():
                where.setdefault(s, []).append(tier)
        gathered = self.group.all_gather_object(sorted(where), op="checkpoint.restore.steps")
        common = set.intersection(*(set(g) for g in gathered))
        anything = any(gathered)
        if step is not None:
            common &= {step}
        if max_step is not None:
            common = {s for s in common if s <= max_step}
        # a resharded step carries no verification of this world size's checks: resume=verified never reshards
        reshard = self.config.allow_reshard and not in_process and not self.config.verified_resume
        if step is None and common and reshard:
            # a newer step written by another world size (the job shrank or grew since) beats an older native one
            resharded = self._resharded(max_step, rebuild_dtensor, start, newer_than=max(common))
            if resharded is not None:
                return resharded
        for candidate in sorted(common, reverse=True):
            restored = self._try(candidate, where[candidate], rebuild_dtensor, start)
            if restored is not None:
                return restored
        if step is None and reshard:  # a step written by another world size?
            resharded = self._resharded(max_step, rebuild_dtensor, start)
            if resharded is not None:
                return resharded
        self._nothing(step, anything)
        return None

    def _prepare(self) -> None:
        """Collective tiers first make this rank's copies loadable (every rank calls each, in the same order)."""
        for tier in self.tiers:
            if not tier.collective:
                continue
            try:
                cast(CollectiveTier, tier).prepare_restore()
            except (OSError, RuntimeError, CheckpointCorruptError) as err:
                self._skip(f"tier {tier.name!r} could not prepare its copies for restore: {err}")

    def _try(
        self, candidate: int, tiers: list[Tier], rebuild_dtensor: DTensorRebuilder | None, start: float
    ) -> Restored | None:
        """Collective: load ``candidate`` if every rank can; None (on every rank) otherwise."""
        snap: StagedSnapshot | None = None
        source: Tier | None = None
        for tier in tiers:
            try:
                if not tier.ram:
                    snap, source = self._checked(tier, candidate), tier
                    break
                if cast(RamTier, tier).holds(candidate):  # taken only after the agreement below
                    source = tier
                    break
            except (CheckpointCorruptError, OSError) as err:  # every rank must reach the agreement below
                self._skip(f"skipping checkpoint step {candidate} in tier {tier.name!r}: {err}")
        agreed = self.group.all_true(source is not None, op="checkpoint.restore.load", step=candidate)
        if not agreed:
            if source is not None:
                log.warning("step %d is valid here but not on every rank; trying an older one", candidate)
            return None
        assert source is not None
        if snap is None:
            snap = cast(RamTier, source).take(candidate)  # RAM hands its buffers over instead of copying them
        elif not self._in_process:
            self._keep_in_memory(snap)
        state = unflatten_state(snap.skeleton, snap.tensors, rebuild_dtensor=rebuild_dtensor)
        elapsed = self.clock() - start
        if not self._in_process:  # the figures of a resume; an in-process rollback reports its own
            self.stats.restored_step, self.stats.restored_from, self.stats.restore_seconds = (
                candidate,
                source.name,
                elapsed,
            )
            self.stats.restored_at = time.time()
        log.info("restored step %d from tier %r in %.3fs", candidate, source.name, elapsed)
        return Restored(candidate, state, source.name, elapsed, without_print(snap.meta))

    def _checked(self, tier: Tier, step: int) -> StagedSnapshot:
        """``tier.read(step)``, refused when its tensors are not the step's state (its content print) or when only
        verified steps may be resumed and this one is not."""
        snap = tier.read(step)
        check_content(snap.tensors, snap.meta, step=step, where=f"tier {tier.name!r}")
        if self.config.verified_resume and not self._in_process:
            state = verification_of(snap.meta)
            if state is not Verification.verified:
                raise CheckpointCorruptError(f"tier {tier.name!r}: step {step} is {state} (checkpoint.resume=verified)")
        return snap

    def _keep_in_memory(self, snap: StagedSnapshot) -> None:
        """A step resumed from a persistent tier becomes a RAM snapshot too (a copy), so that a fault at the first
        step after the resume can be rolled back in the process (after an in-process rollback the step driver
        captures the restored state, quarantined batch included)."""
        for tier in self.tiers:
            if tier.ram and not cast(RamTier, tier).holds(snap.step):
                tier.write(snap)
                return

    def _resharded(
        self,
        max_step: int | None,
        rebuild_dtensor: DTensorRebuilder | None,
        start: float,
        newer_than: int | None = None,
    ) -> Restored | None:
        """Collective: restore the newest step that a job of another world size wrote, resharded for this one
        (only if it is newer than ``newer_than``, the best step loadable as it is)."""
        roots: dict[str, Path] = {}
        for tier in self.tiers:
            root = tier.reshard_root()
            if root is not None:
                roots[tier.name] = root
        if newer_than is not None:
            newer = any(
                s > newer_than and (max_step is None or s <= max_step)
                for root in roots.values()
                for s in reshardable_steps(root, self.identity.world_size)
            )
            if self.group.all_true(not newer, op="checkpoint.reshard.newer"):  # every rank takes the same path
                return None
        if not roots:
            return None
        found = restore_resharded_agreed(
            roots,
            self.identity,
            all_gather=lambda obj: self.group.all_gather_object(obj, op="checkpoint.reshard.steps"),
            all_true=lambda flag: self.group.all_true(flag, op="checkpoint.reshard.load"),
            rebuild_dtensor=rebuild_dtensor,
            max_step=max_step,
            on_skip=self._skip,
        )
        if found is None:
            return None
        name, res = found
        if newer_than is not None and res.step <= newer_than:
            return None  # the same on every rank: the agreed step is older than a native one
        elapsed = self.clock() - start
        self.stats.restored_step, self.stats.restored_from, self.stats.restore_seconds = res.step, name, elapsed
        self.stats.restored_at = time.time()
        log.warning(
            "restored step %d from tier %r, resharded from %d to %d ranks (per-rank RNG and data position taken "
            "from old rank new_rank %% %d: not an exact resume)",
            res.step,
            name,
            res.old_world_size,
            self.identity.world_size,
            res.old_world_size,
        )
        return Restored(res.step, res.state, name, elapsed, without_print(res.meta))

    def _nothing(self, step: int | None, anything: bool) -> None:
        if step is not None:
            raise NoValidCheckpointError(
                f"checkpoint step {step} is not loadable on every rank (see warnings above); "
                "pick another step or set checkpoint.resume=auto"
            )
        if anything:
            if self.config.if_none_valid == "fail":
                raise NoValidCheckpointError(
                    "checkpoints exist but none is valid on every rank (see warnings above); "
                    "fix or remove them, or set checkpoint.if_none_valid=start_fresh"
                )
            log.warning(
                "checkpoints exist but none is valid on every rank: starting fresh "
                "(checkpoint.if_none_valid=start_fresh)"
            )
        return None

    def _skip(self, msg: str) -> None:
        log.warning(msg)
        self.stats.skipped_corrupt.append(msg)
