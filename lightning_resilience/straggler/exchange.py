"""The exchange of timings between ranks, from host values: never on the training process group (NCCL on GPUs),
never a device tensor.

Along the step agreement's tree (:meth:`~lightning_resilience.step.agreement.TreeAgreement.gather`), each rank's
:data:`Payload` goes to rank 0 as a short JSON head (rank, node, steps, section names) and the timings as packed
float64 (:func:`encode_payload`: about 0.65 KB for 10 steps of 7 sections, where JSON took 2.2 KB: rank 0 receives N
of them every exchange); or, for a detector used on its own, by an all-gather to every rank (:class:`GlooGather`),
after which every rank computes the same verdicts from the same records.
"""

from __future__ import annotations

import json
import math
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Any, cast

from lightning_resilience.collective import CollectiveError, SideGroup
from lightning_resilience.step.agreement import unframe

__all__ = [
    "GatherFn",
    "GlooGather",
    "Payload",
    "StragglerGatherError",
    "decode_gathered",
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


_MAGIC = b"LRT1"
_HEAD = struct.Struct("<4sI")  # magic, the JSON head's length; then the head, then the timings


def encode_payload(payload: Payload) -> bytes:
    """A payload as bytes for the tree exchange: a JSON head (plain values only; nothing is unpickled on the way back)
    and the timings packed as float64, step by step in the head's section order (every row has the same sections)."""
    times = payload["times"]
    sections = list(times[0]) if times else []
    head = {k: v for k, v in payload.items() if k != "times"} | {"sections": sections}
    values = array("d", (float(row.get(name, math.nan)) for row in times for name in sections))
    if values.itemsize != 8:  # pragma: no cover - every CPython platform's C double
        raise RuntimeError("straggler: this platform's C double is not 8 bytes")
    text = json.dumps(head, separators=(",", ":")).encode()
    return _HEAD.pack(_MAGIC, len(text)) + text + values.tobytes()


def decode_payload(data: bytes) -> Payload:
    """The payload :func:`encode_payload` made (raises :class:`StragglerGatherError` for anything else)."""
    try:
        magic, size = _HEAD.unpack_from(data, 0)
        if magic != _MAGIC:
            raise ValueError(f"not a payload of timings (starts {bytes(data[:4])!r})")
        head = json.loads(bytes(data[_HEAD.size : _HEAD.size + size]))
        values = array("d")
        values.frombytes(bytes(data[_HEAD.size + size :]))
        sections, steps = head.pop("sections"), head.get("steps")
        if not isinstance(sections, list) or not isinstance(steps, list) or "rank" not in head:
            raise ValueError("its head lacks the rank, the steps or the sections")
        if len(values) != len(sections) * len(steps):
            raise ValueError(f"{len(values)} timings for {len(steps)} steps of {len(sections)} sections")
    except (ValueError, struct.error, TypeError, AttributeError, KeyError) as err:
        raise StragglerGatherError(
            f"straggler: a malformed payload arrived in the exchange of timings ({err})"
        ) from err
    n = len(sections)
    head["times"] = [dict(zip(sections, values[i * n : (i + 1) * n])) for i in range(len(steps))]
    return cast(Payload, head)


def decode_gathered(blobs: Sequence[bytes]) -> list[Payload]:
    """Every rank's payload of one exchange, in rank order, from the blobs the tree brought to rank 0 (read where the
    scoring runs: the work grows with N)."""
    try:
        records = unframe(blobs)
    except ValueError as err:
        raise StragglerGatherError(f"straggler: the exchange of timings arrived malformed ({err})") from err
    return [decode_payload(body) for _, body in records]


def node_layout(payloads: Sequence[Payload], world_size: int) -> tuple[list[str], list[int]]:
    """Every rank's host name and node index, from one exchange's payloads (in rank order): ranks per node where
    every rank says the same ``local_world_size``, else by host name in order of appearance."""
    nodes = [str(p.get("host", "")) for p in payloads]
    lws = [int(p.get("local_world_size") or 0) for p in payloads]
    if all(lws) and len(set(lws)) == 1:
        return nodes, [rank // lws[0] for rank in range(world_size)]
    order: dict[str, int] = {}
    return nodes, [order.setdefault(host, len(order)) for host in nodes]
