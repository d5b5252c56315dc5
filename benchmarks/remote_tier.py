"""Restoring from RAM, local disk and S3; RemoteTier's upload throughput against the raw bandwidth of the same link.

Run from the repository root::

    python -m benchmarks.remote_tier            # TinyGPT "mid" (~7M parameters, ~83 MB model + AdamW state)
    python -m benchmarks.remote_tier --quick    # smoke mode: TinyGPT tiny (~5 MB), 3 repetitions (seconds)

One process builds a training state (TinyGPT after one AdamW step: weights and both moment estimates), starts an
S3-compatible server on loopback (moto's ``ThreadedMotoServer``, in this process) and measures, repetitions
interleaved round-robin (the order rotating) so that drift on a shared machine hits every figure alike:

* **writes**: ``LocalTier.write`` (stage + fsync + rename), ``RemoteTier.write`` (stage in a temp dir, upload every
  file, manifest last) and, as the link's raw bandwidth, a plain s3fs ``put`` of one file of the same total size to
  the same server; throughput is shard bytes / seconds and the upload ratio is ours / raw. A plain s3fs ``get`` of
  that file is the raw download figure.
* **restores** of the same step through :meth:`CheckpointManager.restore`: from RAM (a ``MemoryTier`` hands its
  buffers over, so a fresh untimed snapshot is taken before every repetition), from local disk (a fresh manager on a
  ``LocalTier``, page cache warm, and once more after asking the kernel to drop the files' pages) and from the
  S3 server (a fresh manager on a ``RemoteTier`` ``s3://bucket/prefix``). Every restored state is compared with
  the original, bit for bit (untimed).

The server shares this process (and its GIL) and the machine's cores with the client: the loopback link is not a
network, and absolute numbers do not transfer to real S3. Compare the ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import (
    command_line,
    evict_page_cache,
    fmt_ms,
    machine_info,
    now_iso,
    print_flush,
    ratio,
    summarize,
    write_json,
)
from benchmarks._remote_render import TITLE, print_table, readme_summary, render_markdown
from benchmarks._workload import GPTWorkload
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.remote import RemoteTier
from lightning_resilience.checkpoint.snapshot import StagedSnapshot
from lightning_resilience.checkpoint.tier import TierIdentity
from lightning_resilience.checkpoint.tree import flatten_state

MODULE = "benchmarks.remote_tier"
DEFAULT_OUT = "benchmarks/results/remote.json"
__all__ = ["DEFAULT_OUT", "TITLE", "main", "readme_summary", "render_markdown"]

pc = time.perf_counter

BUCKET = "bench"
PREFIX = "run"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
FIRST_STEP = 1000

# a mid-size TinyGPT between the "tiny" (0.44M) and "small" (23.2M) presets: ~6.9M parameters, so weights plus the
# two AdamW moments come to ~83 MB of float32
MID_OVERRIDES: dict[str, Any] = {"vocab_size": 4096, "seq_len": 128, "d_model": 384, "n_layer": 3, "n_head": 6}


def model_kwargs_for(preset: str) -> dict[str, Any]:
    from recipes._gpt import gpt_preset

    if preset == "mid":
        return {**gpt_preset("small"), **MID_OVERRIDES}
    return gpt_preset(preset)


# ---------------------------------------------------------------------------------------------------- workload
class Workload(GPTWorkload):
    """TinyGPT after a few AdamW steps: the state is model + optimizer + LR scheduler."""

    def __init__(self, model_kwargs: dict[str, Any], batch_size: int, train_steps: int, seed: int) -> None:
        super().__init__(model_kwargs, batch_size, seed)
        for _ in range(train_steps):  # populates the AdamW moments
            self.step()
        self.params = self.param_counts()[1]


def check_same(restored: Any, reference: StagedSnapshot, where: str) -> None:
    """The restored state must equal the snapshot bit for bit (a benchmark of a wrong restore is worthless)."""
    tensors = flatten_state(restored).tensors
    if tensors.keys() != reference.tensors.keys():
        raise RuntimeError(f"{where}: restored tensor names differ from the snapshot's")
    for name, tensor in reference.tensors.items():
        if not torch.equal(tensors[name], tensor):
            raise RuntimeError(f"{where}: tensor {name} differs after restore")


# ---------------------------------------------------------------------------------------------------- S3 server
class LoopbackS3:
    """moto's threaded S3 server on 127.0.0.1 (a free port), with one bucket."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        ).create_bucket(Bucket=BUCKET)

    def storage_options(self) -> dict[str, Any]:
        return {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION},
            "skip_instance_cache": True,
            "use_listings_cache": False,
        }

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options())

    def stop(self) -> None:
        self.server.stop()


