"""A randomized fault campaign on the user's path: ``make drills N=... SEED=...``.

Each drill is a real torchrun job of ``tests/drills/_user_script.py`` (plain ``DataLoader(shuffle=True)``, the default
preset, 2 ranks, gloo, CPU) hit by one fault drawn at random (``tests/drills/_user_code.py`` lists them), and is checked
against four invariants:

* **bitwise exact**: the final weights equal those of an uninterrupted run (one reference run per loader
  configuration, cached for the campaign);
* **no lost committed step, no load of a corrupt step**: every attempt after the fault restores exactly the newest
  step that every rank held whole when it started, on disk or in the node's shared memory, leaving out the steps the
  fault damaged (a corrupt or truncated shard, a write that hit ENOSPC, a persist or a snapshot copy killed
  half-way); the steps recomputed after each kill are counted;
* **no wait longer than its deadline**: every launch is bounded (``Drill.timeout_s``) and the time to recover, from
  the fault to the first step after the restore, stays within the fault's deadline (:data:`DEADLINE_S`);
* **no leftover process**: once the job has ended, no process of the drill (launcher, ranks, loader workers) is left.

Drill ``i`` of a campaign with seed ``S`` is drawn from seed ``S + i`` alone, so ``make drills N=1 SEED=<S + i>``
replays it. Results go to a JSON file; ``--publish`` also regenerates the campaign table of docs/reliability.md from
every published results file (``--docs-only`` does that without running anything).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from tests.drills._harness import ROOT, Drill, DrillResult, LaunchTimeout, first_difference, run_drill
from tests.drills._s3_outage import S3Outages
from tests.drills._tmpfs import TmpfsUnavailable, tmpfs
from tests.drills._user_code import DISK, FAULTS, MEMORY, OVERRIDES_ENV, PERSIST_EVERY

STEPS = 40
PEER_EVERY = 5  # the peer tier's cadence in configs/resilience/checkpoint/tiered.yaml
RESULTS_DIR = ROOT / "docs" / "results"
"""Published campaigns: ``drill_campaign_<seed>.json``, one per campaign; docs/reliability.md's table merges them."""
DOCS = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- drill-campaign:begin -->", "<!-- drill-campaign:end -->"
RESTART_S = 120.0
"""Time a restart of the job may take on a loaded 2-core machine: torchrun's restart, imports, rendezvous, restore."""
HANG_DETECTION_S = 60.0
"""The watchdog's deadline for a hang after the first step (``ft.min_timeout_s`` of the default preset)."""
FIRST_HANG_STEP = 2
"""A hang is drawn from step 2: once the first step (compilation, allocator warm-up) has been timed, the watchdog's
provisional timeout (``ft.provisional_factor``) bounds it by ``ft.min_timeout_s`` on quick steps. A hang in the very
first step waits for the initial timeouts (``ft.initial_timeouts_s``), as a first step may legitimately compile."""
DEADLINE_S = {kind: RESTART_S for kind in FAULTS} | {
    "hang-collective": HANG_DETECTION_S + RESTART_S,
    "sigkill-restore": 2 * RESTART_S,  # two restarts: the second fault hits the first restart's restore
}
"""Longest time to recover, per fault: from the (first) fault to the first step after the restore."""
_KILLS = tuple(
    f
    for f in FAULTS
    if f.startswith("sigkill")
    or f in ("node-loss", "ram-loss", "corrupt-shard", "truncate-shard", "enospc", "disk-full")
)
"""Faults that kill a rank at a step: the steps recomputed after them are counted."""
VARIANTS = {"in-process": "resilience.checkpoint.tiers.0.shared_memory=false"}
"""Campaign variants (``VARIANT=`` of the make target) and the overrides of the default preset each runs with. A
variant's campaign is published beside a campaign of the default at the same commit, as the "before" of a
before-and-after table: ``in-process`` holds the every-step RAM snapshot in the process, as releases before the
shared-memory snapshot did, so a killed rank resumes from the disk cadence."""
FULL_DISK_UNAVAILABLE = "the full disk could not be set up"
"""The problem of a ``disk-full`` drill where no tmpfs can be mounted (the CI subset skips it)."""
LEFTOVER_GRACE_S = 15.0
"""How long the processes of an ended job may take to go (a killed rank's loader workers notice their parent died)."""


