"""Capture and restore every random stream a training step draws from: Python, NumPy, torch CPU and CUDA."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng_states", "restore_rng_states"]


def capture_rng_states() -> dict[str, Any]:
    """The state of the process-global generators, as tensors and plain values (no pickling needed)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        # uint32 keys held as int64: every dtype the tree codec stores must round-trip exactly
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put the generators back exactly as :func:`capture_rng_states` found them."""
    py = states["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = states["numpy"]
    np.random.set_state(
        (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached"])
    )
    torch.set_rng_state(states["torch"].to(torch.uint8))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.to(torch.uint8) for s in states["cuda"]])
