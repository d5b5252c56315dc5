"""Cross-replica reconciliation: after the optimizer step, data-parallel replicas must hold bit-identical parameters
and optimizer state. Each rank digests its own (a few int64 per tensor). With an exact (bitwise) digest the ranks
first agree on a 62-bit hash of their digests in one small all-reduce (its smallest and largest value): equal
everywhere, the replicas are equal and nothing else travels, so a clean round costs every rank the same at 2 ranks
and at 10,000. Only when the hashes differ (or with a tolerance digest, which has no exact hash) are the digests
all-gathered, and a vote names the replica that differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from lightning_resilience.sdc.fingerprint import Digest, digest_all
from lightning_resilience.sdc.localize import Ballot, Opinion, vote

__all__ = ["ReplicaReconciler", "digest_key"]

KEY_BITS = 62
"""Width of the hash the ranks agree on: its negation fits an int64 too (a MIN is the negated MAX)."""


def digest_key(digests: torch.Tensor) -> int:
    """A 62-bit hash of a stack of exact digests and its shape (a different state layout hashes differently)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(tuple(digests.shape)).encode())
    h.update(digests.detach().cpu().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") & ((1 << KEY_BITS) - 1)


class ReplicaReconciler:
    """Digests of one replica's parameters and optimizer state, and the vote over all replicas' digests.

    Args:
        named_params: ``(name, parameter)`` pairs of the replicated model.
        optimizers: optimizers whose state is replicated (plain data parallelism: every rank holds all of it).
        digest: how tensors are digested (bitwise: any flipped bit differs).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        optimizers: Sequence[torch.optim.Optimizer],
        digest: Digest,
    ) -> None:
        self.named_params = list(named_params)
        self.optimizers = list(optimizers)
        self.digest = digest
        self.rounds = 0

    def _tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        names, tensors = [], []
        ids = {id(p): n for n, p in self.named_params}
        for name, p in self.named_params:
            names.append(name)
            tensors.append(p.detach())
        for i, opt in enumerate(self.optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    for key, value in sorted(opt.state.get(p, {}).items()):
                        if isinstance(value, torch.Tensor):
                            names.append(f"optim{i}.{ids.get(id(p), '?')}.{key}")
                            tensors.append(value.detach())
        return names, tensors

    def local(self) -> tuple[list[str], torch.Tensor]:
        """Names and digests (``[n, width]``) of this replica's tensors."""
        names, tensors = self._tensors()
        return names, digest_all(self.digest, tensors)

    def reconcile(
        self,
        all_gather: Callable[[torch.Tensor], list[torch.Tensor]],
        all_same: Callable[[int], bool] | None = None,
    ) -> tuple[Ballot, list[str]]:
        """Collective: compare every replica's digests and vote. Returns the ballot and the tensors that differ.

        Args:
            all_gather: every rank's digests (called only when the hashes differ, or without ``all_same``).
            all_same: whether every rank holds this key (one all-reduce); used when the digest is exact. Every rank
                gets the same answer, so every rank takes the same path.
        """
        names, mine = self.local()
        self.rounds += 1
        if all_same is not None and self.digest.exact and all_same(digest_key(mine)):
            return Ballot(decided=True), []  # unanimous: no opinion needed to travel
        gathered = all_gather(mine)
        opinions = [Opinion(rank, "replica", d) for rank, d in enumerate(gathered)]
        if len({tuple(d.shape) for d in gathered}) > 1:  # different state layouts: nothing to compare row by row
            return vote(opinions, self.digest.equal), ["<state layout differs between replicas>"]
        ballot = vote(opinions, self.digest.equal)
        differing: list[str] = []
        if ballot.dissent or not ballot.decided:
            ref = gathered[ballot.majority[0]] if ballot.decided else gathered[0]
            for d in gathered:
                for row, name in enumerate(names):
                    if not self.digest.equal(d[row], ref[row]) and name not in differing:
                        differing.append(name)
        return ballot, differing
