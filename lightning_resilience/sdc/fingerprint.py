"""Cheap tensor digests: a few numbers per tensor that change when any bit of the tensor changes.

A bitwise digest views the raw bits of each element as a signed integer of the same width and keeps three wrapping
int64 sums over the tensor laid out as rows of 256 elements: of all the integers, of the row sums weighted by row
number, and of the column sums weighted by column number (two reads of the tensor, no copy). Flipping bit ``k`` of
one element moves the first sum by exactly ``±2**k`` (never 0 mod 2**64), so every single-bit flip changes the
digest, whatever the dtype; the weighted sums move by that amount times the element's row and column, so two
different corruptions (the same bit of two elements) do not share a digest, which a vote between corrupted opinions
needs. Digests are per tensor: compare a DDP bucket's content through the gradient views it holds, not as one buffer.

A tolerance digest (for kernels that are not bitwise reproducible) keeps the float64 sum, sum of squares and largest
magnitude instead; two digests match when they are close within ``rtol``/``atol``.

A digest is computed where the tensor lives and stays there: :func:`digest_all` stacks many and reads them to the host
with one copy, so a check costs one host read however many tensors it covers. The bitwise digests of many small
tensors are computed together (:meth:`BitwiseDigest.compute_many`): laid end to end, each padded with zeros to whole
rows (which moves none of its sums), a few passes over the lot give every tensor's three sums, the same bits as one
tensor at a time, in a number of operations that does not grow with the number of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from lightning_resilience._staging import to_host

__all__ = ["BitwiseDigest", "Digest", "ToleranceDigest", "make_digest"]

BATCH_ELEMENTS = 1 << 22
"""Tensors below this many elements are digested together, in batches of at most this many (an int64 copy of a batch:
32 MiB); a larger one is digested alone, without a copy."""
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Digest(Protocol):
    """Computes, combines and compares per-tensor digests (rows of a ``[n, width]`` tensor)."""

    width: int
    exact: bool
    """Equal digests are equal bits: two stacks are equal exactly when their bytes are (a hash of them can stand in
    for them in an agreement between ranks)."""

    def compute(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """The digest of one tensor, shape ``[width]`` on the tensor's device (nothing is read to the host);
        ``None`` (no gradient) digests as zeros on the host."""
        ...

    def compute_many(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The digests of ``tensors``, stacked on the host: ``[len(tensors), width]`` (one read per device)."""
        ...

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """The digest of the concatenation of the tensors whose digests are ``rows`` (``[n, width]``)."""
        ...

    def equal(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether two digests (or two stacks of digests) say the tensors are the same."""
        ...


def _int_view(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.int8)
    return flat.view(_INT_OF_WIDTH[flat.element_size()])


class BitwiseDigest:
    """Three wrapping int64 sums of the raw bits read as integers: plain, row-weighted and column-weighted."""

    width = 3
    row = 256
    exact = True

    def compute(self, tensor: torch.Tensor | None) -> torch.Tensor:
        if tensor is None or tensor.numel() == 0:  # on the tensor's device: digests of one stack share it
            return torch.zeros(self.width, dtype=torch.int64, device=None if tensor is None else tensor.device)
        ints = _int_view(tensor)
        n, dev = ints.numel(), ints.device
        full = n - n % self.row
        total = torch.zeros((), dtype=torch.int64, device=dev)
        by_row = torch.zeros((), dtype=torch.int64, device=dev)
        by_col = torch.zeros((), dtype=torch.int64, device=dev)
        if full:
            grid = ints[:full].view(-1, self.row)
            rows = grid.sum(dim=1, dtype=torch.int64)
            cols = grid.sum(dim=0, dtype=torch.int64)
            total = rows.sum()
            by_row = (rows * torch.arange(1, rows.numel() + 1, device=dev)).sum()
            by_col = (cols * torch.arange(1, self.row + 1, device=dev)).sum()
        if full < n:  # the last, partial row
            tail = ints[full:].to(torch.int64)
            total = total + tail.sum()
            by_row = by_row + tail.sum() * (full // self.row + 1)
            by_col = by_col + (tail * torch.arange(1, n - full + 1, device=dev)).sum()
        return torch.stack([total, by_row, by_col])

    def compute_many(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Small tensors of one device and element width in batches of at most :data:`BATCH_ELEMENTS` elements (one
        copy of the batch, a few passes); a larger tensor alone (:meth:`compute` copies nothing)."""
        out = torch.zeros(len(tensors), self.width, dtype=torch.int64)
        batches: dict[tuple[torch.device, int], tuple[list[int], list[torch.Tensor], int]] = {}
        rows: list[torch.Tensor] = []
        alone: list[int] = []
        for i, tensor in enumerate(tensors):
            if tensor is None or tensor.numel() == 0:
                continue
            if tensor.numel() >= BATCH_ELEMENTS:
                alone.append(i)
                rows.append(self.compute(tensor))
                continue
            ints = _int_view(tensor)
            key = (ints.device, ints.element_size())
            index, parts, size = batches.get(key, ([], [], 0))
            if size + ints.numel() > BATCH_ELEMENTS:
                self._batch(index, parts, out)
                index, parts, size = [], [], 0
            index.append(i)
            parts.append(ints)
            batches[key] = (index, parts, size + ints.numel())
        for index, parts, _ in batches.values():
            self._batch(index, parts, out)
        if rows:
            out[alone] = to_host(rows)
        return out

    def _batch(self, index: list[int], parts: list[torch.Tensor], out: torch.Tensor) -> None:
        """The digests of ``parts`` (flat integer views of one device and width) into ``out[index]``."""
        row, dev = self.row, parts[0].device
        counts = [-(-p.numel() // row) for p in parts]  # whole rows per tensor, the last one padded with zeros
        padded: list[torch.Tensor] = []
        for p, n in zip(parts, counts):
            padded.append(p)
            if n * row > p.numel():
                padded.append(p.new_zeros(n * row - p.numel()))
        grid = torch.cat(padded).view(-1, row).to(torch.int64)
        sums = grid.sum(dim=1)  # each row's sum
        by_col = grid.mul_(torch.arange(1, row + 1, device=dev)).sum(dim=1)  # each row's column-weighted sum
        lengths = torch.tensor(counts, device=dev)
        ends = lengths.cumsum(0)
        starts = ends - lengths
        number = torch.arange(1, len(sums) + 1, device=dev)  # row numbers in the batch, from 1

        def per_tensor(values: torch.Tensor) -> torch.Tensor:  # the sum of each tensor's rows (wrapping)
            running = torch.cat([values.new_zeros(1), values.cumsum(0)])
            return running[ends] - running[starts]

        total = per_tensor(sums)
        # rows weighted by their number within the tensor: (number in the batch) - (the tensor's first row's) + 1
        by_row = per_tensor(sums * number) - starts * total
        out[index] = torch.stack([total, by_row, per_tensor(by_col)], dim=1).cpu()

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.sum(dim=0)  # only for a summary: position weights are per tensor

    def equal(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and bool(torch.equal(a, b.to(a.device)))  # a device's digest against a host's


class ToleranceDigest:
    """Float64 sum, sum of squares and largest magnitude; equal within ``rtol``/``atol`` (NaN equals NaN)."""

    width = 3
    exact = False

    def __init__(self, rtol: float = 1e-5, atol: float = 1e-8) -> None:
        self.rtol = rtol
        self.atol = atol

    def compute(self, tensor: torch.Tensor | None) -> torch.Tensor:
        if tensor is None or tensor.numel() == 0:
            return torch.zeros(self.width, dtype=torch.float64, device=None if tensor is None else tensor.device)
        x = tensor.detach().reshape(-1).to(torch.float64)
        return torch.stack([x.sum(), x.square().sum(), x.abs().max()])

    def compute_many(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        return to_host([self.compute(t) for t in tensors])

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.stack([rows[:, 0].sum(), rows[:, 1].sum(), rows[:, 2].max()])

    def equal(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.shape != b.shape:
            return False
        return bool(torch.isclose(a, b.to(a.device), rtol=self.rtol, atol=self.atol, equal_nan=True).all())


def make_digest(compare: str, rtol: float = 1e-5, atol: float = 1e-8) -> BitwiseDigest | ToleranceDigest:
    """The digest for ``sdc.compare`` ('bitwise' or 'tolerance')."""
    if compare == "bitwise":
        return BitwiseDigest()
    if compare == "tolerance":
        return ToleranceDigest(rtol, atol)
    raise ValueError(f"sdc.compare must be 'bitwise' or 'tolerance', got {compare!r}")


def digest_all(digest: Digest, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Digests of several tensors, stacked on the host: ``[len(tensors), digest.width]`` (one device read)."""
    if not tensors:
        return torch.zeros(0, digest.width)
    return digest.compute_many(tensors)


def group_rows(digest: Digest, rows: torch.Tensor, groups: Sequence[Sequence[int]]) -> torch.Tensor:
    """Combine per-tensor digests into per-group digests (e.g. parameters into their DDP buckets)."""
    return torch.stack([digest.combine(rows[list(g)]) for g in groups])


__all__ += ["digest_all", "group_rows"]