# ---------------------------------------------------------------------------------------------------- measuring
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = pc()
    out = fn()
    return pc() - start, out


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def remote_shard_bytes(tier: RemoteTier, step: int) -> int:
    found = tier.fs.find(tier.shard_path(step), detail=True)
    return sum(int(info["size"]) for info in found.values())


def write_random_file(path: Path, size: int) -> None:
    gen = torch.Generator().manual_seed(1)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 8 << 20)
            f.write(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())


def measure_writes(
    args: argparse.Namespace, snap_for: Callable[[int], StagedSnapshot], local_root: Path, s3: LoopbackS3, tmp: Path
) -> tuple[dict[str, Any], int]:
    """Round-robin: LocalTier.write, RemoteTier.write, raw s3fs put (+ get) of a file of the shard's size."""
    local = LocalTier(local_root, every_n_steps=1, keep=args.reps)
    remote = RemoteTier(
        f"s3://{BUCKET}/{PREFIX}", every_n_steps=1, keep=args.reps, storage_options=s3.storage_options()
    )
    for tier in (local, remote):
        tier.bind(TierIdentity())
    raw_fs = s3.filesystem()
    raw_src, raw_dst = tmp / "raw.bin", tmp / "raw-back.bin"
    samples: dict[str, list[float]] = {"local": [], "remote": [], "raw_put": [], "raw_get": []}
    local_bytes = remote_bytes = raw_bytes = 0
    tensor_bytes = 0
    step = FIRST_STEP
    dts: dict[str, float] = {}  # this round's timings
    cur: dict[str, Any] = {}  # this round's step and snapshot

    def write_local() -> None:
        nonlocal local_bytes
        dts["local"], _ = timed(lambda: local.write(cur["snap"]))
        local_bytes = dir_bytes(local.shard_dir(cur["step"]))

    def write_remote() -> None:
        nonlocal remote_bytes, raw_bytes
        dts["remote"], _ = timed(lambda: remote.write(cur["snap"]))
        remote_bytes = remote_shard_bytes(remote, cur["step"])
        if raw_bytes != remote_bytes:
            write_random_file(raw_src, remote_bytes)  # untimed; the staged shard is in the page cache too
            raw_bytes = remote_bytes

    def raw_round_trip() -> None:
        key = f"{BUCKET}/raw/blob-{cur['step']}.bin"
        dts["raw_put"], _ = timed(lambda: raw_fs.put(str(raw_src), key))
        dts["raw_get"], _ = timed(lambda: raw_fs.get(key, str(raw_dst)))
        if raw_dst.stat().st_size != raw_bytes:
            raise RuntimeError(f"raw get returned {raw_dst.stat().st_size} bytes, expected {raw_bytes}")
        raw_fs.rm(key)
        raw_dst.unlink()

    # rep -1 is an untimed warm-up round (the first request to the server and the first write pay one-off costs);
    # it runs in this order (the raw file gets the shard's size); then the order rotates, so whatever
    # one path leaves behind (writeback, garbage, a busy server thread) hits each path alike
    units = [write_local, write_remote, raw_round_trip]
    for rep in range(-1, args.reps):
        step = FIRST_STEP + rep + 1
        cur["step"], cur["snap"] = step, snap_for(step)
        tensor_bytes = cur["snap"].nbytes
        dts.clear()
        turn = max(rep, 0) % len(units)
        for unit in units[turn:] + units[:turn]:
            unit()
        dt_local, dt_remote, dt_put, dt_get = dts["local"], dts["remote"], dts["raw_put"], dts["raw_get"]
        if rep >= 0:
            samples["local"].append(dt_local)
            samples["remote"].append(dt_remote)
            samples["raw_put"].append(dt_put)
            samples["raw_get"].append(dt_get)
        if step > FIRST_STEP:  # only the newest step stays: it is the one restored below
            local.delete(step - 1)
            remote.delete(step - 1)
        print_flush(
            f"[remote] write rep {rep + 1}/{args.reps}{' (warm-up)' if rep < 0 else ''}: local {fmt_ms(dt_local)}, "
            f"remote {fmt_ms(dt_remote)}, raw put {fmt_ms(dt_put)}, raw get {fmt_ms(dt_get)}"
        )
    raw_src.unlink()
    if local.list_steps() != [step] or remote.list_steps() != [step]:
        raise RuntimeError(f"expected only step {step} in both tiers, got {local.list_steps()} / {remote.list_steps()}")

    def entry(key: str, nbytes: int) -> dict[str, Any]:
        s = summarize(samples[key])
        return {"bytes": nbytes, "time": s, "throughput_Bps": ratio(nbytes, s["median_s"])}

    writes = {
        "tensor_bytes": tensor_bytes,
        "local_tier_write": entry("local", local_bytes),
        "remote_tier_write": entry("remote", remote_bytes),
        "raw_s3fs_put": entry("raw_put", raw_bytes),
        "raw_s3fs_get": entry("raw_get", raw_bytes),
        "remote_retries": remote.retries_total,
    }
    return writes, step


