"""Resharding, agreement: the ranks choose a step together and load it only once every rank planned it, so the
number of agreements is the same on every rank whatever fails."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.layout import step_dirname
from lightning_resilience.checkpoint.reshard.load import Resharded, reshardable_steps, restore_resharded
from lightning_resilience.checkpoint.reshard.plan import plan_reshard
from lightning_resilience.checkpoint.tier import TierIdentity
from lightning_resilience.checkpoint.tree import DTensorRebuilder


def restore_resharded_agreed(
    roots: Mapping[str, str | Path],
    identity: TierIdentity,
    *,
    all_gather: Callable[[Any], list[Any]],
    all_true: Callable[[bool], bool],
    rebuild_dtensor: DTensorRebuilder | None = None,
    max_step: int | None = None,
    on_skip: Callable[[str], None] | None = None,
) -> tuple[str, Resharded] | None:
    """Collectively restore the newest step, written by another world size, that every rank can reshard.

    Every rank calls it with the same ``roots`` (tier name to directory, fastest first). Per tier: the ranks agree
    on the steps all of them see (``all_gather``); from the newest down, each rank plans the step
    (:func:`plan_reshard`, manifests and skeletons only) and the ranks agree that all plans succeeded
    (``all_true``) *before* any rank loads data; then each loads its slice, and the step is taken only if all
    loads succeeded. A refused or corrupt step is reported through ``on_skip`` and the next older one is tried.
    The number of collectives is the same on every rank whatever fails, so no rank is left waiting.

    Returns:
        (tier name, result), or None when no step of another world size can be restored everywhere.
    """
    skip = on_skip or (lambda message: None)
    for name, root in roots.items():
        local = [s for s in reshardable_steps(root, identity.world_size) if max_step is None or s <= max_step]
        common = set.intersection(*(set(steps) for steps in all_gather(local)))
        for step in sorted(common, reverse=True):
            plan = None
            try:
                plan = plan_reshard(Path(root) / step_dirname(step), identity.world_size)
            except CheckpointCorruptError as err:  # ReshardError included
                skip(f"cannot reshard step {step} of tier {name!r} to {identity.world_size} ranks: {err}")
            if not all_true(plan is not None):
                continue
            result = None
            try:
                result = restore_resharded(root, step, identity, rebuild_dtensor, plan=plan)
            except (CheckpointCorruptError, OSError) as err:  # every rank must reach the agreement below
                skip(f"skipping resharded step {step} of tier {name!r}: {err}")
            if all_true(result is not None):
                assert result is not None
                return name, result
    return None
