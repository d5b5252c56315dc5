"""The tally of ``benchmarks.sdc_coverage``: each trial's outcome and what caught it, per cell and pooled by kind of
fault; the overhead of the monitored arm against the plain one; the stale-save trials."""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import mean_interval, slowdowns
from benchmarks._sdc.trials import KINDS, loss_of, model_kwargs, wilson

__all__ = ["cells_of", "kinds_of", "overhead_of", "stale_saves"]


def _classify(trial: dict[str, Any], res: dict[str, Any]) -> str:
    corrupt = [e for e in res["events"] if e["verdict"] not in ("clean", "anomaly")]
    if corrupt or res["events"] or res["decisions"]:
        suspects = sorted({s for e in corrupt for s in e["suspects"]})
        return "caught" if corrupt and suspects == [trial["rank"]] else "flagged"
    return "missed" if res["effect"] else "no_effect"


def _mechanism(res: dict[str, Any]) -> str:
    """What detected the fault first: a reconciliation, a replay a guard asked for, a scheduled replay, or a guard
    (a non-finite value: a rollback without a replay)."""
    if res["events"]:
        first = min(res["events"], key=lambda e: e["step"])
        mech = str(first["mechanism"])
        return "guard_replay" if "guard:" in mech and mech.startswith("replay") else mech.split(" ")[0].split(":")[0]
    return "guard" if res["decisions"] else "none"