def measure_restores(
    args: argparse.Namespace, wl: Workload, step: int, reference: StagedSnapshot, local_root: Path, s3: LoopbackS3
) -> dict[str, Any]:
    """Round-robin: RAM (fresh snapshot each time), local disk warm and cold, S3; all via CheckpointManager.restore."""
    ram = CheckpointManager([MemoryTier(every_n_steps=1, keep=1)])
    ram.setup()
    samples: dict[str, list[float]] = {"memory": [], "local": [], "local_cold": [], "remote": []}
    setup_s: dict[str, list[float]] = {"local": [], "local_cold": [], "remote": []}
    remote_retries = 0

    def restore_ram() -> float:
        ram.on_step(step, wl.state)  # untimed: the previous restore took the buffers
        ram.wait_snapshot()
        dt, res = timed(lambda: ram.restore(step))
        if res is None or res.tier != "memory" or res.step != step:
            raise RuntimeError(f"expected step {step} from the memory tier, got {res and (res.tier, res.step)}")
        check_same(res.state, reference, "memory")
        return dt

    def restore_fresh(make: Callable[[], Any], name: str, cold: bool = False) -> float:
        nonlocal remote_retries
        tier = make()
        mgr = CheckpointManager([tier])
        dt_setup, _ = timed(mgr.setup)
        setup_s[f"{name}_cold" if cold else name].append(dt_setup)
        if cold:
            evict_page_cache(local_root)
        dt, res = timed(lambda: mgr.restore(step))
        mgr.close()
        if res is None or res.tier != name or res.step != step:
            raise RuntimeError(f"expected step {step} from the {name} tier, got {res and (res.tier, res.step)}")
        check_same(res.state, reference, name)
        if isinstance(tier, RemoteTier):
            remote_retries += tier.retries_total
        return dt

    def make_local() -> LocalTier:
        return LocalTier(local_root, every_n_steps=1, keep=args.reps)

    def make_remote() -> RemoteTier:
        return RemoteTier(
            f"s3://{BUCKET}/{PREFIX}", every_n_steps=1, keep=args.reps, storage_options=s3.storage_options()
        )

    paths: list[tuple[str, Callable[[], float]]] = [
        ("memory", restore_ram),
        ("local", lambda: restore_fresh(make_local, "local")),
        ("local_cold", lambda: restore_fresh(make_local, "local", cold=True)),
        ("remote", lambda: restore_fresh(make_remote, "remote")),
    ]
    for rep in range(-1, args.reps):  # rep -1: untimed warm-up of every path
        turn = max(rep, 0) % len(paths)  # rotate the order, as for the writes
        dts = {name: fn() for name, fn in paths[turn:] + paths[:turn]}
        dts = {name: dts[name] for name, _ in paths}
        if rep >= 0:
            for key, dt in dts.items():
                samples[key].append(dt)
        print_flush(
            f"[remote] restore rep {rep + 1}/{args.reps}{' (warm-up)' if rep < 0 else ''}: "
            + ", ".join(f"{k} {fmt_ms(v)}" for k, v in dts.items())
        )
    ram.close()
    out: dict[str, Any] = {k: summarize(v) for k, v in samples.items()}
    out["setup_s"] = {k: summarize(v[1:]) for k, v in setup_s.items()}  # fresh manager + bind, without warm-up
    out["remote_retries"] = remote_retries
    return out


