"""The exchange of timings between ranks: one small all-gather per exchange over a side gloo group, from host values.

Every rank contributes one :data:`Payload` and receives every rank's; the detector then computes the same verdicts
on every rank from the same gathered records, so no further collective is needed to agree on them. The exchange
never touches the training process group (NCCL on GPUs) and never reads a device tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_resilience.collective import CollectiveError, SideGroup

__all__ = ["GatherFn", "GlooGather", "Payload", "StragglerGatherError", "gloo_gather"]

Payload = dict[str, Any]
"""One rank's record for one exchange: ``{"rank", "host", "local_world_size", "times": {section: seconds}}``."""
GatherFn = Callable[[Payload], Sequence[Payload]]
"""All-gather of one payload per rank; every rank gets every rank's payload."""

OP = "straggler.exchange"


class StragglerGatherError(CollectiveError):
    """The exchange of timings did not complete: a rank is hung, gone, or far behind."""


class GlooGather:
    """All-gather of payloads over ``group`` (the detector's :class:`~lightning_resilience.collective.SideGroup`;
    its timeout bounds every wait).

    The first exchange all-gathers the whole payloads as objects (host names, ranks per node, section names); later
    ones all-gather only a float64 tensor of the times, in the section order of the first exchange (the same on
    every rank: it comes from the shared configuration). A payload whose sections differ from the first one's goes
    back to objects; since every rank's sections come from the same configuration, all ranks take the same path.
    """

    def __init__(self, group: SideGroup) -> None:
        self.group = group
        self._first: list[Payload] | None = None
        self._keys: list[str] = []

    def __call__(self, payload: Payload) -> Sequence[Payload]:
        keys = sorted(payload["times"])
        if self._first is None or keys != self._keys:
            out = self.group.all_gather_object(payload, op=OP)
            if self._first is None:
                self._first, self._keys = out, keys
            return out
        local = torch.tensor([float(payload["times"][k]) for k in keys], dtype=torch.float64)
        parts = self.group.all_gather_tensor(local, op=OP)
        return [{**first, "times": dict(zip(keys, part.tolist()))} for first, part in zip(self._first, parts)]


def gloo_gather(group: SideGroup) -> GatherFn:
    """An all-gather of payloads over ``group`` (a side gloo group); see :class:`GlooGather`."""
    return GlooGather(group)
