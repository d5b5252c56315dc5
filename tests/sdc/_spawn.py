"""Run a function on N gloo ranks (torch.multiprocessing, forkserver) and collect each rank's JSON-able result."""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._ranks import free_port

PG_TIMEOUT = timedelta(seconds=60)


def _child(rank: int, world: int, port: int, fn: Callable[..., Any], out: str, args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    logging.getLogger("lightning_resilience.sdc").setLevel(logging.ERROR)  # verdicts are in the results
    path = Path(out) / f"rank{rank}.json"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PG_TIMEOUT)
        result = fn(rank, *args)
        path.write_text(json.dumps({"ok": True, "result": result}))
    except BaseException:
        path.write_text(json.dumps({"ok": False, "error": traceback.format_exc()}))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, tmp: Path, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """``fn(rank, *args)`` on every rank; returns the results in rank order (raises with a child's traceback).

    Every rank must finish within ``timeout_s`` seconds of the start; later ones are killed."""
    ctx = mp.get_context("forkserver")
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, str(tmp), args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 1.0))
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
    results = []
    for r in range(world):
        path = tmp / f"rank{r}.json"
        assert path.exists(), f"rank {r} left no result (exit code {procs[r].exitcode})"
        data = json.loads(path.read_text())
        assert data["ok"], f"rank {r} failed:\n{data['error']}"
        results.append(data["result"])
    return results
