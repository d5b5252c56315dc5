"""The exchange of timings between ranks, from host values: never on the training process group (NCCL on GPUs),
never a device tensor.

Along the step agreement's tree (:meth:`~lightning_resilience.step.agreement.TreeAgreement.gather`), each rank's
:data:`Payload` goes to rank 0 as JSON; or, for a detector used on its own, by an all-gather to every rank
(:class:`GlooGather`), after which every rank computes the same verdicts from the same records.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, cast

from lightning_resilience.collective import CollectiveError, SideGroup

__all__ = [
    "GatherFn",
    "GlooGather",
    "Payload",
    "StragglerGatherError",
    "decode_payload",
    "encode_payload",
    "gloo_gather",
    "node_layout",
]

Payload = dict[str, Any]
"""One rank's record for one exchange: ``{"rank", "host", "local_world_size", "steps": [step, ...], "times":
[{section: seconds}, ...]}`` (one entry per step since the previous exchange)."""
GatherFn = Callable[[Payload], Sequence[Payload]]
"""All-gather of one payload per rank; every rank gets every rank's payload."""

OP = "straggler.exchange"


class StragglerGatherError(CollectiveError):
    """The exchange of timings did not complete: a rank is hung, gone, or far behind."""


class GlooGather:
    """All-gather of payloads over ``group`` (the detector's :class:`~lightning_resilience.collective.SideGroup`;
    its timeout bounds every wait): every rank gets every rank's payload."""

    def __init__(self, group: SideGroup) -> None:
        self.group = group

    def __call__(self, payload: Payload) -> Sequence[Payload]:
        return cast(Sequence[Payload], self.group.all_gather_object(payload, op=OP))


def gloo_gather(group: SideGroup) -> GatherFn:
    """An all-gather of payloads over ``group`` (a side gloo group); see :class:`GlooGather`."""
    return GlooGather(group)


def encode_payload(payload: Payload) -> bytes:
    """A payload as bytes for the tree exchange: JSON (plain values only; nothing is unpickled on the way back)."""
    return json.dumps(payload, separators=(",", ":")).encode()


def decode_payload(data: bytes) -> Payload:
    payload = json.loads(data)
    if not isinstance(payload, dict) or "rank" not in payload or not isinstance(payload.get("times"), list):
        raise StragglerGatherError("straggler: a malformed payload arrived in the exchange of timings")
    return payload


def node_layout(payloads: Sequence[Payload], world_size: int) -> tuple[list[str], list[int]]:
    """Every rank's host name and node index, from one exchange's payloads (in rank order): ranks per node where
    every rank says the same ``local_world_size``, else by host name in order of appearance."""
    nodes = [str(p.get("host", "")) for p in payloads]
    lws = [int(p.get("local_world_size") or 0) for p in payloads]
    if all(lws) and len(set(lws)) == 1:
        return nodes, [rank // lws[0] for rank in range(world_size)]
    order: dict[str, int] = {}
    return nodes, [order.setdefault(host, len(order)) for host in nodes]
