"""The exchange of timings between ranks, from host values: never on the training process group (NCCL on GPUs),
never a device tensor.

Along the step agreement's tree (:meth:`~lightning_resilience.step.agreement.TreeAgreement.gather`), each rank's
:data:`Payload` goes to rank 0 as a binary head (rank, ranks per node, counts), a short JSON text (host, section
names: the same on every rank of a node) and the steps and timings packed (:func:`encode_payload`: about 0.45 KB for
10 steps of 7 sections, where JSON took 2.2 KB: rank 0 receives N of them every exchange). Rank 0's scorer reads an
exchange into one array (:func:`decode_gathered`, a :class:`Table`): a few NumPy calls a record, one JSON text read
a node. Or, for a detector used on its own, the payloads go by an all-gather to every rank (:class:`GlooGather`),
after which every rank computes the same verdicts from the same records (:func:`table_of`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from lightning_resilience.collective import CollectiveError, SideGroup
from lightning_resilience.links import Blob
from lightning_resilience.step.agreement import unframe

__all__ = [
    "GatherFn",
    "GlooGather",
    "Payload",
    "StragglerGatherError",
    "Table",
    "decode_gathered",
    "decode_payload",
    "encode_payload",
    "gloo_gather",
    "node_layout",
    "table_of",
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


_MAGIC = b"LRT2"
_HEAD = struct.Struct("<4siiHHI")  # magic, rank, local_world_size, steps, sections, the text's length
# then the text (JSON: the host and the section names, the same on every rank of a node), the steps as int64 and the
# timings as float32 (seconds to 7 significant digits: a microsecond in a 10 s step), step by step in the text's
# section order


def encode_payload(payload: Payload) -> bytes:
    """A payload as bytes for the tree exchange: a binary head, a short JSON text (plain values only; nothing is
    unpickled on the way back) that every rank of a node shares, the steps and the timings packed (every row has
    the same sections)."""
    times, steps = payload["times"], [int(s) for s in payload["steps"]]
    if len(times) != len(steps):
        raise ValueError(f"straggler: {len(times)} rows of timings for {len(steps)} steps")
    sections = list(times[0]) if times else []
    text = json.dumps({"host": str(payload.get("host", "")), "sections": sections}, separators=(",", ":")).encode()
    head = _HEAD.pack(
        _MAGIC, int(payload["rank"]), int(payload.get("local_world_size") or 0), len(steps), len(sections), len(text)
    )
    values = np.array([[row.get(name, math.nan) for name in sections] for row in times], dtype="<f4")
    return head + text + np.array(steps, dtype="<i8").tobytes() + values.tobytes()


@dataclass(frozen=True)
class Table:
    """One exchange as arrays, every rank's record in rank order: what the scoring reads (built from the blobs
    with a few NumPy calls a record, never a Python object per timing)."""

    ranks: list[int]
    hosts: list[str]
    local_world_sizes: list[int]
    steps: list[int]
    """The first rank's steps, cut to the samples every rank has."""
    sections: tuple[str, ...]
    times: np.ndarray
    """Seconds, ranks x samples x sections; NaN where a rank did not time a section."""

    def column(self, sample: int, section: str) -> np.ndarray | None:
        """Every rank's seconds of ``section`` at ``sample`` (None: no rank sent the section)."""
        if section not in self.sections:
            return None
        return self.times[:, sample, self.sections.index(section)]


_Record = tuple[int, int, str, tuple[str, ...], np.ndarray, np.ndarray]  # rank, lws, host, sections, steps, times


def _malformed(err: Exception) -> StragglerGatherError:
    return StragglerGatherError(f"straggler: a malformed payload arrived in the exchange of timings ({err})")


