"""Certified steps: the verification state every committed step carries, and the rejection of steps a verdict reaches.

A step is captured with its verification state in its metadata (``meta["verification"]``, in every persistent tier's
manifest), given by the component that checks the state (SDC verification, through
:meth:`~lightning_resilience.checkpoint.manager.CheckpointManager.add_meta_provider`):

* ``verified`` — a clean check (a reconciliation of the replicas, a replay) covered the state of this step;
* ``unverified`` — no check has covered it yet (the steps between two checks), or nothing checks at all;
* ``rejected`` — a verdict found the state corrupt at or before this step, after the last clean check.

A verdict rejects the steps its evidence reaches on every rank and every tier, agreed like any decision (every rank
rejects at the same step boundary, from the same agreed step): :meth:`Tier.reject` takes the step out of the tier
for good (no restore, no retention slot) and, in a tier that outlives the process, leaves a small record of the
rejection in the step's directory (:data:`TOMBSTONE`), which ``lightning-resilience ckpt ls`` shows. A restore with
``checkpoint.resume=verified`` takes only verified steps; a tier named in ``checkpoint.verified_only`` is written
only with verified steps, so a durable store never publishes a step from an unverified window.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning_resilience._configurable import ConfigError, StrEnum

if TYPE_CHECKING:
    from lightning_resilience.checkpoint.tier import Tier

__all__ = [
    "TOMBSTONE",
    "VERIFICATION",
    "Verification",
    "check_verified_only",
    "publishable",
    "reject_newer",
    "tombstone",
    "verification_of",
]

log = logging.getLogger(__name__)

VERIFICATION = "verification"
"""The metadata key of a step's verification state."""
TOMBSTONE = "rejected.json"
"""The record a rejected step leaves in its step directory of a tier that outlives the process."""


class Verification(StrEnum):
    """The verification state of a committed step."""

    unverified = "unverified"
    verified = "verified"
    rejected = "rejected"


def verification_of(meta: Mapping[str, Any]) -> Verification:
    """The state a step's metadata records (``unverified`` when nothing recorded one)."""
    value = meta.get(VERIFICATION)
    if isinstance(value, str) and value in Verification.__members__:
        return Verification(value)
    return Verification.verified if meta.get("sdc_verified") is True else Verification.unverified


def tombstone(step: int, reason: str) -> bytes:
    """The record of a rejection, as written next to the step's shards."""
    record = {"step": step, VERIFICATION: Verification.rejected.value, "reason": reason, "rejected_at": time.time()}
    return json.dumps(record, sort_keys=True).encode()


def check_verified_only(verified_only: Collection[str], names: Sequence[str]) -> None:
    """``checkpoint.verified_only`` names tiers of this job."""
    unknown = sorted(set(verified_only) - set(names))
    if unknown:
        raise ConfigError("checkpoint", "verified_only", f"names no tier of this job: {unknown} (tiers: {list(names)})")


def publishable(verified_only: Collection[str], tiers: list[Tier], step: int, meta: Mapping[str, Any]) -> list[Tier]:
    """``tiers`` without those that take verified steps only when ``step`` is not verified."""
    if not verified_only or verification_of(meta) is Verification.verified:
        return tiers
    return [t for t in tiers if t.name not in verified_only]


def reject_newer(tiers: Sequence[Tier], newer_than: int, reason: str) -> list[int]:
    """Reject every step newer than ``newer_than`` in every tier of this rank (a verdict found the state corrupt
    after the last step verified clean): each tier takes them out for good and records why. Collective in that every
    rank calls it at the same decision. Returns the steps rejected on this rank."""
    rejected: set[int] = set()
    for tier in tiers:
        for step in tier.list_steps():
            if step > newer_than:
                try:
                    tier.reject(step, reason)
                except OSError as err:  # a store that is down: the step stays, refused at restore by the bound
                    log.error("tier %r could not reject step %d: %s", tier.name, step, err)
                    continue
                rejected.add(step)
    if rejected:
        log.warning("rejected steps %s in every tier (%s)", sorted(rejected), reason)
    return sorted(rejected)
