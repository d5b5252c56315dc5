"""Run a scenario function on N real gloo ranks (forkserver processes) and collect each rank's JSON result."""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT = timedelta(seconds=60)

Scenario = Callable[..., dict[str, Any]]
"""``scenario(rank, world, tmp, *args) -> JSON-able result`` (a module-level function: it is pickled by name)."""


def _child(
    rank: int, tmp: str, world: int, scenario: Scenario, args: tuple[Any, ...], timeout_s: float, port: int | None
) -> None:
    out = Path(tmp) / f"result_rank{rank}.json"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if port is None:
        init = f"file://{tmp}/pg_store"
    else:  # a TCPStore rendezvous, as torchrun makes: MASTER_ADDR/PORT are what store clients connect to
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        init = "env://"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        result = scenario(rank, world, Path(tmp), *args)
        out.write_text(json.dumps({"ok": True, **result}))
    except BaseException:
        out.write_text(json.dumps({"ok": False, "traceback": traceback.format_exc()}))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(
    scenario: Scenario,
    world: int,
    tmp: Path,
    *args: Any,
    deadline_s: float = 90.0,
    pg_timeout: timedelta = PG_TIMEOUT,
    tcp_store: bool = False,
) -> list[dict[str, Any]]:
    """Run ``scenario(rank, world, tmp, *args)`` on ``world`` gloo ranks and return each rank's result.

    Ranks are forked from a forkserver that has imported the scenario's module once (well under a second per rank;
    "spawn" would pay the torch + lightning import per rank). Fails, never hangs, past ``deadline_s``; a rank that
    raised is reported with its traceback. ``tcp_store`` rendezvous through a TCPStore on a free loopback port
    (``MASTER_ADDR``/``MASTER_PORT`` set, as under torchrun) instead of a file.
    """
    mp.get_context("forkserver").set_forkserver_preload([scenario.__module__])
    ctx = mp.start_processes(
        _child,
        args=(str(tmp), world, scenario, args, pg_timeout.total_seconds(), free_port() if tcp_store else None),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + deadline_s
    crashed: Exception | None = None
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{scenario.__name__} did not finish within {deadline_s}s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        crashed = err
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    files = [tmp / f"result_rank{rank}.json" for rank in range(world)]
    results = [json.loads(f.read_text()) if f.exists() else {"ok": False, "traceback": "(no result)"} for f in files]
    failed = [f"rank {rank}:\n{res['traceback']}" for rank, res in enumerate(results) if not res.pop("ok")]
    if failed or crashed is not None:
        pytest.fail(f"{scenario.__name__} failed: {crashed}\n" + "\n".join(failed))
    return results


def free_port() -> int:
    """A free TCP port on the loopback interface (for a rendezvous endpoint or a store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
