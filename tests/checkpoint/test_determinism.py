"""ordered_allreduce_hook: DDP's mean gradient, reduced in rank order whatever the bucket layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_resilience.checkpoint.determinism import ordered_allreduce_hook
from tests._ranks import run_ranks


def _grads(rank: int, bucket_cap_mb: float, hook: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.Tanh(), torch.nn.Linear(65, 7))
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if hook:
        ddp.register_comm_hook(None, ordered_allreduce_hook)
    gen = torch.Generator().manual_seed(100 + rank)
    # values of very different magnitudes: float addition order shows in the last bits
    x = torch.randn(16, 33, generator=gen) * (10.0 ** (rank * 3))
    ddp(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    small, large = _grads(rank, 0.001, True), _grads(rank, 25, True)
    local = [_local(r) for r in range(world)]  # every rank's own gradients, recomputed here
    expected = []
    for i in range(len(local[0])):
        total = local[0][i].clone()
        for r in range(1, world):
            total.add_(local[r][i])
        expected.append(total / world)
    dist.barrier()
    return {
        "layouts_agree": all(torch.equal(a, b) for a, b in zip(small, large)),
        "matches_rank_order": all(torch.equal(a, e) for a, e in zip(small, expected)),
    }


def _local(rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.Tanh(), torch.nn.Linear(65, 7))
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(16, 33, generator=gen) * (10.0 ** (rank * 3))
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_reduction_is_independent_of_bucket_layout(tmp_path: Path) -> None:
    """Four ranks, one-parameter buckets vs one bucket for all: bitwise the same mean, summed in rank order."""
    for rank, res in enumerate(run_ranks(_scenario, 4, tmp_path)):
        assert res["layouts_agree"] and res["matches_rank_order"], (rank, res)
