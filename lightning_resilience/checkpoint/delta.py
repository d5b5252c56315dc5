"""Delta encoding of tensors: XOR with a base tensor, byte shuffle, zstd; lossless unless asked otherwise.

Framework-free (torch, numpy, ``zstandard``, ``xxhash``). Per tensor the raw bytes of the new value are XORed with
the bytes of the same-named base tensor (same dtype and shape; otherwise the tensor is stored whole),
byte-shuffled (all first bytes of the elements, then all second bytes, ...: the sign and exponent bytes of floats
that barely moved XOR to runs of zeros) and compressed with zstd. The metadata records, per tensor, the mode,
spec, sizes and an xxh3-64 of the bytes decoding must produce, so a wrong base or a damaged blob is detected at
decode time. Lossless for every dtype (bytes are bytes). :mod:`lightning_resilience.checkpoint.delta_tier` stores
checkpoints this way.

An opt-in lossy mode (``lossy_bits = k > 0``, off by default) zeroes the lowest ``k`` mantissa bits of float32 XOR
deltas of normal numbers: the decoded value keeps the sign, exponent and upper ``23 - k`` mantissa bits of the true
value and takes its lowest ``k`` bits from the base, so ``|decoded - true| < 2**k`` ulps, a relative error below
``2**(k - 23)``. Zeros, subnormals, infinities, NaNs, tensors stored whole and every other dtype stay exact. It
breaks the bitwise-resume guarantee and is meant for weights-only archives, not for training checkpoints.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import xxhash
import zstandard

from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from lightning_resilience.checkpoint.tree import TensorSpec

__all__ = [
    "DELTA_FORMAT",
    "MAX_LOSSY_BITS",
    "decode_delta",
    "encode_delta",
]

log = logging.getLogger(__name__)

DELTA_FORMAT = "lightning_resilience/delta-v1"
MAX_LOSSY_BITS = 23  # float32 mantissa width: more would reach the exponent

_Bytes = npt.NDArray[np.uint8]


# ------------------------------------------------------------------------------------------------------ codec
def _raw(tensor: torch.Tensor) -> _Bytes:
    """The tensor's bytes in row-major element order, as a uint8 array (no copy for a contiguous CPU tensor)."""
    flat = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _shuffle(data: _Bytes, itemsize: int) -> _Bytes:
    """Byte planes: every element's byte 0, then every element's byte 1, ... (what zstd compresses best)."""
    if itemsize <= 1 or data.size == 0:
        return data
    count = data.size // itemsize
    out = np.empty_like(data)
    for i in range(itemsize):  # one strided copy per plane: about twice as fast as a transposed copy
        out[i * count : (i + 1) * count] = data[i::itemsize]
    return out


def _unshuffle(data: _Bytes, itemsize: int) -> _Bytes:
    if itemsize <= 1 or data.size == 0:
        return data
    count = data.size // itemsize
    out = np.empty_like(data)
    for i in range(itemsize):
        out[i::itemsize] = data[i * count : (i + 1) * count]
    return out


def _digest(data: _Bytes) -> str:
    return xxhash.xxh3_64(data.data).hexdigest()


def _spec(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(tensor.shape), tensor.dtype)


def _drop_low_mantissa(delta: _Bytes, new: _Bytes, bits: int) -> _Bytes:
    """Zero the lowest ``bits`` mantissa bits of a float32 XOR delta where the new value is a normal number.

    Zeros, subnormals, infinities and NaNs keep an exact delta: their exponent field is all zeros or all ones.
    """
    words = delta.view(np.uint32)
    exponent = new.view(np.uint32) & np.uint32(0x7F800000)
    normal = (exponent != np.uint32(0)) & (exponent != np.uint32(0x7F800000))
    keep = np.uint32((0xFFFFFFFF << bits) & 0xFFFFFFFF)
    return np.where(normal, words & keep, words).astype(np.uint32, copy=False).view(np.uint8)


