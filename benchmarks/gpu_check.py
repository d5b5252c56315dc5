"""The GPU check: one prepared script for a machine with a CUDA device. Writes one JSON that names the device.

Run from the repository root on the GPU machine (``make gpu-check``)::

    python -m benchmarks.gpu_check                       # over 7 minutes on one H200: allow 12
    python -m benchmarks.gpu_check --cpu-smoke --out /tmp/g.json   # the same flow on the CPU, tiny model (a test)

The overlap, the CUDA tests and the SDC part take a minute or two; the step-time slowdown most of the time (a 6.5 GB
state: each disk save and, with torch 2.11, each DCP save into a new stager's buffers take seconds; one such run had
not finished in 400 s). In order, the short parts first, each bounded and recorded even when another fails (the JSON
is rewritten after each part):

1. **pinned-memory overlap**: forward+backward alone, the full state's device-to-host copy into pinned memory on a
   side stream alone, and both together; overlap = 1 - (together - alone) / copy.
2. **sync-debug tests**: ``pytest`` on the CUDA tests of the step path (``tests/perf/test_sync_debug_cuda.py``: the
   default preset's engines under ``torch.cuda.set_sync_debug_mode("error")`` and a Lightning run with every
   synchronisation attributed; the snapshot and SDC CUDA tests).
3. **SDC on the device**: the default SDC preset's step-time overhead with the ~1.08B-parameter GPT in bf16, against
   a plain loop and the floor of its checks, in a process of its own (``benchmarks/_sdc/device.py``), target <= 2%.
4. **step-time slowdown** of per-step snapshots with the ~1.08B-parameter GPT in bf16 (``benchmarks.checkpoint``'s
   rotation: none, ours with the default preset's tiers, DCP at its best at the same cadence), targets: ours <= 1%
   of the step, DCP's slowdown >= 3x ours.
5. **NCCL DDP drills** (2 ranks, ``resilience=default`` and ``full``, the host-sync count) when 2 GPUs are present;
   recorded as skipped otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import (
    REPO_ROOT,
    add_load_argument,
    check_load_at_start,
    command_line,
    finish_load,
    fmt_ms,
    fmt_pct,
    machine_info,
    md_table,
    now_iso,
    print_flush,
    tail_key,
    target,
    write_json,
)
from benchmarks._sdc.device import describe

__all__ = ["DEFAULT_OUT", "REQUIRES_CUDA", "TITLE", "main", "readme_summary", "render_markdown"]

MODULE = "benchmarks.gpu_check"
DEFAULT_OUT = "benchmarks/results/gpu_check.json"
TITLE = "GPU check: step-time slowdown of per-step snapshots (1B model, bf16), host syncs, overlap"
REQUIRES_CUDA = True
SYNC_TESTS = [
    "tests/perf/test_sync_debug_cuda.py",
    "tests/checkpoint/test_snapshot_cuda.py",
    "tests/sdc/test_sdc_cuda.py",
]


def _part(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    print_flush(f"[gpu_check] {name} ...")
    t0 = time.perf_counter()
    try:
        results[name] = {"ok": True, **fn()}
    except Exception as err:  # one part failing must not lose the others' figures
        results[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    results[name]["wall_s"] = time.perf_counter() - t0
    print_flush(f"[gpu_check] {name}: {'ok' if results[name]['ok'] else results[name]['error']}")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def sync_tests(timeout: float, log: Path) -> dict[str, Any]:
    """The CUDA tests; their whole output goes to ``log`` (a failure's message can sit above many screens of a
    Lightning run's report), the failures' short tracebacks and the summary into the result."""
    cmd = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-rfEs", "-p", "no:randomly", *SYNC_TESTS]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    text = proc.stdout + proc.stderr
    log.write_text(text)
    lines = text.splitlines()
    summary = next((line for line in reversed(lines) if " passed" in line or " failed" in line), "")
    failures = [line for line in lines if line.startswith(("E   ", "FAILED ", "ERROR ", "_____"))]
    return {
        "returncode": proc.returncode,
        "passed": proc.returncode == 0,
        "summary": summary,
        "failures": "\n".join(failures)[-12000:],
        "output_tail": text[-4000:],
        "log": log.name,
    }


def slowdown(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks import checkpoint

    argv = (
        ["--preset", "tiny", "--device", "cpu", "--quick", "--no-lightning", "--no-process"]
        if args.cpu_smoke
        else [
            "--preset",
            "1b",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--batch-size",
            str(args.batch_size),
            "--turn",
            "10",
            "--rounds",
            str(args.rounds),
            "--warmup",
            "3",
            "--restore-reps",
            "2",
            "--no-lightning",
            "--allow-loaded",  # checked once, by this script, at its start
            *([] if args.with_process else ["--no-process"]),
        ]
    )
    if args.tmpdir:
        argv += ["--tmpdir", args.tmpdir]
    result = checkpoint.run(checkpoint.parse_args(argv), argv)
    return {"command": command_line("benchmarks.checkpoint", argv), "result": result}


def overlap(args: argparse.Namespace) -> dict[str, Any]:
    """Forward+backward alone, the state's device-to-host copy alone, both at once (CUDA events, medians)."""
    import statistics

    import torch

    from benchmarks import checkpoint
    from benchmarks._workload import GPTWorkload
    from lightning_resilience.checkpoint.snapshot import SnapshotPool
    from lightning_resilience.checkpoint.tree import flatten_state

    device = "cpu" if args.cpu_smoke else "cuda"
    cfg = checkpoint.model_config(
        argparse.Namespace(preset="tiny" if args.cpu_smoke else "1b", d_model=None, n_layer=None, seq_len=None)
    )
    wl = GPTWorkload(
        cfg, 1 if args.cpu_smoke else args.batch_size, device=device, dtype=None if args.cpu_smoke else torch.bfloat16
    )
    wl.step()
    pool = SnapshotPool(max_slots=2)
    flat = flatten_state(wl.state())
    every = (lambda t: True) if device == "cuda" else None

    def timed(fn: Callable[[], None]) -> float:
        if device != "cuda":
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def fwd_bwd() -> None:
        loss = wl.model.compute_loss(wl.batches[0])
        loss.backward()
        wl.opt.zero_grad(set_to_none=True)

    def copy() -> None:
        slot = pool.capture(0, flat, {}, overlap=every)
        pool.order_inflight()
        pool.release(slot)

    def both() -> None:
        slot = pool.capture(0, flat, {}, overlap=every)
        fwd_bwd()
        pool.order_inflight()
        pool.release(slot)

    for fn in (fwd_bwd, copy, both):
        timed(fn)  # warm-up: allocations, pinned buffers
    reps = 2 if args.cpu_smoke else 5
    alone, copies, together = [], [], []
    for _ in range(reps):
        alone.append(timed(fwd_bwd))
        copies.append(timed(copy))
        together.append(timed(both))
    a, c, t = (statistics.median(x) for x in (alone, copies, together))
    pool.close()
    return {
        "pinned": pool.pinned,
        "state_bytes": sum(x.numel() * x.element_size() for x in flat.tensors.values()),
        "fwd_bwd_s": a,
        "copy_s": c,
        "together_s": t,
        "copy_gb_per_s": sum(x.numel() * x.element_size() for x in flat.tensors.values()) / c / 1e9 if c else None,
        "overlap": 1.0 - (t - a) / c if c else None,
        "samples": {"fwd_bwd_s": alone, "copy_s": copies, "together_s": together},
    }


def sdc(args: argparse.Namespace) -> dict[str, Any]:
    """The default SDC preset's step-time overhead on the device, against a plain loop and the floor of its checks."""
    from benchmarks._sdc import device

    return device.run(Path(args.out).with_suffix(".sdc.json"), smoke=args.cpu_smoke, batch_size=args.sdc_batch_size,
                      windows=args.sdc_windows, timeout_s=args.part_timeout)  # fmt: skip


def nccl_drills(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2 or args.cpu_smoke:
        return {"skipped": f"needs 2 GPUs for 2 NCCL ranks; this machine has {gpus}"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:randomly",
        "tests/perf/test_sync_debug_cuda.py",
        "-k",
        "nccl",
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=args.part_timeout)
    return {
        "returncode": proc.returncode,
        "passed": proc.returncode == 0,
        "output_tail": (proc.stdout + proc.stderr)[-4000:],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="run the flow on the CPU with a tiny model (a test)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences of 2048 tokens per step (1B model)")
    p.add_argument("--rounds", type=int, default=2, help="turns of 10 steps per contender")
    p.add_argument("--sdc-batch-size", type=int, default=2, help="sequences of 2048 tokens a step (the SDC part)")
    p.add_argument("--sdc-windows", type=int, default=20, help="windows of 10 steps an arm (the SDC part)")
    p.add_argument("--with-process", action="store_true", help="also DCP's process executor (slower to run)")
    p.add_argument("--part-timeout", type=float, default=300.0, help="bound on each subprocess part (s)")
    p.add_argument("--skip", action="append", default=[], help="leave out a part (sync_tests, slowdown, ...)")
    p.add_argument("--tmpdir", default=None, help="where disk checkpoints go")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    add_load_argument(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print_flush("[gpu_check] no CUDA device: nothing to check (use --cpu-smoke to exercise the script)")
        return 2
    started = time.perf_counter()
    machine = machine_info()
    check_load_at_start(machine, allow=args.allow_loaded, quick=args.cpu_smoke, name=MODULE)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        machine.update(
            device=torch.cuda.get_device_name(0),
            device_count=torch.cuda.device_count(),
            device_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    parts: dict[str, Any] = {}
    # the short parts first: a run stopped at its limit keeps them (the slowdown takes minutes at 1B)
    plan: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("overlap", lambda: overlap(args)),
        ("sync_tests", lambda: sync_tests(args.part_timeout, Path(args.out).with_suffix(".pytest.txt"))),
        ("sdc", lambda: sdc(args)),
        ("slowdown", lambda: slowdown(args)),
        ("nccl_drills", lambda: nccl_drills(args)),
    ]
    date = now_iso()

    def result() -> dict[str, Any]:
        return {
            "benchmark": "gpu_check",
            "title": TITLE,
            "command": command_line(MODULE, argv),
            "date": date,
            "cpu_smoke": args.cpu_smoke,
            "machine": machine,
            "parts": parts,
            "targets": _targets(parts),
            "total_wall_s": time.perf_counter() - started,
        }

    for name, fn in plan:
        if name not in args.skip:
            _part(parts, name, fn)
            write_json(args.out, result())  # the parts done so far survive a run stopped at its limit
    finish_load(machine)
    final = result()
    out = write_json(args.out, final)
    print_flush(render_markdown(final))
    print_flush(f"\nwrote {out}")
    return 0 if all(p["ok"] for p in parts.values()) else 1


def _slow(parts: dict[str, Any]) -> dict[str, Any] | None:
    s = parts.get("slowdown") or {}
    return s.get("result") if s.get("ok") else None


def _targets(parts: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    r = _slow(parts)
    if r is not None:
        out += [t for t in r["targets"] if not t["name"].startswith("restore")]
    sync = parts.get("sync_tests") or {}
    out.append(target("sync-debug tests pass", 1.0 if sync.get("passed") else 0.0, ">=", 1.0))
    ov = parts.get("overlap") or {}
    if ov.get("ok"):
        out.append(target("device-to-host copy hidden behind forward+backward", ov["overlap"], ">=", 0.9, "fraction"))
    if (parts.get("sdc") or {}).get("ok"):
        o = parts["sdc"]
        out.append(target("SDC default preset: step-time overhead on the device (mean)", o["slowdown_mean"], "<=",
                          0.02, "fraction"))  # fmt: skip
    return out


def render_markdown(result: dict[str, Any]) -> str:
    m, parts = result["machine"], result["parts"]
    device = m.get("device") or "CPU (smoke run: no GPU figure)"
    out = [
        f"## {TITLE}",
        "",
        f"*Command:* `{result['command']}` · *Date:* {result['date']} · *Device:* {device}"
        + (
            f" ({m.get('device_count')} visible, {m.get('device_memory_gib')} GiB, CUDA {m.get('cuda')})"
            if m.get("device")
            else ""
        )
        + f" · *Run time:* {result['total_wall_s'] / 60:.1f} min",
        "",
    ]
    if result.get("cpu_smoke"):
        out += ["**CPU smoke run of the script: no GPU figure.**", ""]
    r = _slow(parts)
    if r is not None:
        rows = [
            [
                n,
                fmt_ms(s["mean_s"]),
                f"{fmt_ms(s[tail_key(s)])} ({tail_key(s).removesuffix('_s')})",
                _pct(r["slowdown"].get(n, {}).get("mean")),
                _pct(r["slowdown"].get(n, {}).get("p99")),
                ""
                if r["ratios"].get(f"{n}_over_floor_mean") is None
                else f"{r['ratios'][f'{n}_over_floor_mean']:.1f}x",
            ]
            for n, s in r["step_time"].items()
        ]
        cfg = r["config"]
        out += [
            f"Step-time slowdown: {cfg['params'] / 1e9:.2f}B parameters ({cfg['dtype']}), "
            f"{cfg['state_bytes'] / 1e9:.1f} GB of state, batch {cfg['batch_size']} x {cfg['model']['seq_len']}, "
            f"turns of {cfg['turn']} steps x {cfg['rounds']} rounds; per-step times from CUDA events.",
            "",
            md_table(["contender", "mean step", "tail", "slowdown (mean)", "(tail)", "x floor (mean)"], rows),
            "",
        ]
    ov = parts.get("overlap") or {}
    if ov.get("ok"):
        out += [
            f"Overlap (pinned: {ov['pinned']}): forward+backward {fmt_ms(ov['fwd_bwd_s'])}, copy of "
            f"{ov['state_bytes'] / 1e9:.2f} GB {fmt_ms(ov['copy_s'])} ({ov['copy_gb_per_s']:.1f} GB/s), both "
            f"{fmt_ms(ov['together_s'])}: {fmt_pct(ov['overlap'])} of the copy hidden.",
            "",
        ]
    if (parts.get("sdc") or {}).get("ok"):
        out += [describe(parts["sdc"]), ""]
    status = []
    for name, p in parts.items():
        what = p.get("summary") or p.get("skipped") or ("ok" if p["ok"] else p.get("error", ""))
        status.append([name, "ok" if p["ok"] else "FAILED", f"{p['wall_s']:.0f} s", what])
    out += [md_table(["part", "status", "time", "detail"], status), ""]
    out.append(
        md_table(
            ["target", "value", "goal", "verdict"],
            [[t["name"], _fmt(t), f"{t['op']} {t['threshold']:g}", t["verdict"]] for t in result["targets"]],
        )
    )
    return "\n".join(out) + "\n"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.2f}%"


def _fmt(t: dict[str, Any]) -> str:
    v = t["value"]
    return "n/a" if v is None else (fmt_pct(v) if t["unit"] == "fraction" else f"{v:.2f}{t['unit']}")


def readme_summary(result: dict[str, Any]) -> str:
    device = result["machine"].get("device") or "CPU smoke run"
    r = _slow(result["parts"])
    if r is None:
        slow = result["parts"].get("slowdown")
        ov, sync = result["parts"].get("overlap") or {}, result["parts"].get("sync_tests") or {}
        return (
            f"**GPU check** ({device}): step-time slowdown "
            + ("not measured in this run" if slow is None else "part failed")
            + (
                f"; {fmt_pct(ov['overlap'])} of the {ov['state_bytes'] / 1e9:.1f} GB device-to-host copy hidden "
                f"behind forward+backward ({ov['copy_gb_per_s']:.0f} GB/s pinned)"
                if ov.get("ok")
                else ""
            )
            + f"; sync-debug tests: {sync.get('summary') or 'not run'}. See docs/benchmarks.md."
        )
    best, ours = r["ratios"]["best_dcp"], r["slowdown"]["ours"]
    floor = r["ratios"].get("ours_ram_over_floor_mean")
    return (
        f"**GPU check** ({device}, {r['config']['params'] / 1e9:.2f}B-parameter GPT in bf16): "
        + (f"a per-step RAM snapshot costs {floor:.1f}x the bare copy of the state (the floor); " if floor else "")
        + f"per-step snapshots with the disk every 10 slow the step by {_pct(ours['mean'])} mean "
        f"({_pct(ours['p99'])} {ours.get('tail', 'p99')}); DCP at its "
        f"best at the same cadence by {_pct(r['slowdown'][best]['mean'])}; sync-debug tests "
        f"{'pass' if (result['parts'].get('sync_tests') or {}).get('passed') else 'FAIL'}."
    )


if __name__ == "__main__":
    raise SystemExit(main())