def draw(seed: int, steps: int = STEPS, faults: tuple[str, ...] = FAULTS[1:]) -> Drill:
    """The drill of ``seed``: a fault kind (one of ``faults``), rank, step and loader worker count, all at random."""
    rng = random.Random(seed)
    fault = rng.choice(faults)
    persist_steps = range(PERSIST_EVERY, steps, PERSIST_EVERY)
    if fault == "sigkill-persist":
        step = rng.choice(persist_steps)
    elif fault in ("enospc", "s3-outage", "disk-full"):  # the persist of P fails or is cut; the kill before the next
        step = rng.choice(persist_steps) + rng.randint(2, PERSIST_EVERY - 2)
    elif fault == "sigkill-peer-send":  # the tiered preset's peer tier replicates every 5 steps
        step = rng.choice(range(PEER_EVERY, steps, PEER_EVERY))
    elif fault == "hang-collective":  # once the first step is timed (see FIRST_HANG_STEP)
        step = rng.randint(FIRST_HANG_STEP, steps - 3)
    elif fault.startswith("sigterm"):  # a stop is agreed on a step or two after the signal: leave room
        step = rng.randint(2, steps - 10)
    elif fault in ("sigkill-restore", "corrupt-shard", "truncate-shard", "ram-loss"):  # something on disk
        step = rng.randint(PERSIST_EVERY + 2, steps - 2)
    else:
        step = rng.randint(2, steps - 3)
    checkpoint = {"sigkill-peer-send": "tiered", "s3-outage": "s3"}.get(fault, "local")
    rank, workers = rng.randint(0, 1), rng.choice((0, 2))
    return Drill(fault=fault, step=step, rank=rank, workers=workers, steps=steps, checkpoint=checkpoint)


