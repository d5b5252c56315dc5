"""One rank's job in ``benchmarks.sdc_coverage``: the trials (each from the same initial state, a fault injected, the
preset's monitor driven by the suite's step driver) and the overhead's interleaved windows of three arms: the
monitored loop, a true plain replica, and the physical floor of the checks."""

from __future__ import annotations

import copy
import time
from collections import deque
from datetime import timedelta
from typing import Any

import torch

from benchmarks._sdc.trials import (
    BATCH_POOL,
    DEVICE_KINDS,
    FAULTY_WEIGHT,
    OVERHEAD_WARM_STEPS,
    PATTERNS,
    faulty_bound,
    loss_of,
    make_batches,
    model_kwargs,
    preset_config,
    window,
)

__all__ = ["Decisions", "run_rank"]

pc = time.perf_counter


class Decisions:
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


def run_rank(
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
    kw = model_kwargs()
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
    floor_model = TinyGPT(**kw)  # the floor's replica, stepping as the plain arm does
    floor_model.load_state_dict(init)
    floor_model.train()
    floor_opt = torch.optim.AdamW(floor_model.parameters(), lr=1e-2)
    stride = min(torch.distributed.get_world_size(), cfg.guard_grad_norm_stride)  # replicated gradients: turns
    floor = Floor(cfg, floor_model, floor_opt, forward=DistributedDataParallel(floor_model), rank=rank, stride=stride)
    batches = make_batches(kw, rank, max(2 * w, BATCH_POOL), batch_size)
    monitor = SDCMonitor(list(model.named_parameters()), [], cfg)
    # the suite's groups: the monitor's reductions (a reconciliation's hash, a replay round's flags) ride the step
    # agreement's tree, as in a job
    channels = Channels([cfg.timeout], timedelta(seconds=300))
    monitor.setup(side=channels.side("sdc", cfg.timeout))
    monitor.attach(lambda b: loss_of(model, b), ddp=ddp, synced_loss_fn=lambda b: loss_of(ddp, b))
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

    def new_driver() -> tuple[StepDriver, Decisions]:
        driver = StepDriver(PolicyConfig(), agreement)
        driver.add_contributor(monitor)
        monitor.driven = True
        return driver, Decisions(restore)

    state["driver"], state["actor"] = new_driver()

    def step(i: int) -> float:
        batch = batches[i % len(batches)]
        driver, actor = state["driver"], state["actor"]
        t0 = pc()
        driver.begin_step(i)
        monitor.begin_step(i, batch)
        loss = loss_of(ddp, batch)
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
        loss = loss_of(plain_ddp, batch)
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


class Floor:
    """The physical floor of a preset's checks: a replica of its own stepping as the plain arm does, plus the same
    local arithmetic at the preset's cadences (this rank's turn at the gradient norm, the parameter norm, the digest of
    the parameters and the optimizer state, and a replay's forward, backward and gradient digest, one a round), with
    none of the monitor's bookkeeping, no agreement and no collective.

    Args:
        model: the replica; ``forward`` is what its step's forward runs through (a DDP wrapper of it; default: it).
        rank, stride: this rank takes the gradient norm on one step in ``stride`` (the ranks take turns).
        sched: stepped after the optimizer, where the plain arm has one.
        reconcile: the state's digest at the reconciliation cadence (False: timed apart by the caller, on
            :attr:`state`).
    """

    def __init__(
        self,
        cfg: Any,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        *,
        forward: torch.nn.Module | None = None,
        rank: int = 0,
        stride: int = 1,
        sched: Any = None,
        reconcile: bool = True,
    ) -> None:
        from lightning_resilience.sdc.fingerprint import BitwiseDigest
        from lightning_resilience.sdc.reconcile import ReplicaReconciler

        self.cfg, self.rank, self.stride, self.reconcile = cfg, rank, stride, reconcile
        self.model, self.forward, self.opt, self.sched = model, forward or model, opt, sched
        self.params = list(model.parameters())
        self.digest = BitwiseDigest()
        self.state = ReplicaReconciler(list(model.named_parameters()), [opt], self.digest)

    def step(self, i: int, batch: torch.Tensor) -> float:
        from lightning_resilience.sdc.fingerprint import digest_all
        from lightning_resilience.sdc.guards import grad_norm, param_norm

        cfg = self.cfg

        def due(every: int) -> bool:
            return every > 0 and (i + 1) % every == 0

        t0 = pc()
        if due(cfg.replay_every_n_steps):  # the recompute of a replay: this rank's batch again, its gradients digested
            loss_of(self.model, batch).backward()
            digest_all(self.digest, [p.grad for p in self.params if p.grad is not None])
            self.opt.zero_grad(set_to_none=True)
        loss_of(self.forward, batch).backward()
        if cfg.guards and due(cfg.param_norm_every_n_steps):
            param_norm(self.params)
        if cfg.guards and i % self.stride == self.rank % self.stride:
            grad_norm(self.params)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.sched is not None:
            self.sched.step()
        if self.reconcile and due(cfg.reconcile_every_n_steps):
            self.state.local()
        return pc() - t0
