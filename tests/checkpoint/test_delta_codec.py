"""Delta checkpoints: the XOR+zstd codec on its own, bitwise for every dtype, detecting a wrong base and damage, and
lossy only when asked (``test_delta.py``: the tier and the manager)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from lightning_resilience.checkpoint.delta import decode_delta, encode_delta
from lightning_resilience.checkpoint.errors import CheckpointCorruptError
from tests.checkpoint.conftest import (
    assert_bitwise,
    tensor_bytes,
)

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
_DTYPES += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "uint32", None)) if d is not None]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaNs, infinities, subnormals and -0.0 included for floats)."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1  # only 0 and 1 are valid bools
    return raw.view(dtype).reshape(shape)


def _near(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """A slightly changed copy (a training step's worth), with the same spec."""
    if tensor.dtype.is_floating_point and tensor.element_size() >= 2 and tensor.numel():
        noise = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed)) * 1e-3
        return (tensor.float() + noise).to(tensor.dtype)
    out = tensor.clone()
    if out.numel():
        out.reshape(-1)[0] = _random(tensor.dtype, (1,), seed)[0]
    return out


# ------------------------------------------------------------------------------------------------------ codec
@pytest.mark.parametrize("dtype", _DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_is_bitwise_for_every_dtype(dtype: torch.dtype) -> None:
    """XOR mode (same spec), full mode (new name, changed shape), 0-dim, empty and non-contiguous all come back."""
    base = {
        "matrix": _random(dtype, (33, 7), 1),
        "scalar": _random(dtype, (), 2),
        "empty": _random(dtype, (0, 4), 3),
        "reshaped": _random(dtype, (6,), 4),
        "only_in_base": _random(dtype, (3,), 5),
        "unchanged": _random(dtype, (9,), 11),
    }
    new = {
        "matrix": _near(base["matrix"], 6),
        "scalar": _random(dtype, (), 7),
        "empty": _random(dtype, (0, 4), 8),
        "reshaped": _random(dtype, (2, 3), 9),  # changed spec: stored whole
        "strided": _random(dtype, (5, 8), 10).t(),  # absent from base, non-contiguous
        "unchanged": base["unchanged"].clone(),  # an all-zero delta
    }
    blobs, meta = encode_delta(base, new)
    modes = {name: entry["mode"] for name, entry in meta["tensors"].items()}
    assert modes == {
        "matrix": "xor",
        "scalar": "xor",
        "empty": "xor",
        "reshaped": "full",
        "strided": "full",
        "unchanged": "xor",
    }
    json.dumps(meta)  # JSON-safe
    decoded = decode_delta(base, blobs, meta)
    assert list(decoded) == list(new)
    assert_bitwise(decoded, {n: t.contiguous() for n, t in new.items()})
    assert all(t.is_contiguous() for t in decoded.values())


def test_unchanged_tensor_compresses_to_almost_nothing() -> None:
    """A frozen tensor's XOR delta is all zeros: a few dozen bytes whatever its size."""
    weight = torch.randn(256, 256)
    blobs, meta = encode_delta({"w": weight}, {"w": weight.clone()})
    assert meta["tensors"]["w"]["size"] < 100 < weight.numel() * 4
    assert torch.equal(decode_delta({"w": weight}, blobs, meta)["w"], weight)


def test_decoded_tensors_do_not_alias_the_base() -> None:
    """The caller owns what decode returns: changing it never changes the base, and vice versa."""
    base = {"w": torch.randn(8)}
    keep = base["w"].clone()
    blobs, meta = encode_delta(base, {"w": base["w"] + 1})
    out = decode_delta(base, blobs, meta)
    out["w"].zero_()
    assert torch.equal(base["w"], keep)


def test_wrong_base_is_detected_at_decode() -> None:
    """Decoding against another base (same specs, other values) raises, naming the tensor and the cause."""
    base = {"w": torch.randn(16), "n": torch.arange(4)}
    blobs, meta = encode_delta(base, {"w": base["w"] * 2, "n": base["n"] + 1})
    other = {"w": base["w"] + 1, "n": base["n"]}
    with pytest.raises(CheckpointCorruptError, match=r"'w'.*different base"):
        decode_delta(other, blobs, meta)
    with pytest.raises(CheckpointCorruptError, match=r"'w'.*base has absent"):
        decode_delta({"n": base["n"]}, blobs, meta)


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_damaged_blob_is_detected_at_decode(damage: str) -> None:
    """A flipped byte, a truncated or a missing blob raises CheckpointCorruptError naming the tensor."""
    base = {"w": torch.randn(4096)}
    blobs, meta = encode_delta(base, {"w": base["w"] + 1e-3})
    blob = bytearray(blobs["w"])
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x01
        blobs["w"] = bytes(blob)
    elif damage == "truncate":
        blobs["w"] = bytes(blob[: len(blob) // 2])
    else:
        del blobs["w"]
    with pytest.raises(CheckpointCorruptError, match="'w'"):
        decode_delta(base, blobs, meta)


def test_damaged_metadata_is_detected_at_decode() -> None:
    """Unknown format, inconsistent sizes and a tampered checksum are all corrupt, never a crash or a wrong value."""
    base = {"w": torch.randn(10)}
    blobs, meta = encode_delta(base, {"w": base["w"] + 1})
    for edit, pattern in [
        (lambda m: m.update(format="other"), "format"),
        (lambda m: m["tensors"]["w"].update(nbytes=8), "inconsistent"),
        (lambda m: m["tensors"]["w"].update(xxh3_64="0" * 16), "checksum"),
        (lambda m: m["tensors"]["w"].pop("spec"), "unreadable"),
    ]:
        bad = copy.deepcopy(meta)
        edit(bad)
        with pytest.raises(CheckpointCorruptError, match=pattern):
            decode_delta(base, blobs, bad)


def test_codec_arguments_are_validated() -> None:
    """Out-of-range level or lossy_bits raise ValueError naming the argument."""
    with pytest.raises(ValueError, match="level"):
        encode_delta({}, {}, level=0)
    with pytest.raises(ValueError, match="lossy_bits"):
        encode_delta({}, {}, lossy_bits=24)


def test_lossy_mode_is_opt_in_and_bounded() -> None:
    """lossy_bits=k: float32 XOR deltas within 2**(k-23) relative error; zeros, non-finite and other dtypes exact."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(10_000, generator=gen)
    new = weight + torch.randn(10_000, generator=gen) * 1e-4
    new[:4] = torch.tensor([math.inf, -math.inf, math.nan, 0.0])
    base, newer = {"w": weight, "i": torch.arange(5)}, {"w": new, "i": torch.arange(5) + 3}
    lossless_blobs, lossless = encode_delta(base, newer)
    blobs, meta = encode_delta(base, newer, lossy_bits=12)
    assert meta["tensors"]["w"]["size"] < lossless["tensors"]["w"]["size"]
    out = decode_delta(base, blobs, meta)
    assert torch.equal(out["i"], newer["i"])
    assert tensor_bytes(out["w"][:4]) == tensor_bytes(new[:4])  # inf, -inf, nan, 0 untouched
    rel = ((out["w"][4:] - new[4:]).abs() / new[4:].abs()).max().item()
    assert 0 < rel < 2.0 ** (12 - 23)
    assert tensor_bytes(decode_delta(base, lossless_blobs, lossless)["w"]) == tensor_bytes(new)  # default stays bitwise
