"""What does SDC verification catch at the cadence users run it, how fast, and what does it cost there?

Run from the repository root::

    python -m benchmarks.sdc_coverage            # 20 trials per cell, both presets (about an hour, quiet machine)
    python -m benchmarks.sdc_coverage --quick    # smoke mode: short cadences, 1 trial per cell (not a figure)

Three CPU processes train ``recipes._gpt.TinyGPT`` (tiny preset) under DDP on gloo with a plain loop, an
:class:`~lightning_resilience.sdc.SDCMonitor` configured exactly as a preset (``configs/resilience/sdc``) and the
suite's :class:`~lightning_resilience.step.driver.StepDriver`: the late guards travel in each step's one agreement,
issued at the step's start and taken at its end, as in a Lightning job (no rank waits on an ordinary step).

* ``default`` (``resilience=default``, ``sdc/guards.yaml``): guards every step, read one step late; cross-replica
  reconciliation every 50 steps; a replay on every device every 200 steps (every other rank's batch, by that rank
  and its neighbour); no communication hook; the same round when a job-wide guard fires (of the spiking ranks'
  batches when only losses spike; none for a spike within ``guard_quiet_steps`` of one a replay found genuine), and
  of every batch at the first step after a rollback;
* ``full`` (``resilience=full``, ``sdc/dual_run.yaml``): the same guards, a dual-run replay (with partner, bucket
  digests by a communication hook) every 50 steps, reconciliation every 25.

Faults, reported apart (20 trials per cell by default, each from the same initial state, ``2 x W`` steps where W is
the longest cadence of the checks a flip that stays waits for, :func:`window`; the fault lands at a random step of
the second window, after the guard baselines are warm):

* **persistent state** — a parameter or an AdamW state tensor: one bit (any class), a burst of 3 adjacent bits, or
  one bit in 4 elements 7 apart (strided). It stays until a reconciliation sees it.
* **transient** — a local gradient before the all-reduce or a leaf module's activation, the same three patterns,
  once. Only a guard (its values read one step late: it asks for a replay of the *next* step) or a replay of that
  very step can see it; the ``caught by`` column says which.
* **faulty device** — one rank corrupts one weight's gradient from the fault step on: an exponent bit at every
  step, or a low mantissa bit at every step; a **flaky device**: an exponent bit at a rate of 1 in 4 (reported
  apart, no goal). A faulty-device trial runs for the stated bound after its onset (:func:`faulty_bound`: the steps
  within which the preset's scheduled replays meet every rank), so a miss is a miss of the bound, not of the window.
* **stale save** — a checkpoint tier commits the previous step's tensors under a new step's name (single process,
  :class:`~lightning_resilience.checkpoint.manager.CheckpointManager` with a local tier): is it refused at the
  restore, and is the step before it restored?

Outcomes: ``caught`` (a corruption verdict naming exactly the faulty rank), ``flagged`` (detected, no rank or
another rank named: an inconclusive vote, a rollback for a non-finite value), ``missed`` (nothing detected, the final
state differs bitwise from the clean run), ``no_effect`` (nothing detected, state equal to the clean run). Coverage =
caught / (trials - no effect) with its 95% Wilson interval; localization = caught / (caught + flagged); latency in
optimizer steps from the faulty step to the first detection (mean, max).

Overhead, in the same run: windows of 10 steps (``--overhead-window``) of the preset's monitored loop, 160 of them
(``--overhead-rounds``), alternate (A B B A) with as many windows of a
**true plain arm**: a second replica of the model with its own DDP wrapper that has no communication hook, no
digests, no guards and no step driver. Each arm keeps its own state, so nothing a check leaves behind (a hook
enabled, digests on) runs in a plain window. Slowdown = mean and p99 step time of the monitored arm over the plain,
and the mean over neighbouring pairs of windows with its 95% interval (the drift between two windows cancels).
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import (
    REPO_ROOT,
    add_load_argument,
    check_load_at_start,
    command_line,
    cpu_counters,
    finish_load,
    fmt_pct,
    machine_info,
    md_table,
    mean_interval,
    now_iso,
    print_flush,
    slowdowns,
    target,
    write_json,
)
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.inject import BIT_CLASSES

MODULE = "benchmarks.sdc_coverage"
DEFAULT_OUT = "benchmarks/results/sdc_coverage.json"
TITLE = "SDC verification at the presets' cadence: coverage, localization and latency by kind of fault, and overhead"
README_PENDING = (
    "**SDC** (persistent-state flips, transient flips and faulty devices apart, 3 DDP ranks, the presets' cadence): "
    "pending, no result of the current benchmark yet (`python -m benchmarks.sdc_coverage` on a quiet machine)."
)
WORLD = 3
OWN_CORES = 2
OVERHEAD_BATCH = 32
"""The batch of the third overhead launch: 2,048 tokens a step per rank (the trials' 4 sequences are 256)."""
"""Ranks of the second overhead launch: one per core of this machine, as a job runs one rank per device. With WORLD
ranks on 2 cores each rank's agreement thread, woken twice a round, can cost its training thread the core for a
scheduler slice (the driver's issue phase shows it), which no deployment with a core per rank pays."""
PRESETS = {"default": "guards", "full": "dual_run"}
"""Preset name -> its file in configs/resilience/sdc/."""
PATTERNS: dict[str, dict[str, int]] = {
    "one_bit": {"bits": 1, "elements": 1, "stride": 1},
    "burst3": {"bits": 3, "elements": 1, "stride": 1},
    "strided4": {"bits": 1, "elements": 4, "stride": 7},
}
"""Flip shapes: one bit, a burst of 3 adjacent bits, one bit in 4 elements 7 apart."""
FAULTY: dict[str, dict[str, Any]] = {
    "exponent_every_step": {"bit_class": "exponent", "rate": 1.0},
    "exponent_flaky_1in4": {"bit_class": "exponent", "rate": 0.25},
    "mantissa_low_every_step": {"bit_class": "mantissa_low", "rate": 1.0},
}
KINDS = ("persistent", "transient", "faulty_device", "flaky_device")
"""Kinds of fault, reported apart; a device that corrupts every step is ``faulty_device``, one at a lower rate
``flaky_device`` (no goal: a replay on it sees the fault only at that rate)."""
DEVICE_KINDS = ("faulty_device", "flaky_device")
SLACK_STEPS = 5
BATCH_POOL = 200
"""Distinct batches a rank trains on, cycled (the overhead's 1,600 steps an arm go through them 8 times), whatever the
trials' window: the data, and so the guards' false alarms, do not change with a preset's cadences."""
OVERHEAD_WARM_STEPS = 100
"""Steps of each arm before the overhead's windows (at least the trials' window): the guard baselines are warm."""
"""Steps after a replay round that a verdict may take (its vote, the agreement that carries it)."""
_COUNTS = ["trials", "caught", "flagged", "missed", "no effect", "coverage (95% CI)"]
KIND_HEADER = ["kind of fault", *_COUNTS, "localization", "latency mean / max", "caught by"]
CELL_HEADER = ["cell", *_COUNTS, "latency mean / max", "caught by"]
_LOCATION_KIND = {"param": "persistent", "optim": "persistent", "grad": "transient", "activation": "transient"}
FAULTY_WEIGHT = "blocks.0.mlp.fc.weight"

pc = time.perf_counter


def preset_config(name: str, scale: int | None = None) -> SDCConfig:
    """The SDC config a preset builds (its YAML's ``config:``); ``scale`` shortens every cadence to that many steps
    (quick runs only)."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(REPO_ROOT / "configs" / "resilience" / "sdc" / f"{PRESETS[name]}.yaml")
    values = {k: v for k, v in OmegaConf.to_container(node.config).items() if k != "run_dir"}  # type: ignore[union-attr]
    if scale is not None:
        for key in ("replay_every_n_steps", "reconcile_every_n_steps"):
            if values.get(key):
                values[key] = scale
    return SDCConfig(**values)


def window(cfg: SDCConfig) -> int:
    """W, the trials' window: the longest cadence of the checks that a flip which stays waits for (the
    reconciliation, the parameter-norm guard), and the replay's when it is at most twice that (a window then holds
    whole replay periods, so a transient flip lands on a scheduled replay as often as in training) or when neither
    other check runs. A longer replay cadence is left out: a faulty device is given the stated bound instead
    (:func:`faulty_bound`), and the transient trials do not sample the ``1 / replay_every_n_steps`` of flips that a
    scheduled replay would see (the notes say so)."""
    stays = max(cfg.reconcile_every_n_steps, cfg.param_norm_every_n_steps)
    return stays if cfg.replay_every_n_steps > 2 * stays > 0 else max(stays, cfg.replay_every_n_steps)


def faulty_bound(cfg: SDCConfig, world: int = WORLD) -> int | None:
    """Steps within which a scheduled replay meets a device that corrupts every step (the stated latency bound).

    A scheduled round every ``replay_every_n_steps``: with ``all`` or ``devices`` every device replays at every
    round; with ``rotate`` one rank's batch by turns, replayed by that rank and (partner replay) its neighbour: a
    rank takes part in 2 turns of every ``world`` (1 without a partner), so at most ``world - 1`` rounds (``world``)
    pass between two of its turns; plus the round's vote and the agreement that carries it. None: no scheduled
    replay (only a guard can ask for one)."""
    if not cfg.replay_every_n_steps:
        return None
    rounds = 1 if cfg.replay_scope != "rotate" or world == 1 else (world - 1 if cfg.partner_replay else world)
    return rounds * cfg.replay_every_n_steps + SLACK_STEPS


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """The 95% Wilson score interval of a proportion (None without trials)."""
    if n <= 0:
        return None
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _model_kwargs() -> dict[str, Any]:
    from recipes._gpt import gpt_preset

    kw = gpt_preset("tiny")
    kw["max_steps"] = 1000
    return kw


def _batches(kw: dict[str, Any], rank: int, n: int, batch_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(kw["vocab_size"], (batch_size, kw["seq_len"] + 1), generator=gen) for _ in range(n)]


def _loss(module: Any, batch: torch.Tensor) -> torch.Tensor:
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = module(inputs)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _trials(args: argparse.Namespace, w: int) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    out = []
    for location in args.locations:
        for pattern in PATTERNS:
            for _ in range(args.trials):
                out.append(dict(kind=_LOCATION_KIND[location], cell=f"{location}/{pattern}", location=location,
                                pattern=pattern, bit_class=rng.choice(BIT_CLASSES), rank=rng.randrange(WORLD),
                                step=w + rng.randrange(w), seed=rng.randrange(2**31)))  # fmt: skip
    for name in args.faulty:
        kind = "faulty_device" if FAULTY[name]["rate"] >= 1.0 else "flaky_device"
        for _ in range(args.trials):
            out.append(dict(kind=kind, cell=f"faulty/{name}", location="grad", pattern=name,
                            rank=rng.randrange(WORLD), step=w + rng.randrange(w), seed=rng.randrange(2**31),
                            **FAULTY[name]))  # fmt: skip
    return out


class _Decisions:
    """The step driver's actor in the benchmark: an in-process rollback restores the newest kept state at or before
    the bad step (``restore(bad) -> restored step``, the suite's cap of 3 per trial); a stop ends the trial (on
    every rank alike); a decision that only logs goes on. Every decision is recorded."""

    def __init__(self, restore: Any = None) -> None:
        self.decisions: list[Any] = []
        self.restore = restore
        self.rollbacks = 0
        self.stopped = False

    def rollback(self, decision: Any) -> Any:
        from lightning_resilience.policy import Action, Decision

        self.decisions.append(decision)
        bad = min((v.bad_step if v.bad_step is not None else v.step for v in decision.verdicts), default=decision.step)
        if self.restore is None or self.rollbacks >= 3 or self.restore(min(bad, decision.step - 1)) is None:
            self.stopped = True
            return Decision(decision.step, Action.ROLLBACK, decision.event, decision.verdicts)
        self.rollbacks += 1
        return None

    def stop(self, decision: Any) -> None:
        self.decisions.append(decision)
        self.stopped = True

    def note(self, decision: Any) -> None:
        pass  # a logged spike: the replay it leads to is what the monitor records


def _rank(
    rank: int,
    preset: str,
    scale: int | None,
    trials: list[dict[str, Any]] | None,
    overhead_rounds: int,
    overhead_window: int,
    batch_size: int = 4,
) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_resilience.policy import PolicyConfig
    from lightning_resilience.sdc.fingerprint import BitwiseDigest, digest_all
    from lightning_resilience.sdc.inject import BitFlipInjector, FlipSpec
    from lightning_resilience.sdc.monitor import SDCMonitor
    from lightning_resilience.sdc.verdict import Diagnosis
    from lightning_resilience.step.channels import Channels
    from lightning_resilience.step.driver import StepDriver
    from recipes._gpt import TinyGPT

    torch.use_deterministic_algorithms(True)
    cfg = preset_config(preset, scale)
    w = window(cfg)
    bound = faulty_bound(cfg)
    kw = _model_kwargs()
    torch.manual_seed(0)
    model = TinyGPT(**kw)
    model.train()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ddp = DistributedDataParallel(model)
    # the true plain arm: a replica of its own, wrapped without any hook, never seen by the monitor
    plain_model = TinyGPT(**kw)
    plain_model.load_state_dict(init)
    plain_model.train()
    plain_ddp = DistributedDataParallel(plain_model)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    floor = _Floor(cfg, init, rank)
    batches = _batches(kw, rank, max(2 * w, BATCH_POOL), batch_size)
    monitor = SDCMonitor(list(model.named_parameters()), [], cfg)
    # the suite's groups: the monitor's reductions (a reconciliation's hash, a replay round's flags) ride the step
    # agreement's tree, as in a job
    channels = Channels([cfg.timeout], timedelta(seconds=300))
    monitor.setup(side=channels.side("sdc", cfg.timeout))
    monitor.attach(lambda b: _loss(model, b), ddp=ddp, synced_loss_fn=lambda b: _loss(ddp, b))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    agreement = channels.agreement
    state: dict[str, Any] = {"kept": deque(maxlen=3), "goto": None}

    def restore(bad: int) -> int | None:
        """The in-process rollback of the suite, in the loop: the newest kept state at or before ``bad``."""
        kept = [k for k in state["kept"] if k[0] <= bad]
        if not kept:
            return None
        step_, weights, optim = kept[-1]
        with torch.no_grad():
            model.load_state_dict(weights)
        opt.load_state_dict(copy.deepcopy(optim))
        monitor.rolled_back(step_)
        state["goto"] = step_
        return int(step_)

    def new_driver() -> tuple[StepDriver, _Decisions]:
        driver = StepDriver(PolicyConfig(), agreement)
        driver.add_contributor(monitor)
        monitor.driven = True
        return driver, _Decisions(restore)

    state["driver"], state["actor"] = new_driver()

    def step(i: int) -> float:
        batch = batches[i % len(batches)]
        driver, actor = state["driver"], state["actor"]
        t0 = pc()
        driver.begin_step(i)
        monitor.begin_step(i, batch)
        loss = _loss(ddp, batch)
        monitor.observe_loss(loss)
        loss.backward()
        monitor.before_optimizer_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        monitor.after_optimizer_step()
        driver.end_step(i + 1, actor)
        return pc() - t0

    def plain_step(i: int) -> float:
        batch = batches[i % len(batches)]
        t0 = pc()
        loss = _loss(plain_ddp, batch)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        return pc() - t0

    def arm_step(kind: str, i: int) -> float:
        if kind == "checked":
            return step(i)
        return plain_step(i) if kind == "plain" else floor.step(i, batches[i % len(batches)])

    def reset() -> None:
        nonlocal opt
        with torch.no_grad():
            model.load_state_dict(init)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        monitor.optimizers = monitor.reconciler.optimizers = [opt]
        monitor.reset()
        monitor.rolled_back(0)
        # fresh baselines: every trial replays the same steps, a baseline fed by earlier trials would be noise
        monitor.guards.reset()
        state["driver"], state["actor"] = new_driver()
        torch.manual_seed(100 + rank)

    def run(trial: dict[str, Any] | None) -> dict[str, Any]:
        reset()
        injector = BitFlipInjector(model, [opt], rank=rank)
        plan = []
        device = trial is not None and trial["kind"] in DEVICE_KINDS
        if trial is not None and not device:
            shape = PATTERNS[trial["pattern"]]
            plan = [FlipSpec(trial["location"], trial["step"], trial["rank"], trial["bit_class"], seed=trial["seed"],
                             **shape)]  # fmt: skip
        i, armed, steps = 0, False, 0
        detected = named = None
        state["kept"].clear()
        # a faulty device is given the stated bound after its onset: the schedule meets it within that many steps
        end = max(2 * w, trial["step"] + 1 + bound) if device and bound else 2 * w
        while i < end and steps < 2 * end:
            if device and i == trial["step"] and not armed:
                armed = True
                if rank == trial["rank"]:
                    injector.faulty_device("grad", 1, bit_class=trial["bit_class"], rate=trial["rate"],
                                           target=FAULTY_WEIGHT, seed=trial["seed"])  # fmt: skip
            # a flip is an event in time, not a property of the step: a rerun after a rollback does not flip again
            # (flipping the same bit twice would undo it)
            injector.on_step(i, plan)
            plan = [spec for spec in plan if spec.step != i]
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            state["kept"].append((i, weights, copy.deepcopy(opt.state_dict())))
            state["goto"] = None
            step(i)
            steps += 1
            i = state["goto"] if state["goto"] is not None else i + 1
            found = [e for e in monitor.events if e.verdict is not Diagnosis.CLEAN]
            if detected is None and (found or state["actor"].decisions):
                detected = steps  # steps run until the first detection, reruns after a rollback included
            if named is None and any(e.suspects for e in found if e.verdict is not Diagnosis.ANOMALY):
                named = steps
            if monitor.dirty or state["actor"].stopped:  # the ranks decided: the trial is over (alike everywhere)
                break
        injector.remove()
        final = digest_all(BitwiseDigest(), [p.detach() for p in model.parameters()])
        events = [e.to_json() for e in monitor.events if e.verdict is not Diagnosis.CLEAN]
        decided = [{"step": d.step, "action": d.action.value, "event": d.event.value}
                   for d in state["actor"].decisions]  # fmt: skip
        return {"final": final.tolist(), "events": events, "decisions": decided, "detected": detected, "named": named}

    reference = {"events": []}
    if trials is not None:  # None: the overhead alone (the launch on one rank per core)
        run(None)  # DDP rebuilds its buckets after the first iteration: the reference must use the final layout
        reference = run(None)
    results = []
    for trial in trials or []:
        r = run(trial)
        # a device that corrupts every step (or at a rate) changes the run by construction, and its trials run past
        # the clean reference's length: undetected is missed
        r["effect"] = trial["kind"] in DEVICE_KINDS or r["final"] != reference["final"]
        del r["final"]
        results.append(r)
    # overhead: short windows of each arm taking turns, A B B A (neighbours pair up: the machine's drift, slower than
    # two windows, cancels out of a pair), after the warm steps of each; each arm goes on with its own state
    ow = overhead_window
    warm = w if scale is not None else max(w, OVERHEAD_WARM_STEPS)
    reset()
    times: dict[str, list[float]] = {"plain": [], "checked": [], "floor": []}
    # each arm draws its dropout from an RNG state of its own: the monitored arm's trajectory (and so how often its
    # guards fire) does not depend on the other arms' steps between its own
    rng = {kind: torch.get_rng_state() for kind in times}
    for kind in times:
        torch.set_rng_state(rng[kind])
        for i in range(warm):
            arm_step(kind, i)
        rng[kind] = torch.get_rng_state()
    stats0 = copy.copy(monitor.stats)  # what the checked windows spend, by part (wall time on this rank)
    fired0 = dict(monitor.stats.guard_fired)
    phases0 = dict(state["driver"].stats.seconds)
    i = warm
    for r in range(overhead_rounds):
        for kind in ("checked", "plain", "floor") if r % 2 == 0 else ("floor", "plain", "checked"):
            torch.set_rng_state(rng[kind])
            for k in range(ow):
                times[kind].append(arm_step(kind, i + k))
            rng[kind] = torch.get_rng_state()
        i += ow
    channels.close()
    cpu_s = time.process_time()  # this rank's CPU, all its threads: the benchmark's own load, not a neighbour's
    n, st = max(len(times["checked"]), 1), monitor.stats
    driver_ms = {k: (v - phases0.get(k, 0.0)) * 1e3 / n for k, v in state["driver"].stats.seconds.items()}
    parts_ms = {
        "guards": st.guard_seconds - stats0.guard_seconds,
        "replay rounds": st.replay_seconds - stats0.replay_seconds,
        "reconciliation rounds": st.reconcile_seconds - stats0.reconcile_seconds,
    }
    parts = {k: v * 1e3 / n for k, v in parts_ms.items()}
    parts["step driver (its agreement, on the training thread)"] = sum(driver_ms.values())
    fired = {k: v - fired0.get(k, 0) for k, v in st.guard_fired.items() if v > fired0.get(k, 0)}
    rounds = {"replay": st.replay_rounds - stats0.replay_rounds, "reconcile": st.reconcile_rounds
              - stats0.reconcile_rounds, "steps": len(times["checked"]), "guards_fired": fired}  # fmt: skip
    return {"results": results if rank == 0 else [], "times": times, "window": ow, "events": reference["events"],
            "parts_ms_per_step": parts, "driver_phases_ms_per_step": driver_ms, "rounds": rounds,
            "cpu_s": cpu_s}  # fmt: skip


class _Floor:
    """The physical floor of a preset's checks: a replica of its own stepping as the plain arm does, plus the same
    local arithmetic at the preset's cadences (this rank's turn at the gradient norm, the parameter norm, the digest of
    the parameters and the optimizer state, and a replay's forward, backward and gradient digest, one a round), with
    none of the monitor's bookkeeping, no agreement and no collective."""

    def __init__(self, cfg: Any, init: dict[str, torch.Tensor], rank: int) -> None:
        from torch.nn.parallel import DistributedDataParallel

        from lightning_resilience.sdc.fingerprint import BitwiseDigest
        from lightning_resilience.sdc.reconcile import ReplicaReconciler
        from recipes._gpt import TinyGPT

        self.cfg, self.rank = cfg, rank
        self.model = TinyGPT(**_model_kwargs())
        self.model.load_state_dict(init)
        self.model.train()
        self.ddp = DistributedDataParallel(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.params = list(self.model.parameters())
        self.digest = BitwiseDigest()
        self.state = ReplicaReconciler(list(self.model.named_parameters()), [self.opt], self.digest)
        world = torch.distributed.get_world_size()
        self.stride = min(world, cfg.guard_grad_norm_stride)  # replicated gradients: the ranks take turns

    def step(self, i: int, batch: torch.Tensor) -> float:
        from lightning_resilience.sdc.fingerprint import digest_all
        from lightning_resilience.sdc.guards import grad_norm, param_norm

        cfg = self.cfg

        def due(every: int) -> bool:
            return every > 0 and (i + 1) % every == 0

        t0 = pc()
        if due(cfg.replay_every_n_steps):  # the recompute of a replay: this rank's batch again, its gradients digested
            _loss(self.model, batch).backward()
            digest_all(self.digest, [p.grad for p in self.params])
            self.opt.zero_grad(set_to_none=True)
        _loss(self.ddp, batch).backward()
        if cfg.guards and due(cfg.param_norm_every_n_steps):
            param_norm(self.params)
        if cfg.guards and i % self.stride == self.rank % self.stride:
            grad_norm(self.params)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if due(cfg.reconcile_every_n_steps):
            self.state.local()
        return pc() - t0


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


def _cells(trials: list[dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
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


def _kinds(cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
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


def measure(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    from tests.sdc._spawn import run_ranks

    cfg = preset_config(preset, args.scale)
    w = window(cfg)
    trials = _trials(args, w)
    print_flush(f"[sdc] {preset}: {len(trials)} trials of {2 * w} steps on {WORLD} ranks")
    t0 = pc()
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        # each launch reads only what it wrote
        first, second, third = Path(tmp) / "trials", Path(tmp) / "own_cores", Path(tmp) / "large_batch"
        for folder in (first, second, third):
            folder.mkdir()
        per_rank = run_ranks(_rank, WORLD, first, preset, args.scale, trials, args.overhead_rounds,
                             args.overhead_window, timeout_s=14400.0)  # fmt: skip
        print_flush(f"[sdc] {preset}: the overhead again on {OWN_CORES} ranks, one per core")
        own = run_ranks(_rank, OWN_CORES, second, preset, args.scale, None, args.overhead_rounds, args.overhead_window,
                        timeout_s=3600.0)  # fmt: skip
        print_flush(f"[sdc] {preset}: the overhead again on {OWN_CORES} ranks, batches of {args.overhead_batch}")
        large = run_ranks(_rank, OWN_CORES, third, preset, args.scale, None, args.overhead_rounds,
                          args.overhead_window, args.overhead_batch, timeout_s=3600.0)  # fmt: skip
    cells = _cells(trials, per_rank[0]["results"])
    return {
        "preset": preset,
        "config": {
            k: getattr(cfg, k)
            for k in (
                "guards",
                "guard_read_lag",
                "guard_threshold",
                "guard_quiet_steps",
                "replay_every_n_steps",
                "partner_replay",
                "replay_scope",
                "reconcile_every_n_steps",
                "param_norm_every_n_steps",
                "ddp_fingerprint",
            )
        },
        "window_steps": w,
        "trial_steps": 2 * w,
        "faulty_bound_steps": faulty_bound(cfg),
        "cells": cells,
        "kinds": _kinds(cells),
        "clean_run_events": per_rank[0]["events"],
        "overhead": {**_overhead(per_rank), "tokens_per_step": 4 * _model_kwargs()["seq_len"]},
        "overhead_own_cores": {**_overhead(own), "tokens_per_step": 4 * _model_kwargs()["seq_len"]},
        "overhead_large_batch": {
            **_overhead(large),
            "batch": args.overhead_batch,
            "tokens_per_step": args.overhead_batch * _model_kwargs()["seq_len"],
        },
        "ranks_cpu_s": sum(r["cpu_s"] for r in [*per_rank, *own, *large]),
        "wall_s": pc() - t0,
    }


_OVERHEADS = (
    ("overhead_own_cores", f"{OWN_CORES} ranks, one per core"),
    ("overhead", f"{WORLD} ranks on 2 cores"),
    ("overhead_large_batch", f"{OWN_CORES} ranks, one per core"),
)


def _where(key: str, o: dict[str, Any]) -> str:
    """Which overhead launch, and its tokens a step per rank where the result says."""
    tokens = o.get("tokens_per_step")
    return dict(_OVERHEADS)[key] + (f", {tokens} tokens a step per rank" if tokens else "")


def _pair_interval(o: dict[str, Any]) -> str:
    """The 95% interval of the mean over neighbouring window pairs (how precisely the run pins the overhead)."""
    lo_hi = o.get("per_pair_interval95")
    if not lo_hi:
        return ""
    return (f" (per pair of neighbouring windows {fmt_pct(o['per_pair_mean'])}, 95% interval {fmt_pct(lo_hi[0])} "
            f"to {fmt_pct(lo_hi[1])} over {len(o['per_pair'])} pairs)")  # fmt: skip


def _overhead(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
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
        model = TinyGPT(**_model_kwargs())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with tempfile.TemporaryDirectory() as tmp:
            tier = LocalTier(Path(tmp), every_n_steps=1, keep=20)
            FaultPlan().fail_at(None, stale_at, "tier.local.write", "stale").instrument(tier)
            manager = CheckpointManager([tier], CheckpointConfig())
            manager.setup()
            try:
                for s in range(1, stale_at + 1):
                    batch = torch.randint(64, (2, 17))
                    _loss(model, batch).backward()
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


def render_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"## {TITLE}",
        "",
        f"*Command:* `{result['command']}` · *Date:* {result['date']} · {WORLD} CPU ranks (gloo), tiny GPT, "
        f"{result['config']['trials']} trials per cell"
        + (" · **quick (smoke) run: shortened cadences, not a figure**" if result["config"]["quick"] else ""),
        "",
        "Each preset's monitor exactly as `configs/resilience/sdc/` builds it, driven by the suite's step driver; a "
        "fault lands at a random step of a cadence period after the guards are warm. *caught*: a verdict naming the "
        "faulty rank; *flagged*: detected, no rank (or another) named; *coverage* = caught / (trials - no effect), "
        "with its 95% Wilson interval; *localization* = caught / detected; *latency* in optimizer steps from the "
        "faulty step to the first detection.",
        "",
    ]
    for name, p in result["presets"].items():
        c = p["config"]
        kind_rows = [[k, v["trials"], v["caught"], v["flagged"], v["missed"], v["no_effect"],
                      _pct_ci(v["coverage"], v["coverage_ci95"]), fmt_pct(v["localization"]),
                      _latency(v), _by(v["caught_by"])] for k, v in p["kinds"].items()]  # fmt: skip
        cell_rows = [[k, v["trials"], v["caught"], v["flagged"], v["missed"], v["no_effect"],
                      _pct_ci(v["coverage"], v["coverage_ci95"]), _latency(v), _by(v["caught_by"])]
                     for k, v in p["cells"].items()]  # fmt: skip
        lines += [
            f"### Preset `{name}`: guards (read lag {c['guard_read_lag']}), replay every "
            f"{c['replay_every_n_steps'] or 'never'} ({c['replay_scope']}), reconciliation every "
            f"{c['reconcile_every_n_steps']}, "
            f"communication hook {'on' if c['ddp_fingerprint'] else 'off'}",
            "",
            md_table(KIND_HEADER, kind_rows),
            "",
            *(
                f"Step-time overhead against the true plain arm, {_where(key, p[key])} "
                f"({p[key]['steps_each']} steps each, "
                f"interleaved windows of {p[key].get('window_steps', p['window_steps'])}): mean "
                f"{fmt_pct(p[key]['slowdown_mean'])}{_pair_interval(p[key])}, median "
                f"{fmt_pct(p[key]['slowdown_median'])}, p99 {fmt_pct(p[key]['slowdown_p99'])}.{_floor(p[key])}"
                f"{_parts(p[key])}\n"
                for key, _ in _OVERHEADS
                if key in p
            ),
            f"A device that corrupts every step is met by a scheduled replay within {p.get('faulty_bound_steps')} "
            "steps (the stated bound: each faulty-device trial runs that long after its onset).",
            "",
            "<details><summary>Per cell</summary>",
            "",
            md_table(CELL_HEADER, cell_rows),
            "",
            "</details>",
            "",
        ]
    stale = result.get("stale_saves")
    if stale:
        lines += [
            f"Stale saves (a tier commits the previous step's tensors under a new name, {stale['trials']} trials): "
            f"refused at the restore {stale['refused']}, the step before it restored {stale['restored_step_before']}"
            f" (coverage {_pct_ci(stale['coverage'], stale['coverage_ci95'])}).",
            "",
        ]
    lines += [
        md_table(
            ["target", "value", "goal", "verdict"],
            [[t["name"], _num(t["value"]), f"{t['op']} {t['threshold']:g}", t["verdict"]] for t in result["targets"]],
        ),
        "",
        *(f"* {n}" for n in result["notes"]),
    ]
    return "\n".join(lines)


def _floor(o: dict[str, Any]) -> str:
    """The arm of the bare checks, in the same interleaved run (results from before it was measured have none)."""
    if "floor_slowdown_mean" not in o:
        return ""
    return (
        f" The physical floor (a third arm in the same windows: the same local arithmetic at the same cadences, the "
        f"gradient and parameter norms, the state's digest and a replay's forward and backward, with no bookkeeping, "
        f"agreement or collective) costs {fmt_pct(o['floor_slowdown_mean'])}; the monitored arm is "
        f"{fmt_pct(o['beyond_floor_mean'])} above it."
    )


def _parts(o: dict[str, Any]) -> str:
    """Where the monitored arm's time goes (rank 0), from the monitor's and the driver's own counters."""
    parts, rounds = o.get("parts_ms_per_step"), o.get("rounds")
    if not parts or not rounds:
        return ""
    plain_ms = o["plain_step_mean_s"] * 1e3
    each = "; ".join(f"{k} {v:.3f} ({fmt_pct(v / plain_ms)})" for k, v in parts.items())
    phases = o.get("driver_phases_ms_per_step") or []
    issue = ", ".join(f"{r.get('begin', 0.0):.2f}" for r in phases)
    fired = ", ".join(f"{k} {v}" for k, v in sorted((rounds.get("guards_fired") or {}).items())) or "none"
    return (
        f" Where the monitored arm's time goes (rank 0, ms per step, share of the plain step's {plain_ms:.1f} ms): "
        f"{each} ({rounds['replay']} replay and {rounds['reconcile']} reconciliation rounds in "
        f"{rounds['steps']} steps; guards that fired on these clean steps: {fired}). The driver's issue phase "
        f"(its contributors' values and the hand-off of the round to the agreement thread), ms per step by rank: "
        f"{issue}."
    )


def _pct_ci(value: float | None, ci: Sequence[float] | None) -> str:
    return fmt_pct(value) + (f" ({fmt_pct(ci[0])} to {fmt_pct(ci[1])})" if ci else "")


def _latency(cell: dict[str, Any]) -> str:
    return f"{_num(cell['latency_steps_mean'])} / {_num(cell['latency_steps_max'])}"


def _by(caught_by: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(caught_by.items())) or "-"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def readme_summary(result: dict[str, Any]) -> str:
    parts = []
    for name, p in result["presets"].items():
        kinds, o = p["kinds"], p["overhead"]
        got = ", ".join(f"{k.replace('_', ' ')} {fmt_pct(v['coverage'])}" for k, v in kinds.items())
        own = p.get("overhead_own_cores")
        cost = f"{fmt_pct(o['slowdown_mean'])} mean step time ({WORLD} ranks on 2 cores)"
        large = p.get("overhead_large_batch")
        if own:
            cost = (f"{fmt_pct(own['slowdown_mean'])} mean step time with one rank per core ("
                    + (f"{fmt_pct(large['slowdown_mean'])} with {large['tokens_per_step']} tokens a step per rank "
                       f"instead of {own.get('tokens_per_step', 256)}; " if large else "")
                    + f"{fmt_pct(o['slowdown_mean'])} with {WORLD} ranks on 2 cores)")  # fmt: skip
            if "floor_slowdown_mean" in own:
                cost += f", against a floor of {fmt_pct(own['floor_slowdown_mean'])} for the bare checks"
        parts.append(f"`resilience={name}` names the rank for {got} at {cost}")
    return "**SDC** (faults by kind on 3 DDP ranks, at the presets' cadence): " + "; ".join(parts) + "."


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", action="append", choices=list(PRESETS), default=None, help="preset(s) to measure")
    p.add_argument("--trials", type=int, default=None, help="trials per cell (20; quick: 1)")
    p.add_argument("--overhead-rounds", type=int, default=None, help="window pairs for the overhead (160; quick: 4)")
    p.add_argument("--overhead-window", type=int, default=None, help="steps per overhead window (10; quick: 5)")
    p.add_argument("--overhead-batch", type=int, default=OVERHEAD_BATCH,
                   help=f"batch of the third overhead launch ({OVERHEAD_BATCH}; the trials' is 4)")  # fmt: skip
    p.add_argument("--locations", nargs="+", choices=list(_LOCATION_KIND), default=list(_LOCATION_KIND),
                   help="where bits flip")  # fmt: skip
    p.add_argument("--faulty", nargs="*", choices=list(FAULTY), default=list(FAULTY), help="faulty-device kinds")
    p.add_argument("--stale-trials", type=int, default=None, help="stale-save trials (20; quick: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmpdir", default=None, help="where the ranks leave their results")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--quick", action="store_true", help="smoke mode: cadences shortened to 5 steps, few trials")
    add_load_argument(p)
    args = p.parse_args(argv)
    q = args.quick
    args.preset = args.preset or list(PRESETS)
    args.trials = args.trials if args.trials is not None else (1 if q else 20)
    args.overhead_rounds = args.overhead_rounds or (4 if q else 160)
    args.overhead_window = args.overhead_window or (5 if q else 10)
    args.stale_trials = args.stale_trials if args.stale_trials is not None else (2 if q else 20)
    args.scale = 5 if q else None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(1)
    t0 = pc()
    machine = machine_info()
    check_load_at_start(machine, allow=args.allow_loaded, quick=args.quick, name=MODULE)
    since = cpu_counters()  # its 3 ranks load the machine themselves: the end is judged by others' CPU time
    presets = {name: measure(name, args) for name in args.preset}
    stale = stale_saves(args.stale_trials, args.seed) if args.stale_trials else None
    targets = []
    if "default" in presets:
        d = presets["default"]["kinds"]
        for kind in ("persistent", "faulty_device"):
            if kind in d:
                targets.append(target(f"default preset: {kind.replace('_', ' ')} faults caught and named",
                                      d[kind]["coverage"], ">=", 0.99, unit="fraction"))  # fmt: skip
        bound = presets["default"]["faulty_bound_steps"]
        if "faulty_device" in d and bound is not None and d["faulty_device"]["latency_steps_max"] is not None:
            targets.append(target("default preset: faulty device (every step) detected within the stated bound",
                                  d["faulty_device"]["latency_steps_max"], "<=", bound, unit="steps"))  # fmt: skip
        for key, _ in _OVERHEADS:
            o = presets["default"][key]
            targets.append(target(f"default preset: step-time overhead (mean), {_where(key, o)}", o["slowdown_mean"],
                                  "<=", 0.02, unit="fraction"))  # fmt: skip
    if "full" in presets:
        for key, _ in _OVERHEADS:
            o = presets["full"][key]
            targets.append(target(f"full preset: step-time overhead (mean), {_where(key, o)}", o["slowdown_mean"],
                                  "<=", 0.05, unit="fraction"))  # fmt: skip
    if stale is not None:
        targets.append(target("stale saves refused at the restore", stale["coverage"], ">=", 0.99, unit="fraction"))
    result: dict[str, Any] = {
        "benchmark": MODULE,
        "title": TITLE,
        "command": command_line(MODULE, argv),
        "date": now_iso(),
        "machine": finish_load(machine, since, own_extra_s=sum(p["ranks_cpu_s"] for p in presets.values())),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "tmpdir")},
        "presets": presets,
        "stale_saves": stale,
        "targets": targets,
        "notes": [
            "Measured at the cadence the presets run, not with every check every step. A parameter or optimizer-state "
            "flip persists and is found at the next reconciliation, which names the rank with three replicas (two "
            "replicas are inconclusive: the state is rejected, no rank named).",
            "A transient flip (a gradient or an activation, once) is seen only by a guard, read one step late (it asks "
            "for a replay of the next step, which cannot see a fault that did not recur; a non-finite value asks for "
            "a rollback), or by a replay of that very step (the full preset's schedule): the caught-by column says "
            "which.",
            "A transient flip lands on a scheduled replay with probability 1 / replay_every_n_steps. Where that "
            "cadence is more than twice the trials' window (the default preset: a replay every 200 steps, a window "
            "of 50), the trials do not sample it: the transient figures leave out that 0.5%.",
            "A faulty device corrupts the replays on its rank too: a replay asked for by a guard, the replay of the "
            "first step after the rollback its non-finite values ask for, or a scheduled one (the default preset's "
            "rounds have every device replay once, its own batch or its neighbour's) names it by a majority of the "
            "three ranks.",
            "A flaky device (corrupting 1 step in 4) is met by the same replays, each of which sees the fault only at "
            "that rate: it is reported apart (flaky_device), without a goal.",
            "CPU timings of a small model: on a GPU the guards and digests are device work that the step does not "
            "wait for, and a replay costs the same fraction of a step as here.",
            f"The overhead is measured three times, each against its own plain arm: on the {WORLD} ranks of the "
            f"trials ({WORLD} processes and their agreement threads on 2 cores: a rank whose thread is woken can lose "
            f"its core for a scheduler slice, which the driver's issue phase shows), and on {OWN_CORES} ranks, one "
            "per core, as a job runs one rank per device, with the trials' batches (256 tokens a step per rank) and "
            f"with batches of {args.overhead_batch} sequences. The guards, the reconciliation and the driver cost "
            "about the same time a step at any batch (their work follows the parameters, not the tokens), and a "
            "replay costs the same fraction of a step: with more tokens a step, as a real job has (thousands a rank), "
            "the fixed part is a smaller share. All three are held to the goal.",
        ],
        "wall_s": pc() - t0,
    }
    out = write_json(args.out, result)
    print_flush(render_markdown(result))
    print_flush(f"\nwrote {out} in {pc() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