@dataclass
class Outcome:
    """What one drill did and whether it kept every invariant."""

    seed: int
    fault: str
    rank: int
    step: int
    workers: int
    checkpoint: str
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    recovery_s: float | None = None
    restored: list[int | None] = field(default_factory=list)
    """The step each attempt after the fault restored (rank 0's view; every rank is checked)."""
    damaged: list[int] = field(default_factory=list)
    recomputed: list[int] = field(default_factory=list)
    """Steps trained again after each restart that followed a kill: the step the fault hit minus the step restored
    (rank 0's view)."""
    run_dir: str = ""
    faults: str = ""
    """The campaign's fault filter (``FAULTS=`` of the make target; empty: every kind)."""
    variant: str = ""
    """The campaign's variant (:data:`VARIANTS`; empty: the default preset as shipped)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def replay(self) -> str:
        return replay_command(self.seed, self.faults, variant=self.variant)


def replay_command(seed: int, faults: str = "", n: int = 1, variant: str = "") -> str:
    return (
        f"make drills N={n} SEED={seed}"
        + (f" FAULTS={faults}" if faults else "")
        + (f" VARIANT={variant}" if variant else "")
    )


def _faults(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


_EVERY_COPY = ""
"""A damage record that names no copy: no copy of the step may be loaded."""


def _damaged(faults: list[dict[str, Any]]) -> dict[int, str]:
    """Damaged step -> the copy the fault damaged (its tier's name, see ``DISK``; ``_EVERY_COPY``: all of them)."""
    out: dict[int, str] = {}
    for fault in faults:
        damaged = fault.get("damaged")
        for step in damaged if isinstance(damaged, list) else [damaged] if damaged is not None else []:
            out[step] = fault.get("tier", _EVERY_COPY)
    return out


def _newest_complete(report: dict[str, Any], world_size: int, damaged: dict[int, str]) -> int | None:
    """The newest step of which every rank held an intact copy: a step whose disk shard a fault damaged counts
    with the copies the other tiers hold (``elsewhere``, listed whole only: a RAM tier lists no half-made
    snapshot)."""
    held, away = report["committed"], report.get("elsewhere", {})
    steps = []
    for key, ranks in held.items():
        step = int(key)
        if step in damaged:  # the intact copies: elsewhere than the damaged disk, or listed whole (RAM)
            ranks = {DISK: away.get(key, []), MEMORY: ranks}.get(damaged[step], [])
        if len(ranks) == world_size:
            steps.append(step)
    return max(steps, default=None)


def _loaded_damaged(report: dict[str, Any], damaged: dict[int, str]) -> bool:
    """The attempt restored the very copy a fault damaged."""
    step = report["restored_step"]
    return step in damaged and damaged[step] in (_EVERY_COPY, report.get("restored_from"))


def leftovers(run_dir: Path, grace_s: float = LEFTOVER_GRACE_S) -> list[str]:
    """Processes of the drill still alive once the job ended (they all carry the run directory on their command
    line); waits up to ``grace_s`` for them to go, then kills them and names them."""
    us = {os.getpid(), *(p.pid for p in psutil.Process().parents())}  # the campaign may name the directory too
    mine = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid not in us and str(run_dir) in " ".join(proc.info["cmdline"] or []):
            mine.append(proc)
    _, alive = psutil.wait_procs(mine, timeout=grace_s)
    names = [f"pid {p.pid}: {' '.join(p.info['cmdline'] or [])[:160]}" for p in alive]
    for proc in alive:
        proc.kill()
    return names


def check(result: DrillResult, reference: dict[str, torch.Tensor], outcome: Outcome) -> None:
    """Fill ``outcome.problems`` with every invariant the drill broke."""
    drill, problems = result.drill, outcome.problems
    diff = first_difference(result.weights(), reference)
    if diff is not None:
        problems.append(f"final weights differ from the uninterrupted run: {diff}")
    if len(result.finished) != drill.world_size:
        problems.append(f"{len(result.finished)} ranks finished, not {drill.world_size}")
    faults = _faults(result.run_dir)
    if not faults:
        problems.append("the fault never fired")
        return
    if drill.fault == "sigkill-restore" and len(faults) < 2:
        problems.append("the restarted attempt was never killed restoring (nothing committed to restore?)")
    if drill.fault == "s3-outage" and [f.get("phase") for f in faults] != ["outage", "node-loss"]:
        problems.append(f"the store outage and then the node loss should have happened, not {faults}")
    # recovery runs from the fault that stopped the job (an outage of the store alone stops nothing)
    fault_time = next((f["time"] for f in faults if f.get("phase") != "outage"), faults[0]["time"])
    damaged = _damaged(faults)
    outcome.damaged = sorted(damaged)
    after = sorted(
        (key, r) for key, r in result.reports.items() if r["start_time"] > fault_time and "restored_step" in r
    )
    if not after:
        problems.append("no attempt came up after the fault")
        return
    for (launch, attempt, rank), report in after:
        expected = _newest_complete(report, drill.world_size, damaged)
        restored = report["restored_step"]
        if rank == 0:
            outcome.restored.append(restored)
            if drill.fault in _KILLS:
                outcome.recomputed.append(drill.step - (restored or 0))
        if _loaded_damaged(report, damaged):
            problems.append(
                f"launch {launch} attempt {attempt} rank {rank} loaded the damaged step {restored} "
                f"(from {report.get('restored_from')!r}, damaged: {damaged})"
            )
        elif restored != expected:
            problems.append(
                f"launch {launch} attempt {attempt} rank {rank} restored step {restored}, but the newest step "
                f"committed on every rank was {expected} (held: {report['committed']}, of which elsewhere than on "
                f"disk: {report.get('elsewhere', {})}, damaged: {damaged})"
            )
    first_steps = [r["first_step_time"] for _, r in after if "first_step_time" in r]
    if first_steps:
        outcome.recovery_s = round(min(first_steps) - fault_time, 2)
        if outcome.recovery_s > DEADLINE_S[drill.fault]:
            problems.append(f"recovery took {outcome.recovery_s} s, over its deadline of {DEADLINE_S[drill.fault]} s")
    else:
        problems.append("no step ran after the restore")


class References:
    """One uninterrupted run per loader configuration, run on first use and kept for the campaign."""

    def __init__(self, root: Path, steps: int = STEPS, variant: str = "") -> None:
        self.root, self.steps, self.variant = root, steps, variant
        self._weights: dict[Drill, dict[str, torch.Tensor]] = {}
        self._store: S3Outages | None = None

    def env(self, drill: Drill) -> dict[str, str]:
        """What the drill's launches need in their environment: the variant's overrides, the S3 store (started on
        first use)."""
        env = {OVERRIDES_ENV: VARIANTS[self.variant]} if self.variant else {}
        if drill.checkpoint != "s3":
            return env
        if self._store is None:
            self._store = S3Outages(self.root)
        return self._store.env | env

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def __getitem__(self, drill: Drill) -> dict[str, torch.Tensor]:
        """The final weights of ``drill`` without its fault."""
        reference = drill.reference
        if reference not in self._weights:
            run_dir = self.root / f"reference_w{reference.workers}_{reference.checkpoint}"
            result = run_drill(reference, run_dir, env=self.env(reference))
            assert all(r["restored_step"] is None for r in result.reports.values()), "the reference restored"
            self._weights[reference] = result.weights()
        return self._weights[reference]


def run_one(seed: int, references: References, root: Path, faults: tuple[str, ...] = FAULTS[1:]) -> Outcome:
    """Draw the drill of ``seed``, run it in ``root/drill_<seed>`` and check it."""
    drill = draw(seed, references.steps, faults)
    reference = references[drill]
    run_dir = root / f"drill_{seed}"
    outcome = Outcome(seed, drill.fault, drill.rank, drill.step, drill.workers, drill.checkpoint, run_dir=str(run_dir))
    outcome.faults = "" if set(faults) == set(FAULTS[1:]) else ",".join(faults)
    outcome.variant = references.variant
    start = time.perf_counter()
    disk = tmpfs(run_dir / "ckpt") if drill.fault == "disk-full" else contextlib.nullcontext()
    try:
        with disk:
            outcome = _run_and_check(drill, run_dir, references, reference, outcome)
    except TmpfsUnavailable as err:
        outcome.problems.append(f"{FULL_DISK_UNAVAILABLE}: {err}")
    outcome.wall_s = round(time.perf_counter() - start, 2)
    return outcome


def _run_and_check(
    drill: Drill, run_dir: Path, references: References, reference: dict[str, torch.Tensor], outcome: Outcome
) -> Outcome:
    try:
        result = run_drill(drill, run_dir, env=references.env(drill))
    except LaunchTimeout as err:
        outcome.problems.append(f"the job did not finish: a launch ran past its bound of {err.timeout} s; "
                                f"{err.evidence()}")  # fmt: skip
    except Exception as err:  # a launch that failed (AssertionError with the logs)
        outcome.problems.append(f"the job did not finish: {type(err).__name__}: {str(err)[-3000:]}")
    else:
        check(result, reference, outcome)
    left = leftovers(run_dir)
    if left:
        outcome.problems.append(f"processes left after the job ended: {left}")
    return outcome


def run_campaign(
    seed: int,
    n: int,
    root: Path,
    results_path: Path,
    steps: int = STEPS,
    faults: tuple[str, ...] = FAULTS[1:],
    log: Any = print,
    variant: str = "",
) -> list[Outcome]:
    """Drills ``seed .. seed + n - 1``, one after the other; each outcome is logged as it ends and the results file
    is rewritten after every drill (a campaign cut short still leaves what ran)."""
    root.mkdir(parents=True, exist_ok=True)
    references = References(root, steps, variant)
    outcomes: list[Outcome] = []
    start = time.perf_counter()
    with contextlib.closing(references):
        for index in range(n):
            outcomes.append(_run_logged(seed, index, n, references, root, faults, log))
            _write_results(results_path, seed, n, steps, outcomes, time.perf_counter() - start, variant)
    return outcomes


def _run_logged(
    seed: int, index: int, n: int, references: References, root: Path, faults: tuple[str, ...], log: Any
) -> Outcome:
    outcome = run_one(seed + index, references, root, faults)
    status = "ok" if outcome.ok else "FAILED: " + " | ".join(outcome.problems)
    log(
        f"[{index + 1}/{n}] seed {outcome.seed}: {outcome.fault} rank {outcome.rank} step {outcome.step} "
        f"workers {outcome.workers} checkpoint {outcome.checkpoint}: {status} (recovered in "
        f"{outcome.recovery_s} s, drill {outcome.wall_s} s; replay: {outcome.replay()})"
    )
    return outcome


def _commit() -> str | None:
    """The checkout's commit: a drill's seed replays its drill on the code that drew it."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _write_results(
    path: Path, seed: int, n: int, steps: int, outcomes: list[Outcome], elapsed_s: float, variant: str = ""
) -> None:
    results = {
        "commit": _commit(),
        "seed": seed,
        "n": n,
        "steps": steps,
        "variant": variant,
        "overrides": VARIANTS.get(variant, ""),
        "command": replay_command(seed, outcomes[0].faults, n, variant),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{psutil.cpu_count()} CPU cores (shared), 2 ranks (gloo)",
        "elapsed_s": round(elapsed_s, 1),
        "drills": [asdict(o) for o in outcomes],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------- results and docs
def table(campaigns: list[dict[str, Any]]) -> str:
    """The campaign table (fault x drills x outcome x time to recover) of one or more results files, as Markdown."""
    rows = [
        "| fault | drills | passed | failed | fault to first good step, median (s) | max (s) | deadline (s) "
        "| steps recomputed, median | max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    drills = [d for c in campaigns for d in c["drills"]]
    for kind in FAULTS[1:]:
        mine = [d for d in drills if d["fault"] == kind]
        if not mine:
            rows.append(f"| {kind} | 0 | - | - | - | - | {DEADLINE_S[kind]:.0f} | - | - |")
            continue
        passed = sum(not d["problems"] for d in mine)
        times = [d["recovery_s"] for d in mine if d["recovery_s"] is not None]
        median = f"{statistics.median(times):.1f}" if times else "-"
        worst = f"{max(times):.1f}" if times else "-"
        counts = f"{len(mine)} | {passed} | {len(mine) - passed}"
        redone = [n for d in mine for n in d.get("recomputed") or []]  # campaigns before the field have none
        lost = f"{statistics.median(redone):.0f} | {max(redone)}" if redone else "- | -"
        rows.append(f"| {kind} | {counts} | {median} | {worst} | {DEADLINE_S[kind]:.0f} | {lost} |")
    failed = [d for d in drills if d["problems"]]
    rows.append(f"| **all** | **{len(drills)}** | **{len(drills) - len(failed)}** | **{len(failed)}** | | | | | |")
    lines = [BEGIN]
    for c in campaigns:
        ran = len(c["drills"])
        short = f" (of {c['n']} planned, cut short by the time available)" if ran < c["n"] else ""
        at = f" at commit {c['commit']}" if c.get("commit") else ""
        lines.append(
            f"- `{c['command']}`{at}: {ran} drills{short}, seeds {c['seed']} to {c['seed'] + ran - 1}, {c['steps']} "
            f"steps each, {c['elapsed_s'] / 60:.0f} min on {c['machine']}, {c['date']}"
        )
    lines += ["", *rows]
    if failed:
        lines += ["", "Failed drills (replay with the command given):", ""]
        for c in campaigns:
            checkout = f"git checkout {c['commit']} && " if c.get("commit") else ""
            for d in (d for d in c["drills"] if d["problems"]):
                what = "; ".join(problem[:240] for problem in d["problems"])
                lines.append(f"- `{checkout}{replay_command(d['seed'], d.get('faults', ''))}` ({d['fault']}): {what}")
    lines.append(END)
    return "\n".join(lines)


def _kind_figures(drills: list[dict[str, Any]]) -> tuple[str, str, str]:
    times = [d["recovery_s"] for d in drills if d["recovery_s"] is not None]
    redone = [n for d in drills for n in d.get("recomputed") or []]
    passed = f"{sum(not d['problems'] for d in drills)}/{len(drills)}"
    median = f"{statistics.median(times):.1f}" if times else "-"
    lost = f"{statistics.median(redone):.0f} / {max(redone)}" if redone else "-"
    return passed, median, lost


def _filter(campaign: dict[str, Any]) -> str:
    return str(campaign["drills"][0].get("faults", "")) if campaign["drills"] else ""


def before_after(campaigns: list[dict[str, Any]]) -> list[str]:
    """For each variant campaign (:data:`VARIANTS`): a table of it ("before") against the default campaigns of the
    same commit and fault filter ("after"), per fault kind drawn in both."""
    lines: list[str] = []
    for before in (c for c in campaigns if c.get("variant")):
        after = [
            c
            for c in campaigns
            if not c.get("variant") and c.get("commit") == before.get("commit") and _filter(c) == _filter(before)
        ]
        if not after:
            continue
        lines += [
            "",
            f"Before and after at commit {before.get('commit')}: `{before['command']}` (before: "
            f"`{before.get('overrides')}`) against " + ", ".join(f"`{c['command']}`" for c in after) + " (after).",
            "",
            "| fault | passed, before | passed, after | fault to first good step, median (s), before | after "
            "| steps recomputed, median / max, before | after |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        drawn_after = [d for c in after for d in c["drills"]]
        for kind in FAULTS[1:]:
            b = [d for d in before["drills"] if d["fault"] == kind]
            a = [d for d in drawn_after if d["fault"] == kind]
            if b and a:
                (pb, mb, lb), (pa, ma, la) = _kind_figures(b), _kind_figures(a)
                lines.append(f"| {kind} | {pb} | {pa} | {mb} | {ma} | {lb} | {la} |")
    return lines


def earlier(campaigns: list[dict[str, Any]]) -> list[str]:
    """One line per campaign of an earlier commit (kept for the record, not in the table), failures with replays."""
    lines = ["", "Earlier campaigns, on earlier commits (`docs/results/earlier/`):", ""]
    for c in campaigns:
        failed = [d for d in c["drills"] if d["problems"]]
        lines.append(
            f"- `{c['command']}` at commit {c.get('commit')}: {len(c['drills'])} drills, "
            f"{len(c['drills']) - len(failed)} passed, {len(failed)} failed"
            + "".join(f"; failed: seed {d['seed']} ({d['fault']})" for d in failed)
        )
    return lines


def rendered(text: str, results_dir: Path = RESULTS_DIR) -> str:
    """``text`` (docs/reliability.md) with its campaign block regenerated from every results file in
    ``results_dir`` (the table) and in ``results_dir/earlier`` (a line each)."""
    published = [json.loads(p.read_text()) for p in sorted(results_dir.glob("drill_campaign_*.json"))]
    campaigns = [c for c in published if not c.get("variant")]  # a variant is a "before", not the product
    old = [json.loads(p.read_text()) for p in sorted((results_dir / "earlier").glob("drill_campaign_*.json"))]
    block = table(campaigns) if campaigns else f"{BEGIN}\nNo campaign published yet.\n{END}"
    for lines in (before_after(published), earlier(old) if old else []):
        if lines:  # appended inside the block, before its end marker
            block = block[: -len(END)].rstrip("\n") + "\n" + "\n".join(lines) + "\n" + END
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[end:]


def publish(results_dir: Path = RESULTS_DIR, docs: Path = DOCS) -> None:
    """Regenerate the campaign table of ``docs`` from every results file in ``results_dir``."""
    docs.write_text(rendered(docs.read_text(), results_dir))


def _print(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10, help="number of drills")
    parser.add_argument("--seed", type=int, default=None, help="seed of the first drill (default: the time)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--faults", default="", help="comma-separated fault kinds to draw from (default: every kind)")
    parser.add_argument("--results", type=Path, default=None, help="results file (default: in the campaign's root)")
    parser.add_argument(
        "--publish", action="store_true", help=f"results to {RESULTS_DIR}, then docs/reliability.md's table from them"
    )
    parser.add_argument("--docs-only", action="store_true", help="regenerate the table from the published results")
    parser.add_argument("--root", type=Path, default=None, help="where the drills run (default: a temporary dir)")
    parser.add_argument(
        "--variant", default="", choices=["", *VARIANTS], help="run the default preset with a variant's overrides"
    )
    args = parser.parse_args(argv)
    if args.docs_only:
        publish()
        return 0
    faults = tuple(args.faults.split(",")) if args.faults else FAULTS[1:]
    unknown = sorted(set(faults) - set(FAULTS[1:]))
    if unknown:
        parser.error(f"--faults: unknown kinds {unknown}; known: {list(FAULTS[1:])}")
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    print(f"drill campaign: {args.n} drills from seed {seed} (replay one: make drills N=1 SEED=<its seed>)", flush=True)
    root = args.root or Path(tempfile.mkdtemp(prefix="drills_"))
    name = f"drill_campaign_{seed}" + (f"_{args.variant}" if args.variant else "") + ".json"
    path = args.results or (RESULTS_DIR / name if args.publish else root / "results.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    outcomes = run_campaign(seed, args.n, root, path, args.steps, faults, log=_print, variant=args.variant)
    print(table([json.loads(path.read_text())]))
    print(f"results: {path}; drills ran in {root}")
    if args.publish:
        publish()
    return 1 if any(not o.ok for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
