"""Retention: which committed steps a tier keeps, decided from what every rank has committed.

A tier keeps its newest ``keep`` steps and, always, the newest step that every rank has committed in it (the one a
collective restore would load): a rank whose newer writes failed never deletes the last step the job can resume
from. The ranks' views come from one agreement (:func:`committed_everywhere`), so every rank protects the same step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_resilience.checkpoint.tier import Tier

__all__ = ["apply_retention", "committed_everywhere", "missing_anywhere"]


def committed_everywhere(views: Sequence[Mapping[str, Sequence[int]]], names: Sequence[str]) -> dict[str, int | None]:
    """Per tier, the newest step that every rank's view lists (None when there is none)."""
    out: dict[str, int | None] = {}
    for name in names:
        common = set.intersection(*(set(view.get(name, ())) for view in views)) if views else set()
        out[name] = max(common) if common else None
    return out


def missing_anywhere(views: Sequence[Mapping[str, Sequence[int]]], name: str, step: int) -> bool:
    """True when some rank's view of tier ``name`` lacks ``step``."""
    return any(step not in view.get(name, ()) for view in views)


def apply_retention(tier: Tier, protected: int | None) -> list[int]:
    """Delete the tier's steps beyond its newest ``keep``, never ``protected``; returns the deleted steps."""
    steps = tier.list_steps()
    keep = set(steps[-tier.keep :])
    if protected is not None:
        keep.add(protected)  # the newest step every rank has committed is never deleted
    doomed = [step for step in steps if step not in keep]
    for step in doomed:
        tier.delete(step)
    return doomed
