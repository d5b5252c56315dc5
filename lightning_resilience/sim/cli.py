"""``lightning-resilience simulate``: ETTR of a job under failures, its breakdown, Daly's interval and sweeps.

Examples::

    simulate --gpus 10000 --mttf 7.9h@1024 --days 90
    simulate --gpus 10000 --interval auto --tier name=peer,every=x1,blocking=0.5s,write=10s,restore=10s,durability=peer
    simulate --from-run runs/demo --gpus 4096 --sweep interval=1m,5m,15m,1h gpus=1024,4096,16384 --out runs/sim
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning_resilience.sim.analytic import daly_interval, young_interval
from lightning_resilience.sim.config import (
    DURABILITIES,
    FAILURE_KINDS,
    RESTART_PATHS,
    SimConfig,
    SimTierConfig,
    default_failure_kinds,
)
from lightning_resilience.sim.engine import simulate_many
from lightning_resilience.sim.from_run import apply_run_costs, load_run_costs
from lightning_resilience.sim.report import breakdown_table, plot_sweep, sweep_table
from lightning_resilience.sim.sweep import sweep

__all__ = ["build_parser", "config_from_args", "parse_duration", "simulate_main"]

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|min|m|h|d)?\s*$")


def parse_duration(text: str, *, bare: str = "s") -> float:
    """Seconds in ``90``, ``90s``, ``500ms``, ``5m``/``5min``, ``1.5h``, ``2d`` (a bare number is in ``bare``)."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a duration (examples: 30s, 5m, 1.5h, 2d)")
    value = float(m.group(1)) * _UNITS[m.group(2) or bare]
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite duration")
    return value


def _arg(fn: Any, what: str) -> Any:
    """An argparse ``type=`` that turns a ValueError into a message argparse prefixes with the flag name."""

    def convert(text: str) -> Any:
        try:
            return fn(text)
        except (ValueError, TypeError) as err:
            raise argparse.ArgumentTypeError(f"{what}: {err}") from None

    convert.__name__ = what
    return convert


def _positive_duration(text: str) -> float:
    value = parse_duration(text)
    if value <= 0:
        raise ValueError(f"{text!r} must be > 0")
    return value


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise ValueError(f"{text!r} must be >= {minimum}")
        return value

    return convert


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{text!r} must be a finite number > 0")
    return value


def _mttf(text: str) -> tuple[float, int | None]:
    """``7.9h@1024`` -> (seconds, reference GPUs); ``2h`` -> (seconds, None: measured at --gpus)."""
    value, _, ref = text.partition("@")
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"{text!r}: the MTTF must be > 0")
    if not ref:
        return seconds, None
    try:
        gpus = int(ref)
    except ValueError:
        raise ValueError(f"{text!r}: the part after @ must be a GPU count, e.g. 7.9h@1024") from None
    if gpus < 1:
        raise ValueError(f"{text!r}: the GPU count after @ must be >= 1")
    return seconds, gpus


