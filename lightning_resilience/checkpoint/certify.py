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
import time
from collections.abc import Mapping
from typing import Any

from lightning_resilience._configurable import StrEnum

__all__ = ["TOMBSTONE", "VERIFICATION", "Verification", "tombstone", "verification_of"]

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
