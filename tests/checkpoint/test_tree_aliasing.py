"""Tied weights are stored once and restored as one shared tensor."""

from __future__ import annotations

import torch

from lightning_resilience.checkpoint.tree import flatten_state, unflatten_state


def test_tied_weights_are_stored_once_and_stay_tied() -> None:
    """Two names for one storage: one stored tensor, and after unflatten both names are the same object."""
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    state = {"emb": emb.state_dict(), "head": head.state_dict(), "view": emb.weight[2:]}
    flat = flatten_state(state)
    assert len(flat.tensors) == 2  # the shared weight once, plus the offset view (a different tensor)
    back = unflatten_state(flat.skeleton, {n: t.clone() for n, t in flat.tensors.items()})
    assert back["emb"]["weight"] is back["head"]["weight"]
    assert torch.equal(back["view"], emb.weight[2:])