# ------------------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=["tiny", "mid", "small"], default=None, help="TinyGPT size (mid; quick: tiny)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per figure (8; quick: 3)")
    p.add_argument("--train-steps", type=int, default=1, help="AdamW steps before measuring (fills the moments)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per training step")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmpdir", default=None, help="where local checkpoints are written (default: system temp dir)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: tiny model, 3 repetitions")
    args = p.parse_args(argv)
    args.preset = args.preset or ("tiny" if args.quick else "mid")
    args.reps = args.reps or (3 if args.quick else 8)
    if args.reps < 3:
        p.error("--reps must be >= 3 (medians)")
    if args.train_steps < 1:
        p.error("--train-steps must be >= 1 (the AdamW moments must exist)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import botocore
    import fsspec
    import moto
    import s3fs

    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    argv = list(argv) if argv is not None else None
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_kwargs = model_kwargs_for(args.preset)
    start = pc()
    wl = Workload(model_kwargs, args.batch_size, args.train_steps, args.seed)
    reference = wl.snapshot(0)
    print_flush(
        f"[remote] preset={args.preset} params={wl.params / 1e6:.2f}M state={reference.nbytes / 1e6:.1f} MB "
        f"reps={args.reps} threads={args.threads} (built in {pc() - start:.1f}s)"
    )
    root = Path(tempfile.mkdtemp(prefix="lr-remote-bench-", dir=args.tmpdir))
    s3 = LoopbackS3()
    try:
        writes, step = measure_writes(args, wl.snapshot, root / "local", s3, root)
        restores = measure_restores(args, wl, step, reference, root / "local", s3)
    finally:
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)
    raw_put = writes["raw_s3fs_put"]["throughput_Bps"]
    ratios = {
        "upload_ours_over_raw": ratio(writes["remote_tier_write"]["throughput_Bps"], raw_put),
        "local_write_over_raw_put": ratio(writes["local_tier_write"]["throughput_Bps"], raw_put),
        "restore_local_over_memory": ratio(restores["local"]["median_s"], restores["memory"]["median_s"]),
        "restore_remote_over_memory": ratio(restores["remote"]["median_s"], restores["memory"]["median_s"]),
        "restore_remote_over_local": ratio(restores["remote"]["median_s"], restores["local"]["median_s"]),
        "restore_remote_over_raw_get": ratio(
            restores["remote"]["median_s"], writes["raw_s3fs_get"]["time"]["median_s"]
        ),
        # ~1: RemoteTier.write costs what staging (a LocalTier.write) plus one raw upload cost, one after the other
        "remote_write_over_local_write_plus_raw_put": ratio(
            writes["remote_tier_write"]["time"]["median_s"],
            writes["local_tier_write"]["time"]["median_s"] + writes["raw_s3fs_put"]["time"]["median_s"],
        ),
    }
    result = {
        "benchmark": "remote_tier",
        "command": command_line(MODULE, sys.argv[1:] if argv is None else argv),
        "date": now_iso(),
        "machine": machine_info(),
        "versions": {
            "moto": moto.__version__,
            "s3fs": s3fs.__version__,
            "fsspec": fsspec.__version__,
            "botocore": botocore.__version__,
        },
        "config": {
            "preset": args.preset,
            "model_kwargs": model_kwargs,
            "params": wl.params,
            "train_steps": args.train_steps,
            "batch_size": args.batch_size,
            "reps": args.reps,
            "threads": args.threads,
            "quick": args.quick,
            "step": step,
            "server": "moto ThreadedMotoServer on 127.0.0.1, in the benchmark process",
            "url": f"s3://{BUCKET}/{PREFIX}",
        },
        "write": writes,
        "restore": restores,
        "ratios": ratios,
        "notes": (
            "Loopback moto server in the same process: it competes with the client for the GIL and the CPUs, so "
            "absolute throughput is far below a real network link and does not transfer. Ratios are measured "
            "against a raw s3fs put/get of the same size on the same server in the same run. Throughput is shard "
            "bytes (all files, manifest included) / median seconds. local_cold asks the kernel to drop the shard's "
            "pages (posix_fadvise DONTNEED); a hypervisor cache may still serve them."
        ),
        "wall_s": pc() - start,
    }
    out = write_json(args.out, result)
    print_table(result)
    print_flush("")
    print_flush(render_markdown(result))
    print_flush(f"[remote] wrote {out} in {pc() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