def cells_of(trials: list[dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    cells: dict[str, dict[str, Any]] = {}
    for trial, res in zip(trials, results):
        empty = {"kind": trial["kind"], "trials": 0, "caught": 0, "flagged": 0, "missed": 0, "no_effect": 0}
        cell = cells.setdefault(trial["cell"], {**empty, "latencies": [], "caught_by": {}, "runs": []})
        cell["trials"] += 1
        outcome = _classify(trial, res)
        cell[outcome] += 1
        how = None
        if outcome in ("caught", "flagged") and res["detected"] is not None:
            cell["latencies"].append(res["detected"] - (trial["step"] + 1))
            how = _mechanism(res)
            cell["caught_by"][how] = cell["caught_by"].get(how, 0) + 1
        # each trial's own record: why a trial was flagged rather than caught can be read back from the results
        events = [[e["step"], e["verdict"], e["action"], e["suspects"], e["mechanism"]] for e in res["events"][:8]]
        decisions = [[d["step"], d["action"], d["event"]] for d in res["decisions"][:8]]
        cell["runs"].append({"rank": trial["rank"], "step": trial["step"], "outcome": outcome, "caught_by": how,
                             "detected": res["detected"], "events": events, "decisions": decisions})  # fmt: skip
    for cell in cells.values():
        _rates(cell)
    return cells


def _rates(cell: dict[str, Any]) -> None:
    effective = cell["trials"] - cell["no_effect"]
    detected = cell["caught"] + cell["flagged"]
    cell["effective"] = effective
    cell["coverage"] = cell["caught"] / effective if effective else None
    cell["coverage_ci95"] = wilson(cell["caught"], effective)
    cell["detection"] = detected / effective if effective else None
    cell["localization"] = cell["caught"] / detected if detected else None
    lat = cell.pop("latencies", [])
    cell["latency_steps_mean"] = statistics.fmean(lat) if lat else None
    cell["latency_steps_max"] = max(lat) if lat else None


def kinds_of(cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The cells of each kind of fault pooled (persistent state, transient, faulty device)."""
    out = {}
    for kind in KINDS:
        group = [c for c in cells.values() if c["kind"] == kind]
        if not group:
            continue
        pooled: dict[str, Any] = {"kind": kind, "caught_by": {}}
        for key in ("trials", "caught", "flagged", "missed", "no_effect"):
            pooled[key] = sum(c[key] for c in group)
        for c in group:
            for how, n in c["caught_by"].items():
                pooled["caught_by"][how] = pooled["caught_by"].get(how, 0) + n
        lat_means = [(c["latency_steps_mean"], c["caught"] + c["flagged"]) for c in group if c["latency_steps_mean"]]
        n = sum(k for _, k in lat_means)
        pooled["latencies"] = []
        _rates(pooled)
        pooled["latency_steps_mean"] = sum(m * k for m, k in lat_means) / n if n else None
        maxima = [c["latency_steps_max"] for c in group if c["latency_steps_max"] is not None]
        pooled["latency_steps_max"] = max(maxima) if maxima else None
        out[kind] = pooled
    return out


def overhead_of(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The monitored arm against the plain one (rank 0's interleaved windows), and where its time goes."""
    plain, checked = per_rank[0]["times"]["plain"], per_rank[0]["times"]["checked"]
    ow = per_rank[0]["window"]
    pairs = [statistics.fmean(checked[i : i + ow]) / statistics.fmean(plain[i : i + ow]) - 1.0
             for i in range(0, min(len(plain), len(checked)) - ow + 1, ow)]  # fmt: skip
    interval = mean_interval(pairs)
    floor = per_rank[0]["times"]["floor"]
    return {
        "ranks": len(per_rank),
        "plain_step_mean_s": statistics.fmean(plain),
        "checked_step_mean_s": statistics.fmean(checked),
        **slowdowns(checked, plain),
        "floor_step_mean_s": statistics.fmean(floor),
        "floor_slowdown_mean": statistics.fmean(floor) / statistics.fmean(plain) - 1.0,
        "beyond_floor_mean": statistics.fmean(checked) / statistics.fmean(floor) - 1.0,
        "steps_each": len(plain),
        "window_steps": ow,
        "per_pair": pairs,
        "per_pair_mean": interval[0] if interval else None,
        "per_pair_interval95": list(interval[1:]) if interval else None,
        "parts_ms_per_step": per_rank[0]["parts_ms_per_step"],
        "driver_phases_ms_per_step": [r["driver_phases_ms_per_step"] for r in per_rank],
        "rounds": per_rank[0]["rounds"],
        "samples_s": {"plain": plain, "checked": checked, "floor": floor},
    }


def stale_saves(trials: int, seed: int) -> dict[str, Any]:
    """A tier commits the previous step's tensors under a new step's name: refused at the restore, and the step
    before it restored? (single process, the tiny GPT's model and optimizer state)."""
    from lightning_resilience.checkpoint.config import CheckpointConfig
    from lightning_resilience.checkpoint.local import LocalTier
    from lightning_resilience.checkpoint.manager import CheckpointManager
    from lightning_resilience.testing.faults import FaultPlan
    from recipes._gpt import TinyGPT

    rng = random.Random(seed)
    refused = restored_before = 0
    for _ in range(trials):
        stale_at = rng.randrange(3, 9)
        torch.manual_seed(rng.randrange(2**31))
        model = TinyGPT(**model_kwargs())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with tempfile.TemporaryDirectory() as tmp:
            tier = LocalTier(Path(tmp), every_n_steps=1, keep=20)
            FaultPlan().fail_at(None, stale_at, "tier.local.write", "stale").instrument(tier)
            manager = CheckpointManager([tier], CheckpointConfig())
            manager.setup()
            try:
                for s in range(1, stale_at + 1):
                    batch = torch.randint(64, (2, 17))
                    loss_of(model, batch).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    manager.on_step(s, lambda m=model, o=opt: {"model": m.state_dict(), "optim": o.state_dict()})
                    manager.wait()
            finally:
                manager.close()
            again = CheckpointManager([LocalTier(Path(tmp), every_n_steps=1, keep=20)], CheckpointConfig())
            again.setup()
            try:
                found = again.restore()
            finally:
                again.close()
            refused += any(f"step {stale_at} are not the state" in m for m in again.stats.skipped_corrupt)
            restored_before += found is not None and found.step == stale_at - 1
    return {"trials": trials, "refused": refused, "restored_step_before": restored_before,
            "coverage": refused / trials if trials else None, "coverage_ci95": wilson(refused, trials)}  # fmt: skip
