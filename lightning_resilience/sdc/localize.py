"""Localisation by vote: several opinions about one computation (the original result, replays on the same rank,
replays on other ranks, replica digests); the majority is taken as the truth and the ranks that disagree with it
are named. A rank that disagrees only sometimes had a transient fault; one that always disagrees is faulty.

The rule that names a culprit (SCOUT's): a rank is blamed only

* by a strict majority of at least three equivalent devices against it (a **persistent** fault: every opinion of
  the rank is outside the majority), or
* by its own deterministic replay reproducing the reference another device computed, while its original result
  does not (a **transient** fault: the rank is on both sides).

With two devices whose opinions split one against one, nothing says which one is wrong: the verdict is
*inconclusive* and names no rank (the state is still rejected: a stop or a rollback). A device counts once however
many times it computed, so a faulty device reproducing its own wrong answer never outvotes a healthy one. With one
process (one device), its opinions are counted instead: an original against two agreeing replays is transient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lightning_resilience.sdc.verdict import Diagnosis

__all__ = ["Ballot", "Opinion", "next_device", "vote"]


@dataclass(frozen=True)
class Opinion:
    """What ``rank`` computed (``kind``: 'original', 'replay' or 'replica'), as a digest."""

    rank: int
    kind: str
    digest: torch.Tensor


@dataclass
class Ballot:
    """The outcome of a vote."""

    decided: bool
    """A strict majority of the opinions agree (with at least two opinions)."""
    majority: list[int] = field(default_factory=list)
    """Indices of the opinions in the majority."""
    dissent: list[int] = field(default_factory=list)
    """Indices of the opinions outside it."""
    transient: list[int] = field(default_factory=list)
    """Ranks with at least one opinion in and one outside the majority."""
    persistent: list[int] = field(default_factory=list)
    """Ranks whose every opinion is outside the majority."""
    undecided_ranks: list[int] = field(default_factory=list)
    """Ranks involved in a disagreement no majority settles (never blamed: see the module's rule)."""

    @property
    def suspects(self) -> list[int]:
        """The ranks the evidence names (none for an inconclusive vote)."""
        return sorted({*self.transient, *self.persistent})

    @property
    def verdict(self) -> Diagnosis:
        if not self.decided:
            return Diagnosis.INCONCLUSIVE
        if self.persistent:
            return Diagnosis.PERSISTENT
        if self.transient:
            return Diagnosis.TRANSIENT
        return Diagnosis.CLEAN


def vote(opinions: Sequence[Opinion], equal: Callable[[torch.Tensor, torch.Tensor], bool]) -> Ballot:
    """Cluster the opinions by ``equal``; the cluster backed by a strict majority of the devices wins.

    A device counts once however many times it computed (a faulty device reproducing its own wrong answer must not
    outvote a healthy one); only when every opinion comes from one device are opinions counted instead.
    """
    clusters: list[list[int]] = []
    for i, op in enumerate(opinions):
        for cluster in clusters:
            if equal(opinions[cluster[0]].digest, op.digest):
                cluster.append(i)
                break
        else:
            clusters.append([i])
    if len(clusters) <= 1:
        return Ballot(decided=len(opinions) >= 2, majority=list(range(len(opinions))))
    devices = {op.rank for op in opinions}

    def weight(cluster: list[int]) -> int:
        return len(cluster) if len(devices) == 1 else len({opinions[i].rank for i in cluster})

    total = len(opinions) if len(devices) == 1 else len(devices)
    largest = max(clusters, key=weight)
    if weight(largest) * 2 <= total or len(largest) < 2:
        return Ballot(decided=False, undecided_ranks=sorted(devices))
    dissent = [i for i in range(len(opinions)) if i not in largest]
    in_majority = {opinions[i].rank for i in largest}
    out = {opinions[i].rank for i in dissent}
    # the rule: a rank only outside the majority is named by at least three devices (two split one against one)
    assert not (out - in_majority) or len(devices) == 1 or len(devices) >= 3
    return Ballot(
        decided=True,
        majority=list(largest),
        dissent=dissent,
        transient=sorted(out & in_majority),
        persistent=sorted(out - in_majority),
    )


def next_device(batch_rank: int, opinions: Sequence[Opinion], world_size: int, *, others: bool) -> int:
    """Who computes the next opinion on ``batch_rank``'s batch: a rank not heard yet (when ``others``), else the
    involved rank with the fewest opinions (a second try tells a transient glitch from a faulty device)."""
    heard = [op.rank for op in opinions]
    if others:
        for k in range(1, world_size):
            candidate = (batch_rank + k) % world_size
            if candidate not in heard:
                return candidate
    involved = sorted(set(heard) | {batch_rank}, key=lambda r: (heard.count(r), (r - batch_rank) % world_size))
    return involved[0]