def _read(data: Blob, texts: dict[bytes, tuple[str, tuple[str, ...]]]) -> _Record:
    """One encoded payload (``texts``: the JSON texts read so far, shared by the ranks of a node)."""
    try:
        magic, rank, lws, n_steps, n_sections, size = _HEAD.unpack_from(data, 0)
        if magic != _MAGIC:
            raise ValueError(f"not a payload of timings (starts {bytes(data[:4])!r})")
        at = _HEAD.size + size
        if len(data) != at + n_steps * (8 + 4 * n_sections):
            raise ValueError(f"{len(data)} bytes for {n_steps} steps of {n_sections} sections")
        key = bytes(data[_HEAD.size : at])
        meta = texts.get(key)
        if meta is None:
            text = json.loads(key)
            sections = text["sections"]
            if not isinstance(sections, list) or len(sections) != n_sections:
                raise ValueError("its text lacks the sections")
            meta = texts[key] = (str(text.get("host", "")), tuple(str(name) for name in sections))
        steps = np.frombuffer(data, dtype="<i8", count=n_steps, offset=at)
        times = np.frombuffer(data, dtype="<f4", count=n_steps * n_sections, offset=at + 8 * n_steps)
    except (ValueError, struct.error, TypeError, AttributeError, KeyError) as err:
        raise _malformed(err) from err
    return rank, lws, meta[0], meta[1], steps, times.reshape(n_steps, n_sections)


def decode_payload(data: Blob) -> Payload:
    """The payload :func:`encode_payload` made (raises :class:`StragglerGatherError` for anything else)."""
    rank, lws, host, sections, steps, times = _read(data, {})
    rows = [dict(zip(sections, map(float, row))) for row in times]
    return {"rank": rank, "host": host, "local_world_size": lws, "steps": steps.tolist(), "times": rows}


def _table(records: list[_Record]) -> Table:
    records.sort(key=lambda r: r[0])
    sections: dict[str, None] = {}
    for record in records:
        if record[3] != tuple(sections):
            sections.update(dict.fromkeys(record[3]))
    names = tuple(sections)
    samples = min((len(r[5]) for r in records), default=0)
    times = np.full((len(records), samples, len(names)), np.nan)
    for i, (_, _, _, own, _, values) in enumerate(records):
        if own == names:
            times[i] = values[:samples]
        else:  # a rank that timed other sections (never with one config): its columns where they belong
            for k, name in enumerate(own):
                times[i, :, names.index(name)] = values[:samples, k]
    return Table(
        ranks=[r[0] for r in records],
        hosts=[r[2] for r in records],
        local_world_sizes=[r[1] for r in records],
        steps=records[0][4][:samples].tolist() if records else [],
        sections=names,
        times=times,
    )


def table_of(payloads: Sequence[Payload]) -> Table:
    """The :class:`Table` of payloads as dicts (the all-gather's, simulations')."""
    records: list[_Record] = []
    for p in payloads:
        rows = p["times"]
        names = tuple(rows[0]) if rows else ()
        values = np.array([[float(row.get(n, math.nan)) for n in names] for row in rows], dtype=np.float64)
        steps = np.asarray([int(s) for s in p.get("steps") or []], dtype=np.int64)
        records.append(
            (int(p["rank"]), int(p.get("local_world_size") or 0), str(p.get("host", "")), names, steps,
             values.reshape(len(rows), len(names)))
        )  # fmt: skip
    return _table(records)


def decode_gathered(blobs: Sequence[Blob]) -> Table:
    """Every rank's payload of one exchange, from the blobs the tree brought to rank 0, as a :class:`Table` (read
    where the scoring runs: the work grows with N, a few NumPy calls a record)."""
    try:
        records = unframe(blobs)
    except ValueError as err:
        raise StragglerGatherError(f"straggler: the exchange of timings arrived malformed ({err})") from err
    texts: dict[bytes, tuple[str, tuple[str, ...]]] = {}
    return _table([_read(body, texts) for _, body in records])


def node_layout(hosts: Sequence[str], local_world_sizes: Sequence[int], world_size: int) -> tuple[list[str], list[int]]:
    """Every rank's host name and node index, from one exchange (in rank order): ranks per node where every rank
    says the same ``local_world_size``, else by host name in order of appearance."""
    nodes = [str(h) for h in hosts]
    lws = [int(n or 0) for n in local_world_sizes]
    if all(lws) and len(set(lws)) == 1:
        return nodes, [rank // lws[0] for rank in range(world_size)]
    order: dict[str, int] = {}
    return nodes, [order.setdefault(host, len(order)) for host in nodes]
