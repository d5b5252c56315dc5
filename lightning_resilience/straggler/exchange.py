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

import functools
import json
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from lightning_resilience.collective import CollectiveError, SideGroup
from lightning_resilience.links import Blob
from lightning_resilience.step.agreement import unframe, unframe_uniform

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
    text = _text(str(payload.get("host", "")), tuple(sections))
    head = _HEAD.pack(
        _MAGIC, int(payload["rank"]), int(payload.get("local_world_size") or 0), len(steps), len(sections), len(text)
    )
    values = np.array([[row.get(name, math.nan) for name in sections] for row in times], dtype="<f4")
    return head + text + np.array(steps, dtype="<i8").tobytes() + values.tobytes()


@functools.lru_cache(maxsize=16)
def _text(host: str, sections: tuple[str, ...]) -> bytes:
    """The payload's JSON text: the same at every exchange of a rank (made once, not on each exchange step)."""
    return json.dumps({"host": host, "sections": list(sections)}, separators=(",", ":")).encode()


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

    def measured(self, sections: Sequence[str]) -> np.ndarray:
        """Per sample, whether every rank measured every one of ``sections`` (a value >= 0; not NaN)."""
        picked = self._picked(sections, 0, None)
        return (
            np.zeros(self.times.shape[1], dtype=bool) if picked is None else np.asarray((picked >= 0).all(axis=(0, 2)))
        )

    def block(self, start: int, sections: Sequence[str], stop: int | None = None) -> np.ndarray | None:
        """Every rank's seconds of ``sections`` at the samples from ``start`` (up to ``stop``): samples x sections x
        ranks (None: no rank sent one of them)."""
        picked = self._picked(sections, start, stop)
        return None if picked is None else np.ascontiguousarray(picked.transpose(1, 2, 0))

    def _picked(self, sections: Sequence[str], start: int, stop: int | None) -> np.ndarray | None:
        """ranks x samples x ``sections`` (None: no rank sent one of them)."""
        if not set(sections) <= set(self.sections):
            return None
        return self.times[:, start:stop, [self.sections.index(name) for name in sections]]


_Block = tuple[np.ndarray, np.ndarray, list[str], tuple[str, ...], np.ndarray, np.ndarray]
"""Records of one layout: ranks (n), ranks per node (n), hosts, sections, steps (n x k), times (n x k x sections)."""


def _malformed(err: Exception) -> StragglerGatherError:
    return StragglerGatherError(f"straggler: a malformed payload arrived in the exchange of timings ({err})")


def _read(data: Blob, texts: dict[bytes, tuple[str, tuple[str, ...]]]) -> _Block:
    """One encoded payload (``texts``: the JSON texts read so far, shared by the ranks of a node)."""
    try:
        magic, rank, lws, n_steps, n_sections, size = _HEAD.unpack_from(data, 0)
        if magic != _MAGIC:
            raise ValueError(f"not a payload of timings (starts {bytes(data[:4])!r})")
        at = _HEAD.size + size
        if len(data) != at + n_steps * (8 + 4 * n_sections):
            raise ValueError(f"{len(data)} bytes for {n_steps} steps of {n_sections} sections")
        meta = _meta(bytes(data[_HEAD.size : at]), texts)
        if len(meta[1]) != n_sections:
            raise ValueError("its text lacks the sections")
        steps = np.frombuffer(data, dtype="<i8", count=n_steps, offset=at)
        times = np.frombuffer(data, dtype="<f4", count=n_steps * n_sections, offset=at + 8 * n_steps)
    except (ValueError, struct.error, TypeError, AttributeError, KeyError) as err:
        raise _malformed(err) from err
    return (
        np.array([rank]), np.array([lws]), [meta[0]], meta[1], steps[None], times.reshape(1, n_steps, n_sections)
    )  # fmt: skip


def _meta(key: bytes, texts: dict[bytes, tuple[str, tuple[str, ...]]]) -> tuple[str, tuple[str, ...]]:
    """The host and the section names of a payload's JSON text, read once (``texts``: those read before)."""
    meta = texts.get(key)
    if meta is None:
        text = json.loads(key)
        sections = text["sections"]
        if not isinstance(sections, list):
            raise ValueError("its text lacks the sections")
        meta = texts[key] = (str(text.get("host", "")), tuple(str(name) for name in sections))
    return meta


def decode_payload(data: Blob) -> Payload:
    """The payload :func:`encode_payload` made (raises :class:`StragglerGatherError` for anything else)."""
    ranks, lws, hosts, sections, steps, times = _read(data, {})
    rows = [dict(zip(sections, map(float, row))) for row in times[0]]
    return {"rank": int(ranks[0]), "host": hosts[0], "local_world_size": int(lws[0]), "steps": steps[0].tolist(),
            "times": rows}  # fmt: skip


