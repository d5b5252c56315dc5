"""Resume latency against the position in the epoch: index-level skipping vs fetching every skipped batch.

Run from the repository root::

    python -m benchmarks.data_resume            # positions 10, 10^4, 10^6 of an epoch of 1.25M batches (minutes)
    python -m benchmarks.data_resume --quick    # smoke mode: positions 10 and 1000, 2 repetitions (seconds)

A synthetic map-style dataset (each item a 64-float tensor built from its index, cheap but real to fetch and collate)
is read by a ``DataLoader(shuffle=True, batch_size=8)`` with ``num_workers`` 0 and 2. Each figure is the time from
``iter()`` to the first batch, median of the repetitions, interleaved round-robin so that drift on a shared machine
hits every figure alike:

* **fresh**: a new epoch (the sampler draws its permutation of the whole dataset, workers start);
* **resume at k** (ours): a loader holding the state of one that consumed ``k`` batches resumes there: the epoch's
  permutation is drawn again from the saved RNG state, ``k`` batches of indices are skipped, nothing skipped is
  fetched or collated;
* **fetch-and-discard at k** (the previous ``ResumableDataLoader``, and what a loader without a position must do):
  the epoch restarts and ``k`` batches are fetched, collated and thrown away; measured at the small positions only
  (at 10^6 it takes minutes).

CPU only; the ratio to a fresh start is what carries over to another machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks._common import (
    command_line,
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
from lightning_resilience.checkpoint.dataloader import ResumableDataLoader

MODULE = "benchmarks.data_resume"
DEFAULT_OUT = "benchmarks/results/data_resume.json"
TITLE = "Data position: resume latency against the position in the epoch"
BATCH = 8
pc = time.perf_counter


class Items(Dataset[torch.Tensor]):
    """``n`` items; item ``i`` is 64 floats derived from ``i`` (no storage: any size is free)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> torch.Tensor:
        return torch.arange(64, dtype=torch.float32) + float(idx)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small positions, 2 repetitions")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.positions = [10, 1_000] if args.quick else [10, 10_000, 1_000_000]
    args.baseline_max = 1_000 if args.quick else 10_000
    args.reps = 2 if args.quick else args.reps
    return args


def _loader(n: int, workers: int, resumable: bool) -> DataLoader:
    cls = ResumableDataLoader if resumable else DataLoader
    return cls(Items(n), batch_size=BATCH, shuffle=True, num_workers=workers)


def _first_batch(loader: DataLoader, skip: int = 0) -> float:
    start = pc()
    it = iter(loader)
    for _ in range(skip):  # fetched, collated, discarded
        next(it)
    next(it)
    elapsed = pc() - start
    del it  # shuts the workers down outside the timed part
    return elapsed


def _state_at(n: int, position: int) -> dict[str, Any]:
    """The state of a loader that consumed ``position`` batches of its epoch (one batch is read to start it)."""
    torch.manual_seed(0)
    source = _loader(n, 0, resumable=True)
    it = iter(source)
    next(it)
    state = source.state_dict()
    del it
    return {**state, "position": position}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    # the largest position sits inside the epoch, not at its end
    n = (max(args.positions) + (1_000 if args.quick else 250_000)) * BATCH
    states = {k: _state_at(n, k) for k in args.positions}

    cases: dict[str, Callable[[], float]] = {}
    for w in args.workers:
        cases[f"w{w}/fresh"] = lambda w=w: _first_batch(_loader(n, w, resumable=False))
        for k in args.positions:

            def resumed(w: int = w, k: int = k) -> float:
                loader = _loader(n, w, resumable=True)
                loader.load_state_dict(states[k])
                return _first_batch(loader)

            cases[f"w{w}/resume@{k}"] = resumed
            if k <= args.baseline_max:
                cases[f"w{w}/discard@{k}"] = lambda w=w, k=k: _first_batch(_loader(n, w, resumable=False), skip=k)

    samples: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(args.reps):
        for name, case in cases.items():
            torch.manual_seed(rep)
            samples[name].append(case())
        print_flush(f"repetition {rep + 1}/{args.reps} done")
    figures = {name: summarize(xs) for name, xs in samples.items()}
    med = {name: f["median_s"] for name, f in figures.items()}
    result: dict[str, Any] = {
        "title": TITLE,
        "command": command_line(MODULE, argv),
        "when": now_iso(),
        "machine": machine_info(),
        "dataset_items": n,
        "batch_size": BATCH,
        "positions": args.positions,
        "workers": args.workers,
        "reps": args.reps,
        "figures": figures,
        "ratios": {
            name: ratio(med[name], med[f"{name.split('/')[0]}/fresh"]) for name in cases if "/fresh" not in name
        },
    }
    out = write_json(args.out, result)
    print_flush(render_markdown(result))
    print_flush(f"wrote {out}")
    return 0


def render_markdown(result: dict[str, Any]) -> str:
    f, q = result["figures"], result["ratios"]
    rows = []
    for w in result["workers"]:
        rows.append([f"{w}", "fresh epoch", fmt_ms(f[f"w{w}/fresh"]["median_s"]), fmt_ratio(1.0), "", ""])
        for k in result["positions"]:
            discard = f.get(f"w{w}/discard@{k}")
            rows.append(
                [
                    f"{w}",
                    f"resume at batch {k:,}",
                    fmt_ms(f[f"w{w}/resume@{k}"]["median_s"]),
                    fmt_ratio(q[f"w{w}/resume@{k}"]),
                    fmt_ms(discard["median_s"]) if discard else "not run (minutes)",
                    fmt_ratio(q[f"w{w}/discard@{k}"]) if discard else "",
                ]
            )
    return "\n".join(
        [
            f"## {result['title']}",
            "",
            f"`{result['command']}` — {result['when']}, {result['reps']} repetitions (median), "
            f"{result['dataset_items']:,} items, batch size {result['batch_size']}, `DataLoader(shuffle=True)`; "
            "CPU only.",
            "",
            "Time from `iter()` to the first batch. *Index-level skip* is what `TieredCheckpoint` does to a plain "
            "`DataLoader` (and `ResumableDataLoader`): the epoch's permutation is drawn again from the saved RNG "
            "state and the consumed batches are skipped as indices. *Fetch and discard* re-reads them (the "
            "previous `ResumableDataLoader`; any loader without a position).",
            "",
            md_table(
                [
                    "workers",
                    "position",
                    "index-level skip",
                    "vs fresh start",
                    "fetch and discard",
                    "vs fresh start",
                ],
                rows,
            ),
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
