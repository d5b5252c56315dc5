"""capture_rng_states / restore_rng_states: restoring replays exactly the same random draws."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from lightning_resilience.checkpoint.rng import capture_rng_states, restore_rng_states
from lightning_resilience.checkpoint.tree import flatten_state, unflatten_state


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    """These tests reseed the process-global generators; give other tests their state back."""
    py, npy, pt = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(pt)


def _draw() -> dict[str, Any]:
    """Draws from every generator, including the cached-Gaussian paths of Python and legacy NumPy."""
    return {
        "py": [random.random(), random.gauss(0.0, 1.0), random.randint(0, 10**9), random.getrandbits(64)],
        "np": [np.random.rand(5).tolist(), np.random.standard_normal(3).tolist(), np.random.randint(0, 10**9)],
        "torch": [torch.rand(4), torch.randn(3), torch.randint(0, 10**9, (2,)), torch.randperm(10)],
    }


def _assert_same_draws(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["py"] == b["py"]
    assert a["np"] == b["np"]
    for x, y in zip(a["torch"], b["torch"]):
        assert torch.equal(x, y)


def _mid_gaussian_state() -> None:
    """Leave both Gaussian caches full: an odd number of Box-Muller draws."""
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    torch.randn(1)


def test_restore_replays_the_same_draws() -> None:
    """capture -> draw -> restore -> draw gives identical values from random, numpy and torch."""
    _mid_gaussian_state()
    states = capture_rng_states()
    assert states["numpy"]["has_gauss"] == 1 and states["python"]["gauss"] is not None
    first = _draw()
    restore_rng_states(states)
    second = _draw()
    _assert_same_draws(first, second)
    # and the restore can be repeated from the same captured object
    restore_rng_states(states)
    _assert_same_draws(first, _draw())


def test_restore_after_reseeding_everything() -> None:
    """Restoring undoes arbitrary reseeding of all three generators in between."""
    _mid_gaussian_state()
    states = capture_rng_states()
    first = _draw()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draw()["py"] != first["py"]
    restore_rng_states(states)
    _assert_same_draws(first, _draw())


def test_captured_states_survive_the_checkpoint_codec() -> None:
    """The captured states are storable without warnings and replay exactly after a JSON round trip."""
    _mid_gaussian_state()
    warnings: list[str] = []
    flat = flatten_state({"rng": capture_rng_states()}, warn=warnings.append)
    assert warnings == []
    skeleton = json.loads(json.dumps(flat.skeleton, allow_nan=False))
    tensors = {n: t.clone() for n, t in flat.tensors.items()}
    first = _draw()
    torch.manual_seed(0)
    restore_rng_states(unflatten_state(skeleton, tensors)["rng"])
    _assert_same_draws(first, _draw())


def test_capture_is_a_snapshot_not_a_view() -> None:
    """Drawing after capture does not change the captured states."""
    _mid_gaussian_state()
    states = capture_rng_states()
    copy = {
        "py": states["python"]["state"].clone(),
        "np": states["numpy"]["keys"].clone(),
        "torch": states["torch"].clone(),
    }
    _draw()
    assert torch.equal(states["python"]["state"], copy["py"])
    assert torch.equal(states["numpy"]["keys"], copy["np"])
    assert torch.equal(states["torch"], copy["torch"])