def _read_uniform(
    ranks: np.ndarray, bodies: np.ndarray, texts: dict[bytes, tuple[str, tuple[str, ...]]]
) -> _Block | None:
    """Records of one layout (the same counts and length: one config, host names of one length) read as arrays,
    one JSON text a node, none read before (``texts``); None for anything else (read record by record)."""
    n, width = bodies.shape
    if n == 0 or width < _HEAD.size:
        return None
    magic, _, _, n_steps, n_sections, size = _HEAD.unpack_from(bodies[0].tobytes(), 0)
    at = _HEAD.size + size
    same = bodies[:, 12 : _HEAD.size] == bodies[0, 12 : _HEAD.size]  # the counts and the text's length
    if magic != _MAGIC or width != at + n_steps * (8 + 4 * n_sections) or not bool(same.all()):
        return None
    if not bool((bodies[:, :4] == bodies[0, :4]).all()):
        return None
    fields = np.ascontiguousarray(bodies[:, 4:12]).view("<i4")  # rank, local_world_size
    if not np.array_equal(fields[:, 0], ranks):
        return None
    keys, which = np.unique(
        np.ascontiguousarray(bodies[:, _HEAD.size : at]).view(f"V{size}").ravel(), return_inverse=True
    )
    try:
        metas = [_meta(key, texts) for key in keys.tolist()]
    except (ValueError, KeyError, TypeError, AttributeError):  # read record by record, which names what is wrong
        return None
    if len({sections for _, sections in metas}) != 1 or len(metas[0][1]) != n_sections:
        return None
    hosts = [metas[j][0] for j in which.tolist()]
    steps = np.ascontiguousarray(bodies[:, at : at + 8 * n_steps]).view("<i8")
    times = np.ascontiguousarray(bodies[:, at + 8 * n_steps :]).view("<f4").reshape(n, n_steps, n_sections)
    return fields[:, 0].astype(np.int64), fields[:, 1].astype(np.int64), hosts, metas[0][1], steps, times


def _table(blocks: list[_Block]) -> Table:
    sections: dict[str, None] = {}
    for block in blocks:
        if block[3] != tuple(sections):
            sections.update(dict.fromkeys(block[3]))
    names = tuple(sections)
    samples = min((b[5].shape[1] for b in blocks), default=0)
    ranks = np.concatenate([b[0] for b in blocks]) if blocks else np.empty(0, np.int64)
    order = np.argsort(ranks, kind="stable")
    times = np.full((len(ranks), samples, len(names)), np.nan)
    at = 0
    for _, _, _, own, _, values in blocks:
        rows = slice(at, at + len(values))
        at += len(values)
        if own == names:
            times[rows] = values[:, :samples]
        else:  # a rank that timed other sections (never with one config): its columns where they belong
            for k, name in enumerate(own):
                times[rows, :, names.index(name)] = values[:, :samples, k]
    hosts = [h for b in blocks for h in b[2]]
    lws = np.concatenate([b[1] for b in blocks]) if blocks else np.empty(0, np.int64)
    steps = np.concatenate([b[4][:, :samples] for b in blocks])[order[0]].tolist() if len(ranks) else []
    return Table(
        ranks=ranks[order].tolist(),
        hosts=[hosts[i] for i in order.tolist()],
        local_world_sizes=lws[order].tolist(),
        steps=steps,
        sections=names,
        times=times[order],
    )


def table_of(payloads: Sequence[Payload]) -> Table:
    """The :class:`Table` of payloads as dicts (the all-gather's, simulations')."""
    blocks: list[_Block] = []
    for p in payloads:
        rows = p["times"]
        names = tuple(rows[0]) if rows else ()
        values = np.array([[float(row.get(n, math.nan)) for n in names] for row in rows], dtype=np.float64)
        steps = np.asarray([int(s) for s in p.get("steps") or []], dtype=np.int64)
        blocks.append(
            (np.array([int(p["rank"])]), np.array([int(p.get("local_world_size") or 0)]), [str(p.get("host", ""))],
             names, steps[None], values.reshape(1, len(rows), len(names)))
        )  # fmt: skip
    return _table(blocks)


def decode_gathered(blobs: Sequence[Blob], texts: dict[bytes, tuple[str, tuple[str, ...]]] | None = None) -> Table:
    """Every rank's payload of one exchange, from the blobs the tree brought to rank 0, as a :class:`Table` (read
    where the scoring runs: the work grows with N; a blob of records of one layout, the usual case, is read as
    one array, else a few NumPy calls a record).

    ``texts``: the JSON texts (host, sections) read at earlier exchanges, kept by the caller and added to here. They
    are the same at every exchange, so each is parsed once per run, not once per exchange (at 16,384 ranks, 2,048
    hosts: about 90 ms an exchange)."""
    blocks: list[_Block] = []
    texts = {} if texts is None else texts
    for blob in blobs:
        uniform = unframe_uniform(blob)
        block = _read_uniform(*uniform, texts) if uniform is not None else None
        if block is not None:
            blocks.append(block)
            continue
        try:
            records = unframe([blob])
        except ValueError as err:
            raise StragglerGatherError(f"straggler: the exchange of timings arrived malformed ({err})") from err
        blocks += [_read(body, texts) for _, body in records]
    table = _table(blocks)
    if len(texts) > 2 * len(table.ranks) + 16:  # more texts kept than the ranks have (hosts renamed): start over
        texts.clear()
    return table


def node_layout(hosts: Sequence[str], local_world_sizes: Sequence[int], world_size: int) -> tuple[list[str], list[int]]:
    """Every rank's host name and node index, from one exchange (in rank order): ranks per node where every rank
    says the same ``local_world_size``, else by host name in order of appearance."""
    nodes = [str(h) for h in hosts]
    lws = [int(n or 0) for n in local_world_sizes]
    if all(lws) and len(set(lws)) == 1:
        return nodes, [rank // lws[0] for rank in range(world_size)]
    order: dict[str, int] = {}
    return nodes, [order.setdefault(host, len(order)) for host in nodes]