def _pairs(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    if not out:
        raise ValueError("expected KEY=VALUE[,KEY=VALUE...]")
    return out


def _mix(text: str) -> dict[str, float]:
    out = {}
    for kind, value in _pairs(text).items():
        if kind not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {kind!r}; expected {', '.join(FAILURE_KINDS)}")
        try:
            out[kind] = float(value)
        except ValueError:
            raise ValueError(f"{kind}={value!r} is not a number") from None
        if not 0 <= out[kind] <= 1:
            raise ValueError(f"{kind}={value} must be in [0, 1]")
    if not math.isclose(sum(out.values()), 1.0, abs_tol=1e-6):
        raise ValueError(f"the fractions must sum to 1, got {sum(out.values()):.6g}")
    return out


def _detect(text: str) -> dict[str, float]:
    out = {}
    for kind, value in _pairs(text).items():
        if kind not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {kind!r}; expected {', '.join(FAILURE_KINDS)}")
        out[kind] = parse_duration(value)
    return out


def _restart_costs(text: str) -> dict[str, float]:
    out = {}
    for path, value in _pairs(text).items():
        if path not in RESTART_PATHS:
            raise ValueError(f"unknown restart path {path!r}; expected {', '.join(RESTART_PATHS)}")
        out[path] = parse_duration(value)
    return out


def _interval(text: str) -> str:
    if text != "auto":
        _cadence(text)
    return text


def _cadence(text: str) -> tuple[str, float]:
    """``500`` -> steps; ``5m`` -> seconds; ``x12`` -> multiple of --interval."""
    if text.startswith("x"):
        return "multiple", _positive_float(text[1:])
    if re.fullmatch(r"\d+", text):
        return "steps", float(_positive_int(text))
    return "seconds", _positive_duration(text)


_TIER_KEYS = ("name", "every", "blocking", "write", "restore", "durability", "keep")


def _tier(text: str) -> dict[str, str]:
    spec = _pairs(text)
    unknown = sorted(set(spec) - set(_TIER_KEYS))
    if unknown:
        raise ValueError(f"unknown tier keys {unknown}; expected {', '.join(_TIER_KEYS)}")
    if "name" not in spec:
        raise ValueError("a tier needs name=...")
    if "every" in spec:
        _cadence(spec["every"])
    for key in ("blocking", "write", "restore"):
        if key in spec:
            parse_duration(spec[key])
    if spec.get("durability", "remote") not in DURABILITIES:
        raise ValueError(f"durability must be one of {', '.join(DURABILITIES)}, got {spec['durability']!r}")
    if "keep" in spec:
        _positive_int(spec["keep"])
    return spec


def _sweep(text: str) -> tuple[str, list[str]]:
    key, sep, values = text.partition("=")
    if key not in ("interval", "gpus") or not sep or not values:
        raise ValueError(f"{text!r}: expected interval=D1,D2,... or gpus=N1,N2,...")
    items = [v.strip() for v in values.split(",") if v.strip()]
    for v in items:
        _positive_duration(v) if key == "interval" else _positive_int(v)
    return key, items


def build_parser(prog: str = "lightning-resilience simulate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--gpus", type=_arg(_positive_int, "GPU count"), default=None, help="accelerators (default 1024)")
    p.add_argument("--gpus-per-node", type=_arg(_positive_int, "GPU count"), default=None, help="default 8")
    p.add_argument("--spares", type=_arg(_non_negative_int, "node count"), default=None, help="warm spare nodes")
    p.add_argument("--spare-refill", type=_arg(_positive_duration, "duration"), default=None, help="default 4h")
    p.add_argument(
        "--mttf", type=_arg(_mttf, "MTTF"), default=None, help="job MTTF at a reference size, e.g. 7.9h@1024 (default)"
    )
    p.add_argument("--weibull-shape", type=_arg(_positive_float, "shape"), default=None, help="1 = Poisson (default)")
    p.add_argument("--mix", type=_arg(_mix, "failure mix"), default=None, help="e.g. crash=0.6,hang=0.2,sdc=0.2")
    p.add_argument("--detect", type=_arg(_detect, "detection delays"), default=None, help="e.g. crash=10s,hang=10m")
    p.add_argument(
        "--restart-cost", type=_arg(_restart_costs, "restart costs"), default=None, help="e.g. cold=6.47m,in_job=60s"
    )
    p.add_argument("--step-time", type=_arg(_positive_duration, "duration"), default=None, help="default 2s")
    p.add_argument("--days", type=_arg(_positive_float, "days"), default=None, help="wall-clock horizon (default 90)")
    p.add_argument(
        "--interval",
        type=_arg(_interval, "interval"),
        default=None,
        help="cadence of the first tier: steps (500), time (10m) or auto (Daly's optimum)",
    )
    p.add_argument(
        "--tier",
        type=_arg(_tier, "tier"),
        action="append",
        default=None,
        help="name=N,every=10m|500|x5,blocking=2s,write=30s,restore=30s,durability=process|host|peer|remote,keep=2 "
        "(repeat per tier; replaces the default tiers)",
    )
    p.add_argument("--from-run", type=Path, default=None, help="read measured costs from a run directory")
    p.add_argument("--replications", type=_arg(_positive_int, "count"), default=1, help="independent runs")
    p.add_argument("--seed", type=_arg(int, "seed"), default=0)
    p.add_argument(
        "--sweep",
        type=_arg(_sweep, "sweep"),
        nargs="+",
        default=None,
        help="sweep the first tier's interval and/or the scale: interval=5m,15m,1h gpus=1024,10000",
    )
    p.add_argument("--out", type=Path, default=None, help="directory for sim_result.json, sweep.md and sweep.png")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _tier_from_spec(spec: dict[str, str], interval: tuple[str, float] | None) -> SimTierConfig:
    kind, value = _cadence(spec["every"]) if "every" in spec else ("multiple", 1.0)
    if kind == "multiple":
        if interval is None:
            raise ValueError(f"--tier {spec['name']}: every=x{value:g} (or no every=) needs --interval")
        base_kind, base = interval
        kind, value = base_kind, base * value
    every_steps = int(value) if kind == "steps" else None
    return SimTierConfig(
        name=spec["name"],
        every_n_steps=every_steps,
        every_s=None if every_steps is not None else value,
        blocking_s=parse_duration(spec.get("blocking", "0")),
        write_s=parse_duration(spec.get("write", "0")),
        restore_s=parse_duration(spec.get("restore", "0")),
        durability=spec.get("durability", "remote"),  # type: ignore[arg-type]
        keep=int(spec.get("keep", "2")),
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Defaults, then the run's measured costs (``--from-run``), then the explicit flags."""
    cfg = SimConfig()
    costs = load_run_costs(args.from_run) if args.from_run is not None else None
    if costs is not None:
        cfg = apply_run_costs(cfg, costs)
    cluster = cfg.cluster
    cluster = dataclasses.replace(
        cluster,
        gpus=args.gpus if args.gpus is not None else cluster.gpus,
        gpus_per_node=args.gpus_per_node if args.gpus_per_node is not None else cluster.gpus_per_node,
        spare_nodes=args.spares if args.spares is not None else cluster.spare_nodes,
        spare_refill_s=args.spare_refill if args.spare_refill is not None else cluster.spare_refill_s,
    )
    failures = cfg.failures
    if args.mttf is not None:
        seconds, ref = args.mttf
        failures = dataclasses.replace(failures, mttf_s=seconds, ref_gpus=ref if ref is not None else cluster.gpus)
    elif costs is not None and costs.observed_mttf_s is not None:
        failures = dataclasses.replace(failures, mttf_s=costs.observed_mttf_s, ref_gpus=int(costs.gpus or 1))
    if args.weibull_shape is not None:
        failures = dataclasses.replace(failures, weibull_shape=args.weibull_shape)
    if args.mix is not None:
        known = {k.name: k for k in default_failure_kinds()} | {k.name: k for k in failures.kinds}
        kinds = [dataclasses.replace(known[n], fraction=f) for n, f in args.mix.items() if f > 0]
        failures = dataclasses.replace(failures, kinds=kinds)
    if args.detect is not None:
        missing = sorted(set(args.detect) - {k.name for k in failures.kinds})
        if missing:
            raise ValueError(f"--detect names kinds {missing} that the failure mix does not include")
        failures = dataclasses.replace(
            failures,
            kinds=[dataclasses.replace(k, detection_s=args.detect.get(k.name, k.detection_s)) for k in failures.kinds],
        )
    restart = dataclasses.replace(cfg.restart, **args.restart_cost) if args.restart_cost else cfg.restart
    job = dataclasses.replace(
        cfg.job,
        step_s=args.step_time if args.step_time is not None else cfg.job.step_s,
        horizon_s=args.days * 86400.0 if args.days is not None else cfg.job.horizon_s,
        seed=args.seed,
    )
    interval: tuple[str, float] | None = None
    if args.interval == "auto":
        # Daly's optimum for the first tier's blocking cost at this scale
        if args.tier:
            delta = parse_duration(args.tier[0].get("blocking", "0"))
        else:
            delta = cfg.tiers[0].blocking_s if cfg.tiers else 0.0
        if delta <= 0:
            raise ValueError("--interval auto needs a first tier with a blocking cost > 0 (Daly's formula)")
        interval = ("seconds", daly_interval(delta, failures.job_mttf_s(cluster.gpus)))
    elif args.interval is not None:
        interval = _cadence(args.interval)
        if interval[0] == "multiple":
            raise ValueError("--interval cannot be a multiple (x...); give steps (500) or a duration (10m)")
    tiers = cfg.tiers
    if args.tier:
        tiers = [_tier_from_spec(spec, interval) for spec in args.tier]
    elif interval is not None and tiers:
        first = tiers[0]
        tiers = [
            dataclasses.replace(
                first,
                every_n_steps=int(interval[1]) if interval[0] == "steps" else None,
                every_s=interval[1] if interval[0] == "seconds" else None,
            ),
            *tiers[1:],
        ]
    cfg = SimConfig(cluster=cluster, failures=failures, tiers=list(tiers), restart=restart, job=job)
    return cfg


def _fmt_s(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def simulate_main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, simulate, print the ETTR, its breakdown, the Young/Daly intervals and any sweep.

    Bad flags exit through argparse (status 2) with a message naming the flag.
    """
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        cfg = config_from_args(args)
    except FileNotFoundError as err:
        parser.error(f"argument --from-run: {err}")
    except ValueError as err:
        parser.error(str(err))
    mttf = cfg.failures.job_mttf_s(cfg.cluster.gpus)
    mc = simulate_many(cfg, args.replications)
    first = mc.runs[0]
    out: dict[str, Any] = {
        "config": dataclasses.asdict(cfg),
        "job_mttf_s": mttf,
        "result": first.report(),
        "monte_carlo": mc.report(),
    }
    lines = [
        f"cluster: {cfg.cluster.gpus} GPUs in {cfg.cluster.nodes} nodes, job MTTF {_fmt_s(mttf)}, "
        f"step {cfg.job.step_s:g} s, horizon {cfg.job.horizon_s / 86400:g} days",
        "tiers: "
        + "; ".join(
            f"{t.name} every {cadence.every_n_steps} steps ({t.durability}, block {t.blocking_s:g} s, "
            f"write {t.write_s:g} s, restore {t.restore_s:g} s)"
            for t, cadence in zip(cfg.tiers, cfg.cadences())
        ),
        "",
        breakdown_table(first),
        "",
        f"ETTR {first.ettr:.4f}"
        + (f" (mean of {len(mc.runs)}: {mc.ettr_mean:.4f} ± {mc.ettr_stderr:.4f})" if len(mc.runs) > 1 else "")
        + f"; {sum(first.failures.values())} failures {first.failures}; simulated in {first.sim_seconds:.3f} s",
    ]
    if cfg.tiers and cfg.tiers[0].blocking_s > 0:
        delta = cfg.tiers[0].blocking_s
        young, daly = young_interval(delta, mttf), daly_interval(delta, mttf)
        out["young_interval_s"], out["daly_interval_s"] = young, daly
        lines.append(
            f"optimal interval of tier {cfg.tiers[0].name} (blocking {delta:g} s): Young {_fmt_s(young)}, "
            f"Daly {_fmt_s(daly)}"
        )
    if args.sweep:
        grid: dict[str, list[str]] = {}
        for key, items in args.sweep:
            grid.setdefault(key, []).extend(items)
        rows = sweep(
            cfg,
            intervals_s=[parse_duration(v) for v in grid.get("interval", [])] or None,
            gpus=[int(v) for v in grid.get("gpus", [])] or None,
            replications=args.replications,
        )
        out["sweep"] = rows
        lines += ["", sweep_table(rows)]
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "sweep.md").write_text(sweep_table(rows) + "\n")
            png = plot_sweep(rows, args.out / "sweep.png")
            lines.append(f"plot: {png}" if png else "plot: skipped (matplotlib is not installed)")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sim_result.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(json.dumps(out, indent=1, default=str) if args.json else "\n".join(lines))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(simulate_main())