def encode_delta(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    level: int = 3,
    lossy_bits: int = 0,
) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Encode ``new`` against ``base``: per tensor, zstd of the byte-shuffled XOR of their raw bytes.

    A tensor absent from ``base``, or whose shape or dtype differs there, is stored whole (mode ``"full"``). Tensors
    of ``base`` that ``new`` lacks are simply not part of the result.

    Args:
        base: the tensors the delta is made against; :func:`decode_delta` needs bitwise the same ones.
        new: the tensors to encode (any dtype, any layout; read as their row-major bytes).
        level: zstd compression level (1-22; 3 is zstd's default balance of speed and ratio). Single-threaded.
        lossy_bits: 0 (default) is lossless. ``k > 0`` zeroes the lowest ``k`` mantissa bits of float32 XOR deltas
            of normal numbers (relative error below ``2**(k - 23)``); see the module docstring.

    Returns:
        ``(blobs, meta)``: compressed bytes per tensor name, and the JSON-safe metadata :func:`decode_delta` needs.

    Raises:
        ValueError: ``level`` or ``lossy_bits`` out of range.
    """
    if not 1 <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise ValueError(f"delta level must be in [1, {zstandard.MAX_COMPRESSION_LEVEL}], got {level}")
    if not 0 <= lossy_bits <= MAX_LOSSY_BITS:
        raise ValueError(f"delta lossy_bits must be in [0, {MAX_LOSSY_BITS}] (0 = lossless), got {lossy_bits}")
    # one compressor per call: a ZstdCompressor must not be shared between threads
    compressor = zstandard.ZstdCompressor(level=level, threads=0, write_content_size=True)
    blobs: dict[str, bytes] = {}
    entries: dict[str, dict[str, Any]] = {}
    for name, tensor in new.items():
        spec = _spec(tensor)
        raw = _raw(tensor)
        itemsize = tensor.element_size()
        entry: dict[str, Any] = {"spec": spec.to_json(), "nbytes": int(raw.size), "shuffle": itemsize}
        reference = base.get(name)
        if reference is not None and _spec(reference) == spec:
            base_raw = _raw(reference)
            payload = np.bitwise_xor(raw, base_raw)
            entry["mode"] = "xor"
            entry["base_xxh3_64"] = _digest(base_raw)
            if lossy_bits and tensor.dtype == torch.float32:
                payload = _drop_low_mantissa(payload, raw, lossy_bits)
                entry["lossy_bits"] = lossy_bits
                entry["xxh3_64"] = _digest(np.bitwise_xor(payload, base_raw))
            else:
                entry["xxh3_64"] = _digest(raw)
        else:
            payload = raw
            entry["mode"] = "full"
            entry["xxh3_64"] = _digest(raw)
        blob = compressor.compress(_shuffle(payload, itemsize).data)
        entry["size"] = len(blob)
        blobs[name] = blob
        entries[name] = entry
    meta = {
        "format": DELTA_FORMAT,
        "codec": "zstd",
        "level": level,
        "byteorder": sys.byteorder,
        "lossy_bits": lossy_bits,
        "tensors": entries,
    }
    return blobs, meta


def decode_delta(
    base: Mapping[str, torch.Tensor], blobs: Mapping[str, bytes | memoryview], meta: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """Rebuild the tensors encoded by :func:`encode_delta` into freshly allocated CPU tensors.

    Raises:
        CheckpointCorruptError: naming the tensor: its blob is missing or fails to decompress, the base lacks it or
            differs from the one the delta was made against, or the decoded bytes fail their checksum.
    """
    if meta.get("format") != DELTA_FORMAT:
        raise CheckpointCorruptError(f"unknown delta format {meta.get('format')!r}")
    if meta.get("byteorder") != sys.byteorder:
        raise CheckpointCorruptError(
            f"delta written on a {meta.get('byteorder')}-endian machine cannot be decoded on a {sys.byteorder}-endian "
            "one; restore it on the original architecture"
        )
    if meta.get("codec") != "zstd":
        raise CheckpointCorruptError(f"unknown delta codec {meta.get('codec')!r}")
    decompressor = zstandard.ZstdDecompressor()
    out: dict[str, torch.Tensor] = {}
    entries = meta.get("tensors")
    if not isinstance(entries, Mapping):
        raise CheckpointCorruptError("delta metadata lists no tensors")
    for name, entry in entries.items():
        try:
            spec = TensorSpec.from_json(entry["spec"])
            nbytes, itemsize, mode = int(entry["nbytes"]), int(entry["shuffle"]), entry["mode"]
            if nbytes != spec.nbytes or mode not in ("xor", "full"):
                raise ValueError(f"inconsistent entry (nbytes {nbytes}, spec {spec}, mode {mode!r})")
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointCorruptError(f"delta entry of tensor {name!r} unreadable ({err})") from err
        blob = blobs.get(name)
        if blob is None:
            raise CheckpointCorruptError(f"delta holds no data for tensor {name!r}")
        try:
            # checked first: a damaged frame header must not make us allocate an arbitrary amount of memory
            declared = zstandard.frame_content_size(blob)
            if declared != nbytes:
                raise CheckpointCorruptError(
                    f"delta of tensor {name!r} declares {declared} bytes, expected {nbytes}: the delta is corrupt"
                )
            data = decompressor.decompress(blob, max_output_size=max(nbytes, 1))
        except zstandard.ZstdError as err:
            raise CheckpointCorruptError(f"delta of tensor {name!r} does not decompress ({err})") from err
        if len(data) != nbytes:
            raise CheckpointCorruptError(f"delta of tensor {name!r} decodes to {len(data)} bytes, expected {nbytes}")
        payload = _unshuffle(np.frombuffer(data, dtype=np.uint8), itemsize)
        if mode == "xor":
            reference = base.get(name)
            if reference is None or _spec(reference) != spec:
                found = "absent" if reference is None else str(_spec(reference))
                raise CheckpointCorruptError(
                    f"delta of tensor {name!r} needs a base tensor {spec}, the base has {found}: wrong base checkpoint"
                )
            base_raw = _raw(reference)
            if _digest(base_raw) != entry.get("base_xxh3_64"):
                raise CheckpointCorruptError(
                    f"delta of tensor {name!r} was made against a different base (base checksum mismatch): the base "
                    "checkpoint was rewritten or is the wrong one"
                )
            raw = np.bitwise_xor(payload, base_raw)
        else:
            raw = payload.copy() if not payload.flags.writeable else payload
        if _digest(raw) != entry.get("xxh3_64"):
            raise CheckpointCorruptError(f"decoded tensor {name!r} fails its checksum: the delta is corrupt")
        if nbytes == 0:  # a uint8 view of nothing has stride 0 and cannot be reinterpreted
            out[name] = torch.empty(spec.shape, dtype=spec.dtype)
        else:
            out[name] = torch.from_numpy(raw).view(spec.dtype).reshape(spec.shape)
    return out
