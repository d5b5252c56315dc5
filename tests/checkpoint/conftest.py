"""Shared builders and fault injectors for the checkpoint-engine tests.

Helpers are plain functions (importable as ``tests.checkpoint.conftest``) plus thin fixtures over them, so a test
reads as "build a state, break one thing, assert the invariant".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_resilience.checkpoint.format import MANIFEST, Manifest, checksum_file
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tree import flatten_state

__all__ = [
    "assert_state_equal",
    "assert_tensors_equal",
    "data_file",
    "flip_byte",
    "make_snapshot",
    "make_state",
    "rewrite_manifest",
    "state_at",
]


def make_state(step: int) -> dict[str, Any]:
    """A training-like nested state whose every tensor value depends on ``step``.

    Covers the dtypes and container shapes a real Lightning checkpoint holds: float32/int64/bfloat16/bool tensors,
    a 0-dim tensor, an int-keyed optimizer state, tuples, bytes and non-finite floats in the skeleton.
    """
    gen = torch.Generator().manual_seed(1000 + step)
    return {
        "step": step,
        "model": {
            "weight": torch.randn(4, 3, generator=gen),
            "bias": torch.full((3,), float(step), dtype=torch.bfloat16),
            "counter": torch.tensor(step * 7, dtype=torch.int64),  # 0-dim
        },
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(4, 3, generator=gen), "step": torch.tensor(float(step))}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}],
        },
        "mask": torch.arange(6) % 2 == 0,
        "ids": torch.arange(5, dtype=torch.int64) * (1 << 40),  # values only int64 can hold
        "loss_scale": math.inf,
        "best": -math.inf,
        "last_loss": math.nan,
        "rng": b"\x00\x01\xfe\xff" * 3,
        "history": [1, (2, 3), [4.5, None], {"k": "v"}],
    }


def make_snapshot(step: int) -> StagedSnapshot:
    """The :func:`make_state` of ``step`` taken apart the way the manager stages it."""
    flat = flatten_state(make_state(step))
    return StagedSnapshot(step, flat.skeleton, {n: t.clone() for n, t in flat.tensors.items()}, {"epoch": step // 3})


def state_at(step: int) -> Callable[[], dict[str, Any]]:
    """The ``state`` callable ``CheckpointManager.on_step`` expects."""
    return lambda: make_state(step)


def named_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A deterministic tensor of ``shape`` drawn from a seed its name gives: the same global tensor on every rank."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=gen)


def data_file(shard: Path) -> Path:
    """The single DCP data file of a shard written with one file per rank."""
    (path,) = sorted(shard.glob("*.distcp"))
    return path


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte in place (default: the middle one), keeping the file size."""
    data = bytearray(path.read_bytes())
    assert data, f"{path} is empty"
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def rewrite_manifest(shard: Path, edit: Callable[[Manifest], None] | None = None) -> None:
    """Re-sign a shard after tampering: recompute size and checksum of every listed file, then apply ``edit``.

    This is the attacker (or a buggy tool) that keeps the manifest consistent, so only deeper checks can catch it.
    """
    manifest = Manifest.from_json((shard / MANIFEST).read_text(), where=str(shard))
    for name in manifest.files:
        path = shard / name
        manifest.files[name] = {"size": path.stat().st_size, "xxh3_64": checksum_file(path)}
    if edit is not None:
        edit(manifest)
    (shard / MANIFEST).write_text(manifest.to_json())


def assert_tensors_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and values."""
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert torch.equal(got, want), name


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes as stored (NaN payloads and -0.0 kept)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bitwise(actual: Any, expected: Any, path: str = "state") -> None:
    """Like assert_state_equal, but tensors must match byte for byte (NaN payloads, -0.0, ...).

    A mapping may come back as a plain dict (the skeleton stores an OrderedDict state_dict as a dict).
    """
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
    else:
        assert type(actual) is type(expected), path
    if isinstance(expected, torch.Tensor):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert tensor_bytes(actual) == tensor_bytes(expected), path
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), path
        for key in expected:
            assert_bitwise(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), path
        for i, (got, want) in enumerate(zip(actual, expected)):
            assert_bitwise(got, want, f"{path}[{i}]")
    else:
        assert_state_equal(actual, expected, path)


def assert_tensors_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Flat tensor maps: same names (in any order: a full shard lists them sorted), bitwise equal values."""
    assert_bitwise(dict(sorted(actual.items())), dict(sorted(expected.items())))


def assert_state_equal(actual: Any, expected: Any, path: str = "state") -> None:
    """Deep equality that also checks container types, tensor dtypes and treats NaN as equal to NaN."""
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual, expected), path
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), path
        for key, value in expected.items():
            assert_state_equal(actual[key], value, f"{path}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), path
        for i, (got, want) in enumerate(zip(actual, expected)):
            assert_state_equal(got, want, f"{path}[{i}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual), path
    else:
        assert actual == expected, path


@pytest.fixture
def managers() -> Iterator[list[CheckpointManager]]:
    """Collects managers built by a test and closes them afterwards, so no worker thread outlives the test."""
    made: list[CheckpointManager] = []
    yield made
    for manager in made:
        try:
            manager.close()
        except Exception:  # a test that expects a latched error may leave one behind; it is already asserted
            pass
