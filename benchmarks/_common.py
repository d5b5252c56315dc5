"""Helpers shared by the benchmark modules: machine facts, robust summaries, ratios, JSON and Markdown output."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "P99_MIN_SAMPLES",
    "REPO_ROOT",
    "RESULTS_DIR",
    "add_load_argument",
    "check_load_at_start",
    "command_line",
    "evict_page_cache",
    "fmt_ms",
    "fmt_pct",
    "fmt_ratio",
    "finish_load",
    "load_line",
    "load_note",
    "machine_info",
    "md_table",
    "now_iso",
    "percentile",
    "print_flush",
    "ratio",
    "report",
    "result_header",
    "run_and_publish",
    "summarize",
    "tail_key",
    "target",
    "unfit_reason",
    "targets_table",
    "write_json",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command that reproduces a run, as a user would type it from the repository root."""
    return " ".join(["python", "-m", module, *(shlex.quote(a) for a in argv)]).strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def _loadavg() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_info() -> dict[str, Any]:
    """Versions and hardware facts needed to read the figures (they are not portable across machines), and the
    load average at the start (:func:`finish_load` adds the end's and says whether the result is fit to publish)."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_gib": _mem_total_gib(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cores": _cores(),
        "loadavg_at_start": _loadavg(),
    }
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError:  # pragma: no cover - lightning is a hard dependency of the suite
        info["lightning"] = None
    try:
        from lightning_resilience import __version__ as lr_version

        info["lightning_resilience"] = lr_version
    except ImportError:  # pragma: no cover
        info["lightning_resilience"] = None
    return info


# ---------------------------------------------------------------------------------------------- machine load
def add_load_argument(parser: Any) -> None:
    """``--allow-loaded``: run on a machine loaded past its cores anyway (the result is marked unfit)."""
    parser.add_argument(
        "--allow-loaded",
        action="store_true",
        help="run although the machine is loaded past its cores (the result is marked unfit to publish)",
    )


def _loaded(load: list[float] | None, cores: int) -> bool:
    return load is not None and load[0] > cores


def check_load_at_start(machine: dict[str, Any], *, allow: bool, quick: bool = False, name: str = "") -> None:
    """Refuse to time steps on a machine whose 1-min load average already exceeds its cores: every figure would
    hold the neighbours' work. A quick (smoke) run, or ``--allow-loaded``, goes on (the result is marked unfit)."""
    load, cores = machine.get("loadavg_at_start"), int(machine.get("cores") or _cores())
    if _loaded(load, cores) and not (allow or quick):
        assert load is not None
        raise SystemExit(
            f"{name or 'benchmark'}: the 1-min load average is {load[0]:.2f} on {cores} cores: other work would be "
            "timed too. Run it on a quiet machine, or pass --allow-loaded (the result is then marked unfit)."
        )


FOREIGN_CPU_MAX = 0.1
"""Most CPU other processes may use during a benchmark that loads the machine itself, as a share of its cores."""


