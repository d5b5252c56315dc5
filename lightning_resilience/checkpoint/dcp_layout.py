"""The DCP layout of a shard, computed once per snapshot layout, so that its bytes can be written raw.

``torch.distributed.checkpoint`` (DCP) stores each tensor of a rank as a ``torch.save`` record in one data file
(``__0_0.distcp``) and indexes them in ``.metadata``. Its writer plans and serialises every tensor on every save,
holding the GIL for most of it. Here the same files are produced from raw bytes: the bytes ``torch.save`` writes
around a tensor's data (its *frame*) depend only on the tensor's shape and dtype, so they are taken once per layout
(from a save of a tensor of that shape whose data is never read into memory), and a save is then frame, data,
frame, ... with the checksum computed on the way (:mod:`~lightning_resilience.checkpoint.shard_writer`). DCP loads
the result as it loads its own files (a zip record's CRC is not checked by ``torch.load``, and the manifest's
xxh3-64 checksums cover every byte).
"""

from __future__ import annotations

import bisect
import io
import pickle
import struct
import threading
import uuid
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from lightning_resilience.checkpoint.shard_writer import FilePlan, Part
from lightning_resilience.checkpoint.tree import TensorSpec

__all__ = ["DATA_FILE", "METADATA_FILE", "ShardLayout", "shard_layout"]

DATA_FILE = "__0_0.distcp"
METADATA_FILE = ".metadata"
_SMALL = 1 << 16  # writes up to this size are kept when a frame is taken; bigger ones are the tensor's data
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_crc_lock = threading.Lock()


@dataclass(frozen=True)
class ShardLayout:
    """The files of a shard whose tensors have the given specs (in order): the data file's plan (frames and tensor
    data by index) and the DCP metadata, minus what changes from save to save (a save id)."""

    names: tuple[str, ...]
    data: FilePlan
    metadata: md.Metadata

    def metadata_bytes(self) -> bytes:
        meta = self.metadata
        storage = md.StorageMeta(checkpoint_id=None, save_id=uuid.uuid4().hex, load_id=None, modules=[])
        return pickle.dumps(
            md.Metadata(meta.state_dict_metadata, meta.planner_data, meta.storage_data, storage, meta.version)
        )


def shard_layout(specs: Mapping[str, TensorSpec]) -> ShardLayout:
    """The layout of a shard of ``specs`` (cached: a run has one or two layouts)."""
    return _layout(tuple((name, spec.shape, spec.dtype) for name, spec in specs.items()))


@lru_cache(maxsize=8)
def _layout(key: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]) -> ShardLayout:
    parts: list[Part] = []
    state: dict[str, md.TensorStorageMetadata | md.BytesStorageMetadata] = {}
    storage: dict[md.MetadataIndex, _StorageInfo] = {}
    offset = 0
    for index, (name, shape, dtype) in enumerate(key):
        head, tail = _frame(shape, dtype)
        nbytes = TensorSpec(shape, dtype).nbytes
        parts += [Part(data=head), Part(tensor=index, length=nbytes), Part(data=tail)]
        size = torch.Size(shape)
        zeros = torch.Size([0] * len(shape))
        chunks = [md.ChunkStorageMetadata(zeros, size)]
        state[name] = md.TensorStorageMetadata(md.TensorProperties(dtype=dtype), size, chunks)
        length = len(head) + nbytes + len(tail)
        storage[md.MetadataIndex(name, zeros, 0)] = _StorageInfo(DATA_FILE, offset, length)
        offset += length
    metadata = md.Metadata(state, planner_data={name: (name,) for name, _, _ in key}, storage_data=storage)
    return ShardLayout(tuple(name for name, _, _ in key), FilePlan(DATA_FILE, tuple(parts)), metadata)


@lru_cache(maxsize=4096)
def _frame(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[bytes, bytes]:
    """What ``torch.save`` of a contiguous CPU tensor of ``shape`` and ``dtype`` writes before and after its data."""
    sink = _Sink()
    with _crc_lock:  # the CRC would cover data that is never read; torch.load does not check it anyway
        crc = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(torch.empty(shape, dtype=dtype), sink)  # type: ignore[arg-type]  # untouched pages: not really allocated
        finally:
            torch.serialization.set_crc32_options(crc)
    stream = _Sparse(sink)
    with zipfile.ZipFile(stream) as archive:
        (record,) = [i for i in archive.infolist() if i.filename.endswith("/data/0")]
    stream.seek(record.header_offset)
    fields = _LOCAL_HEADER.unpack(stream.read(_LOCAL_HEADER.size))
    start = record.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
    nbytes = TensorSpec(shape, dtype).nbytes
    assert record.file_size == nbytes, f"torch.save record of {nbytes} bytes holds {record.file_size}"
    head, tail = stream.span(0, start), stream.span(start + nbytes, sink.size)
    assert head is not None and tail is not None, "a torch.save frame had a large write outside the tensor's data"
    return head, tail


class _Sink(io.RawIOBase):
    """Records what is written: small writes as bytes, large ones (a tensor's data) as their length only."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[tuple[int, bytes | None, int]] = []
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data)
        n = view.nbytes
        self.chunks.append((self.size, bytes(view) if n <= _SMALL else None, n))
        self.size += n
        return n


class _Sparse(io.RawIOBase):
    """A readable view of a :class:`_Sink`'s stream; the bytes of large writes read as zeros."""

    def __init__(self, sink: _Sink) -> None:
        super().__init__()
        self._chunks = sink.chunks
        self._starts = [c[0] for c in sink.chunks]
        self._size = sink.size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence] + offset
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(buffer), self._size - self._pos))
        out = memoryview(buffer).cast("B")
        done = 0
        while done < n:
            i = bisect.bisect_right(self._starts, self._pos + done) - 1
            start, data, length = self._chunks[i]
            skip = self._pos + done - start
            take = min(length - skip, n - done)
            out[done : done + take] = data[skip : skip + take] if data is not None else bytes(take)
            done += take
        self._pos += n
        return n

    def span(self, start: int, end: int) -> bytes | None:
        """The recorded bytes of ``[start, end)``; None when a large write falls in it."""
        pieces = []
        for chunk_start, data, length in self._chunks:
            lo, hi = max(start, chunk_start), min(end, chunk_start + length)
            if lo >= hi:
                continue
            if data is None:
                return None
            pieces.append(data[lo - chunk_start : hi - chunk_start])
        return b"".join(pieces)
