"""Restoring a lost node's rank from its peer's RAM, against node-local tmpfs, local disk and a RAM snapshot.

Run from the repository root::

    python -m benchmarks.peer_restore            # TinyGPT "mid" (~7M parameters, ~83 MB model + AdamW state)
    python -m benchmarks.peer_restore --quick    # smoke mode: TinyGPT tiny, 3 repetitions (seconds)

Two gloo ranks on this machine stand for two nodes. Both write the same step of a TinyGPT training state (weights
and both AdamW moments) to a :class:`PeerTier` (each rank's shard in its node's tmpfs directory and a copy in the
other node's) and to a :class:`LocalTier` on disk. Then, repetitions interleaved round-robin so that drift on a
shared machine hits every figure alike, rank 1 restores that step through :meth:`CheckpointManager.restore`:

* **peer RAM**: node 1's directory is deleted first (the node was lost); the collective restore finds rank 1's shard
  in node 0's RAM, sends it over the gloo link, commits it and loads it;
* **own tmpfs**: node 1's copy is intact (a process restart, not a node loss): no transfer;
* **local disk**: a ``LocalTier`` restore with the page cache warm, and once more after asking the kernel to drop
  the files' pages (cold);
* **RAM snapshot**: an in-process ``MemoryTier`` restore (the buffers are handed over; only survives while the
  process lives).

Every restored state is compared with the original bit for bit (untimed). The "link" is loopback between two
processes sharing two cores: compare the ratios measured in the same run, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks._common import (
    command_line,
    evict_page_cache,
    fmt_ms,
    fmt_ratio,
    machine_info,
    md_table,
    now_iso,
    print_flush,
    ratio,
    summarize,
    write_json,
)
from benchmarks.remote_tier import Workload, check_same, model_kwargs_for
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.replication import PeerTier
from lightning_resilience.checkpoint.tree import flatten_state

MODULE = "benchmarks.peer_restore"
DEFAULT_OUT = "benchmarks/results/peer_restore.json"
TITLE = "Peer replication: restoring a lost node's rank from its peer's RAM vs tmpfs, disk and RAM"
STEP = 100
FIGURES = ("peer_ram", "own_tmpfs", "local_warm", "local_cold", "memory")
pc = time.perf_counter


def _rank_main(rank: int, world: int, tmp: str, preset: str, reps: int) -> None:
    root = Path(tmp)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        out = _measure(rank, root, preset, reps)
        if rank == 1:
            (root / "result.json").write_text(json.dumps(out))
    except BaseException:
        (root / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _peer(root: Path) -> PeerTier:
    return PeerTier(root / "shm" / "node{node}", every_n_steps=1, keep=1, ranks_per_node=1, timeout_s=300)


def _disk(root: Path, rank: int) -> LocalTier:
    return LocalTier(root / "disk" / f"node{rank}", every_n_steps=1, keep=1)


def _restore(tiers: list[Any]) -> tuple[float, Any, str]:
    manager = CheckpointManager(tiers)
    manager.setup()
    dist.barrier()
    start = pc()
    restored = manager.restore(STEP)
    elapsed = pc() - start
    manager.close()
    assert restored is not None
    return elapsed, restored.state, restored.tier


def _measure(rank: int, root: Path, preset: str, reps: int) -> dict[str, Any]:
    wl = Workload(model_kwargs_for(preset), batch_size=4, train_steps=2, seed=0)
    reference = flatten_state(wl.state())
    writer = CheckpointManager([_peer(root), _disk(root, rank)])
    writer.setup()
    writer.on_step(STEP, wl.state)
    assert writer.wait(timedelta(seconds=300))
    writer.close()
    shard_bytes = sum(f.stat().st_size for f in (root / "shm" / "node1").rglob("rank_00001/*"))
    samples: dict[str, list[float]] = {name: [] for name in FIGURES}
    memory = CheckpointManager([MemoryTier(every_n_steps=1, keep=1)])
    memory.setup()

    def peer_ram() -> float:
        dist.barrier()
        if rank == 1:  # node 1 lost: its tmpfs copy (and the replica it held for node 0) are gone
            shutil.rmtree(root / "shm" / "node1")
        dt, state, tier = _restore([_peer(root)])
        if rank == 1:
            check_same(state, reference, "peer RAM restore")
            assert tier == "peer"
        return dt

    def own_tmpfs() -> float:
        dt, state, _ = _restore([_peer(root)])  # node 1 has rank 1's shard again (the previous figure put it back)
        if rank == 1:
            check_same(state, reference, "tmpfs restore")
        return dt

    def local(cold: bool) -> float:
        if cold:
            for path in (root / "disk").rglob("*"):
                if path.is_file():
                    evict_page_cache(path)
        dt, state, _ = _restore([_disk(root, rank)])
        if rank == 1:
            check_same(state, reference, "disk restore")
        return dt

    def ram() -> float:
        memory.on_step(STEP, wl.state)  # untimed: the previous restore took the buffers
        dist.barrier()
        start = pc()
        restored = memory.restore(STEP)
        dt = pc() - start
        assert restored is not None
        if rank == 1:
            check_same(restored.state, reference, "RAM restore")
        return dt

    runs = {
        "peer_ram": peer_ram,
        "own_tmpfs": own_tmpfs,
        "local_warm": lambda: local(False),
        "local_cold": lambda: local(True),
        "memory": ram,
    }
    for rep in range(-1, reps):  # one warm-up round, then timed rounds with a rotating order
        order = list(FIGURES[rep % len(FIGURES) :] + FIGURES[: rep % len(FIGURES)]) if rep >= 0 else list(FIGURES)
        # the own-tmpfs figure needs the shard the peer figure recovered: keep that pair in order
        order.remove("own_tmpfs")
        order.insert(order.index("peer_ram") + 1, "own_tmpfs")
        for name in order:
            dt = runs[name]()
            if rep >= 0:
                samples[name].append(dt)
        if rank == 1:
            print_flush(f"[peer_restore] rep {rep + 1}/{reps}{' (warm-up)' if rep < 0 else ''} done")
    memory.close()
    return {
        "samples": samples,
        "shard_bytes": shard_bytes,
        "state_bytes": sum(t.numel() * t.element_size() for t in reference.tensors.values()),
    }


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="TinyGPT size: tiny, mid (default), small")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per figure (8; quick: 3)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: tiny model, 3 repetitions")
    args = p.parse_args(argv)
    args.preset = args.preset or ("tiny" if args.quick else "mid")
    args.reps = args.reps or (3 if args.quick else 8)
    if args.reps < 3:
        p.error("--reps must be >= 3 (medians)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    with tempfile.TemporaryDirectory(
        prefix="peer_restore_", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
    ) as tmp:
        ctx = mp.start_processes(
            _rank_main, args=(2, tmp, args.preset, args.reps), nprocs=2, join=False, start_method="spawn"
        )
        while not ctx.join(timeout=600):
            pass
        errors = sorted(Path(tmp).glob("error*.txt"))
        if errors:
            raise RuntimeError("\n".join(e.read_text() for e in errors))
        raw = json.loads((Path(tmp) / "result.json").read_text())
    summaries = {name: summarize(raw["samples"][name]) for name in FIGURES}
    med = {name: summaries[name]["median_s"] for name in FIGURES}
    result: dict[str, Any] = {
        "title": TITLE,
        "command": command_line(MODULE, argv),
        "when": now_iso(),
        "machine": machine_info(),
        "preset": args.preset,
        "reps": args.reps,
        "state_bytes": raw["state_bytes"],
        "shard_bytes": raw["shard_bytes"],
        "restore": summaries,
        "ratios": {
            "peer_ram_over_local_warm": ratio(med["peer_ram"], med["local_warm"]),
            "peer_ram_over_local_cold": ratio(med["peer_ram"], med["local_cold"]),
            "peer_ram_over_own_tmpfs": ratio(med["peer_ram"], med["own_tmpfs"]),
            "peer_ram_over_memory": ratio(med["peer_ram"], med["memory"]),
        },
        "peer_link_mb_per_s": (raw["shard_bytes"] / med["peer_ram"] / 1e6) if med["peer_ram"] else None,
    }
    out = write_json(args.out, result)
    print_flush(render_markdown(result))
    print_flush(f"wrote {out}")
    return 0


def render_markdown(result: dict[str, Any]) -> str:
    r = result["restore"]
    q = result["ratios"]

    rows = [
        ["peer RAM (node lost: shard fetched from the other node)", fmt_ms(r["peer_ram"]["median_s"]), fmt_ratio(1.0)],
        [
            "own node tmpfs (process restart)",
            fmt_ms(r["own_tmpfs"]["median_s"]),
            fmt_ratio(q["peer_ram_over_own_tmpfs"]),
        ],
        ["local disk, page cache warm", fmt_ms(r["local_warm"]["median_s"]), fmt_ratio(q["peer_ram_over_local_warm"])],
        ["local disk, cold", fmt_ms(r["local_cold"]["median_s"]), fmt_ratio(q["peer_ram_over_local_cold"])],
        ["RAM snapshot in the process", fmt_ms(r["memory"]["median_s"]), fmt_ratio(q["peer_ram_over_memory"])],
    ]
    mb = result["state_bytes"] / 1e6
    link = result.get("peer_link_mb_per_s")
    return "\n".join(
        [
            f"## {result['title']}",
            "",
            f"`{result['command']}` ({result['when']}), TinyGPT `{result['preset']}`, {mb:.1f} MB of state per rank, "
            f"{result['reps']} interleaved repetitions, medians. Restore time of rank 1 through "
            "`CheckpointManager.restore`, every restored state checked bit for bit; the last column is peer RAM "
            "time / that row's time.",
            "",
            md_table(["restored from", "median", "peer RAM / this"], rows),
            "",
            f"A lost node's rank gets its newest step back from its peer at {link:.0f} MB/s end to end (gather, "
            "send over gloo, commit to tmpfs, checksum, load) on loopback; without the peer copy the same job would "
            "fall back to the remote tier (see the remote tier table) or start over."
            if link
            else "",
            "",
        ]
    )


def readme_summary(result: dict[str, Any]) -> str:
    r = result["ratios"]
    return (
        f"**peer replication**: a lost node's rank gets its newest step back from its peer's RAM "
        f"({result['shard_bytes'] / 1e6:.0f} MB at {result['peer_link_mb_per_s']:.0f} MB/s over loopback gloo), "
        f"{r['peer_ram_over_local_warm']:.1f}x the time of a warm local-disk restore, where without it the job "
        "would go back to the remote tier."
    )


if __name__ == "__main__":
    raise SystemExit(main())