def cpu_counters() -> tuple[float, float, float]:
    """(busy CPU seconds of the whole machine from /proc/stat, CPU seconds of this process and of the children it
    waited for, monotonic seconds): :func:`finish_load` tells the benchmark's own CPU time from other processes'."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / tick  # all but idle and iowait (guest time is in user)
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()


def finish_load(
    machine: dict[str, Any], since: tuple[float, float, float] | None = None, *, own_extra_s: float = 0.0
) -> dict[str, Any]:
    """Record the load average at the end in ``machine`` and whether the result is fit to publish: it is not when
    the 1-min load average exceeded the cores at the start or at the end (the benchmark's own threads count too).

    A benchmark whose own processes load the machine (N ranks on its cores) passes ``since`` (:func:`cpu_counters`
    at its start): the end is then judged by the CPU time other processes used meanwhile, at most
    :data:`FOREIGN_CPU_MAX` of the cores. ``own_extra_s``: CPU seconds of its own processes that are not this
    process's waited-for children (ranks a forkserver started, which report their own)."""
    cores = int(machine.get("cores") or _cores())
    machine["loadavg_at_end"] = _loadavg()
    start, end = machine.get("loadavg_at_start"), machine["loadavg_at_end"]
    checked = (("start", start),) if since is not None else (("start", start), ("end", end))
    why = [
        f"1-min load average {load[0]:.2f} at the {when} on {cores} cores"
        for when, load in checked
        if load is not None and _loaded(load, cores)
    ]
    if since is not None:
        busy, own, now = (b - a for a, b in zip(since, cpu_counters()))
        foreign = max(0.0, busy - own - own_extra_s) / max(now * cores, 1e-9)
        machine["foreign_cpu_share"] = foreign
        if foreign > FOREIGN_CPU_MAX:
            why.append(f"other processes used {100 * foreign:.0f}% of the {cores} cores during the run")
    machine["load"] = {"cores": cores, "fit_to_publish": not why, "why": "; ".join(why) or None}
    return machine


def unfit_reason(result: dict[str, Any]) -> str | None:
    """Why a result is not fit to publish (the machine was loaded past its cores), or None."""
    load = (result.get("machine") or {}).get("load") or {}
    return None if load.get("fit_to_publish", True) else str(load.get("why"))


def load_line(machine: dict[str, Any]) -> str:
    """The load averages of a run, as the docs show them."""

    def one(key: str) -> str:
        load = machine.get(key)
        return "n/a" if not load else f"{load[0]:.1f}"

    cores = machine.get("cores") or machine.get("cpu_affinity") or machine.get("cpu_count")
    foreign = machine.get("foreign_cpu_share")
    return (
        f"1-min load average {one('loadavg_at_start')} at start, {one('loadavg_at_end')} at end"
        + (f" ({cores} cores)" if cores else "")
        + (f"; other processes used {100 * foreign:.1f}% of the cores during the run" if foreign is not None else "")
    )


# ---------------------------------------------------------------------------------------------------- summaries
P99_MIN_SAMPLES = 100
"""Fewer samples than this and a p99 is the maximum: the tail is then reported as the maximum, named so."""


def tail_key(summary: dict[str, Any]) -> str:
    """``p99_s`` for a summary of at least :data:`P99_MIN_SAMPLES` samples, else ``max_s``."""
    return "p99_s" if summary.get("n", 0) >= P99_MIN_SAMPLES else "max_s"


def summarize(samples: Iterable[float]) -> dict[str, Any]:
    """Median, mean, p90, p99, min, max and the raw samples (seconds)."""
    xs = [float(x) for x in samples]
    if not xs:
        return {"n": 0, "median_s": None, "mean_s": None, "p90_s": None, "p99_s": None, "min_s": None,
                "max_s": None, "samples_s": []}  # fmt: skip
    ordered = sorted(xs)
    return {
        "n": len(xs),
        "median_s": statistics.median(xs),
        "mean_s": statistics.fmean(xs),
        "p90_s": percentile(ordered, 90),
        "p99_s": percentile(ordered, 99),
        "min_s": ordered[0],
        "max_s": ordered[-1],
        "samples_s": xs,
    }


def slowdowns(samples: Sequence[float], base: Sequence[float]) -> dict[str, float]:
    """Step-time slowdown of ``samples`` over ``base`` (seconds): of the means, the medians and the p99s."""
    return {
        "slowdown_mean": statistics.fmean(samples) / statistics.fmean(base) - 1.0,
        "slowdown_median": statistics.median(samples) / statistics.median(base) - 1.0,
        "slowdown_p99": (percentile(samples, 99) or 0.0) / (percentile(base, 99) or 1.0) - 1.0,
    }


_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
         15: 2.13, 20: 2.09, 30: 2.04}  # fmt: skip
"""Student's t, two-sided 95%, by degrees of freedom (the next smaller tabulated one is used; 1.96 past 30)."""


def mean_interval(values: Sequence[float]) -> tuple[float, float, float] | None:
    """The mean of ``values`` (one per interleaved turn or block) and its 95% interval (Student's t): how precisely
    the turns pin a slowdown down, given the machine's drift between them. None with fewer than 2 values."""
    n = len(values)
    if n < 2:
        return None
    mean = statistics.fmean(values)
    t = _T975[max(k for k in _T975 if k <= n - 1)] if n - 1 <= 30 else 1.96
    half = t * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def fmt_interval(values: Sequence[float], what: str) -> str:
    """``mean +x%, 95% interval +a% to +b% over n <what>`` of per-turn (or per-block) slowdowns."""
    got = mean_interval(values)
    if got is None:
        return f"{len(values)} {what}, no interval"
    mean, lo, hi = got
    return f"mean {mean * 100:+.2f}%, 95% interval {lo * 100:+.2f}% to {hi * 100:+.2f}% over {len(values)} {what}"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def target(name: str, value: float | None, op: str, threshold: float, unit: str = "", note: str = "") -> dict[str, Any]:
    """One goal with its verdict: ``op`` is ``">="`` or ``"<="``; a missing value is a MISS."""
    if value is None:
        ok = False
    elif op == ">=":
        ok = value >= threshold
    elif op == "<=":
        ok = value <= threshold
    else:
        raise ValueError(f"unknown comparison {op!r}")
    return {
        "name": name,
        "value": value,
        "op": op,
        "threshold": threshold,
        "unit": unit,
        "verdict": "PASS" if ok else "MISS",
        "note": note,
    }


def run_and_publish(
    argv: Sequence[str] | None,
    parse: Callable[[Sequence[str]], Any],
    run: Callable[[Any, Sequence[str]], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
    default_out: str,
) -> int:
    """A benchmark module's ``main``: parse ``argv`` (the command line when None), run, print the Markdown, and write
    the result to ``--out`` (a ``--quick`` smoke run only to a file named explicitly, never the published one)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parse(args_list)
    result = run(args, args_list)
    print_flush(render(result))
    if not args.quick or args.out != default_out:
        write_json(args.out, result)
        print_flush(f"wrote {args.out}")
    return 0


def load_note(result: dict[str, Any]) -> str:
    """How loaded the machine was when a result was taken: its load averages at start and end."""
    machine = result.get("machine") or {}
    return f"load average at start and end {machine.get('loadavg_at_start')} / {machine.get('loadavg_at_end')}"


def targets_table(targets: Sequence[dict[str, Any]], digits: int = 3) -> str:
    """The Markdown table of :func:`target` results: name, value, goal, verdict."""
    rows = [
        [
            t["name"],
            "n/a" if t["value"] is None else f"{t['value']:.{digits}f}{t['unit']}",
            f"{t['op']} {t['threshold']}",
            t["verdict"],
        ]
        for t in targets
    ]
    return md_table(["target", "value", "goal", "verdict"], rows)


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, out)
    return out


def evict_page_cache(root: str | os.PathLike[str]) -> int:
    """Ask the kernel to drop cached pages of every file under ``root`` (clean pages only; no root needed).

    Returns the number of files advised. A hypervisor or a shared host cache may still serve the reads fast.
    """
    if not hasattr(os, "posix_fadvise"):
        return 0
    os.sync()
    count = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                count += 1
            finally:
                os.close(fd)
    return count


def fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.2f}%"


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def print_flush(*args: Any) -> None:
    print(*args, flush=True)
    sys.stdout.flush()


def report(result: dict[str, Any], out: str | os.PathLike[str], render: Callable[[dict[str, Any]], str]) -> int:
    """Write ``result`` to ``out``, print its Markdown section and where it went; the exit status (0)."""
    path = write_json(out, result)
    print_flush(render(result))
    print_flush(f"\nwrote {path}")
    return 0


def result_header(
    benchmark: str,
    title: str,
    module: str,
    argv: Sequence[str],
    started: float,
    machine: dict[str, Any],
    since: tuple[float, float, float] | None = None,
) -> dict[str, Any]:
    """The first keys of every result: what ran, how to run it again, when, for how long, where (the machine's load
    at the end recorded now, see :func:`finish_load`, with ``since``); ``started`` is a ``time.perf_counter()``
    reading."""
    import time

    return {
        "benchmark": benchmark,
        "title": title,
        "command": command_line(module, argv),
        "date": now_iso(),
        "total_wall_s": time.perf_counter() - started,
        "machine": finish_load(machine, since),
    }


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``samples``; None when empty."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
