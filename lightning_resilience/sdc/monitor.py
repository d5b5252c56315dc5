"""SDCMonitor: the per-step driver of SDC verification. Framework-free: a training loop (or a Lightning callback)
tells it where a step begins, what the loss was, and when the optimizer is about to step and has stepped.

Per step: guards (always on, local, cheap) -> one collective flag. At the replay cadence, or at once when a guard
fired on any rank: a replay round (self replay, partner replay of a neighbour's batch, more opinions until a vote
decides) compares local pre-all-reduce gradients. A corrupt gradient caught this way is recomputed before the
optimizer step. After the step, at its own cadence: cross-replica reconciliation of parameter and optimizer-state
digests. A corruption that cannot be fixed in place marks the run dirty and asks for a rollback to the newest step
verified clean. Every decision is computed by every rank from the same gathered data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.fingerprint import group_rows, make_digest
from lightning_resilience.sdc.guards import GuardReport, Guards, grad_norm, param_norm
from lightning_resilience.sdc.localize import Ballot, Opinion, next_device, vote
from lightning_resilience.sdc.reconcile import ReplicaReconciler
from lightning_resilience.sdc.replay import (
    BucketFingerprintHook,
    GradientReplayer,
    RngState,
    capture_rng,
    map_tensors,
    rng_as,
)
from lightning_resilience.sdc.verdict import SDCEvent, Verdict

__all__ = ["SDCMonitor", "SDCStats", "StepOutcome"]

log = logging.getLogger(__name__)


@dataclass
class SDCStats:
    """What verification did and what it cost (seconds are wall time on this rank)."""

    steps: int = 0
    guard_seconds: float = 0.0
    guard_fired: dict[str, int] = field(default_factory=dict)
    replay_rounds: int = 0
    replays: int = 0
    replay_seconds: float = 0.0
    fingerprint_seconds: float = 0.0
    """Spent in the DDP communication hook digesting buckets."""
    reconcile_rounds: int = 0
    reconcile_seconds: float = 0.0
    detections: dict[str, int] = field(default_factory=dict)
    recomputed: int = 0
    rollbacks: int = 0


@dataclass
class StepOutcome:
    """What the checks of one step concluded."""

    step: int
    events: list[SDCEvent] = field(default_factory=list)
    checked: bool = False
    """At least one check (replay or reconciliation) ran."""
    needs_rollback: bool = False
    suspects: list[int] = field(default_factory=list)


class SDCMonitor:
    """Guards, dual-run replay and cross-replica reconciliation for one rank.

    Args:
        named_params: ``(name, parameter)`` pairs of the (unwrapped) model; only those requiring grad are replayed.
        optimizers: replicated optimizers whose state is reconciled.
        config: what to check and how often.
        clock: monotonic seconds, injectable for tests.

    Call order per step: :meth:`begin_step`, :meth:`observe_loss` (after forward), :meth:`before_optimizer_step`
    (after backward), :meth:`after_optimizer_step`. :meth:`setup` and :meth:`attach` once before the first step.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        optimizers: Sequence[torch.optim.Optimizer] = (),
        config: SDCConfig | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config or SDCConfig()
        self.named_params = [(n, p) for n, p in named_params if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self.optimizers = list(optimizers)
        self.digest = make_digest(self.config.compare, self.config.rtol, self.config.atol)
        self.guards = Guards(self.config.guard_window, self.config.guard_min_history, self.config.guard_threshold)
        self.reconciler = ReplicaReconciler(self.named_params, self.optimizers, self.digest)
        self.stats = SDCStats()
        self.events: list[SDCEvent] = []
        self.verified_steps: set[int] = {0}
        """Steps (optimizer steps done) whose state was checked and found clean; 0 is the initial state."""
        self.suspects: dict[int, str] = {}
        """Suspect rank -> verdict that named it."""
        self.dirty = False
        """An unfixed corruption was confirmed: no later step is verified until a rollback."""
        self.rank, self.world_size = 0, 1
        self.hosts: list[str] = [socket.gethostname()]
        self._clock = clock
        self._group: Any = None
        self._hook: BucketFingerprintHook | None = None
        self._replayer: GradientReplayer | None = None
        self._synced_loss_fn: Callable[[Any], torch.Tensor] | None = None
        self._to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self._step = 0
        self._batch: Any = None
        self._rng: RngState | None = None
        self._loss: torch.Tensor | None = None
        self._guard_report: GuardReport | None = None
        self._force_reconcile = False
        self._step_checked = False
        self._step_ok = True

    # ------------------------------------------------------------------ setup
    def setup(self, group: Any = None) -> None:
        """Find rank and world size; with several ranks create the side gloo group. Collective: all ranks call it."""
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
            if self.world_size > 1:
                ranks = dist.get_process_group_ranks(group) if group is not None else None
                self._group = dist.new_group(ranks=ranks, backend="gloo", timeout=self.config.timeout)
                self.hosts = self._gather(socket.gethostname())

    def attach(
        self,
        loss_fn: Callable[[Any], torch.Tensor],
        *,
        ddp: torch.nn.parallel.DistributedDataParallel | None = None,
        synced_loss_fn: Callable[[Any], torch.Tensor] | None = None,
        to_device: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Say how to recompute a step.

        Args:
            loss_fn: the step's forward on the unwrapped model, ``loss_fn(batch) -> loss``; replays call it without
                gradient synchronisation.
            ddp: the DDP-wrapped model: its buckets get a fingerprinting communication hook (``sdc.ddp_fingerprint``)
                and replays run under its ``no_sync()``.
            synced_loss_fn: the forward through the DDP wrapper, used to recompute a corrupt step with gradient
                synchronisation (defaults to ``ddp(batch)``).
            to_device: moves a batch tensor received from another rank to this rank's device.
        """
        if self.world_size > 1 and ddp is None:
            raise ValueError("SDC replay across several ranks needs the DDP-wrapped model (attach(..., ddp=...))")
        no_sync = ddp.no_sync if ddp is not None else None
        self._replayer = GradientReplayer(self.params, loss_fn, self.digest, no_sync)
        if to_device is not None:
            self._to_device = to_device
        if ddp is not None:
            self._synced_loss_fn = synced_loss_fn or ddp
            if self.config.ddp_fingerprint:
                self._hook = BucketFingerprintHook(self.params, self.digest, process_group=ddp.process_group)
                ddp.register_comm_hook(self._hook, self._hook.comm_hook)

    # --------------------------------------------------------------- per step
    def begin_step(self, step: int, batch: Any) -> None:
        """A step starts: ``step`` optimizer steps are done; keep a reference to the batch and the RNG state."""
        self._step, self._batch, self._loss = step, batch, None
        self._rng = capture_rng()
        self._step_checked, self._step_ok = False, True
        if self._hook is not None:
            self._hook.reset()

    def observe_loss(self, loss: torch.Tensor) -> None:
        self._loss = loss.detach()

    def _due(self, every: int) -> bool:
        return every > 0 and (self._step + 1) % every == 0  # checks land on the steps a checkpoint cadence names

    def before_optimizer_step(self) -> StepOutcome:
        """Guards, and a replay round when due or when a guard fired on any rank. Collective."""
        assert self._replayer is not None, "SDCMonitor.attach() must be called before the first step"
        cfg, out = self.config, StepOutcome(self._step + 1)
        self.stats.steps += 1
        fired_anywhere = False
        if cfg.guards:
            start = self._clock()
            pn = param_norm(self.params) if self._due(cfg.param_norm_every_n_steps) else None
            loss = float(self._loss) if self._loss is not None else None
            self._guard_report = self.guards.check(self._step, loss, grad_norm(self.params), pn)
            fired = [f for f in self._guard_report.fired if f not in ("param_norm_jump", "nonfinite_param")]
            if len(fired) < len(self._guard_report.fired):
                self._force_reconcile = True
            fired_anywhere = self._any(bool(fired))
            self.stats.guard_seconds += self._clock() - start
            for name in self._guard_report.fired:
                self.stats.guard_fired[name] = self.stats.guard_fired.get(name, 0) + 1
        if self._hook is not None:
            self.stats.fingerprint_seconds = self._hook.seconds
        if self.dirty:  # condemned already: nothing to learn until the rollback
            return out
        if fired_anywhere or self._due(cfg.replay_every_n_steps):
            start = self._clock()
            self._replay_round(out, fired_anywhere)
            self.stats.replay_seconds += self._clock() - start
        elif self._guard_report is not None and not self._force_reconcile:
            self.guards.accept(dataclasses.replace(self._guard_report, param_norm=None))  # folded in after the step
        return out

    def after_optimizer_step(self) -> StepOutcome:
        """Cross-replica reconciliation when due; records whether the new state is verified. Collective."""
        out = StepOutcome(self._step + 1)
        # only a parameter-norm check (at its cadence) can ask for this: no agreement on the other steps
        param_checked = self.config.guards and self._due(self.config.param_norm_every_n_steps)
        force = self._any(self._force_reconcile) if param_checked else False
        self._force_reconcile = False
        if force and self.world_size == 1:
            detail = "parameter norm jumped; one replica cannot be reconciled (a replay does not cover stored state)"
            self._record(out, SDCEvent(out.step, "guard:param_norm_jump", Verdict.ANOMALY, detail=detail))
        elif self.world_size > 1 and not self.dirty and (force or self._due(self.config.reconcile_every_n_steps)):
            start = self._clock()
            ballot, differing = self.reconciler.reconcile(self._gather_tensor)
            self.stats.reconcile_rounds += 1
            self._step_checked = True
            if ballot.dissent or not ballot.decided:
                self._diverged(out, ballot, differing)
            self.stats.reconcile_seconds += self._clock() - start
        if self._guard_report is not None and self._step_ok and self._guard_report.param_norm is not None:
            self.guards.accept(GuardReport(self._step, param_norm=self._guard_report.param_norm))
        if self._step_checked and self._step_ok and not self.dirty:
            self.verified_steps.add(out.step)
        out.checked = self._step_checked
        return out

    # ----------------------------------------------------------------- replay
    def _originals(self) -> tuple[torch.Tensor | None, list[list[int]]]:
        assert self._replayer is not None
        groups = [[i] for i in range(len(self.params))]
        if self._hook is not None and self._hook.digests:
            return self._hook.collected(), groups
        groups = [[i] for i in range(len(self.params))]
        if self.world_size > 1:  # the gradients on the parameters are averaged already: nothing local to compare
            return None, groups
        return self._replayer.local_digests(), groups

    def _replay_round(self, out: StepOutcome, guard_fired: bool) -> None:
        assert self._replayer is not None and self._rng is not None
        cfg, world, rank = self.config, self.world_size, self.rank
        self.stats.replay_rounds += 1
        self._step_checked = True
        original, groups = self._originals()
        partner = world > 1 and cfg.partner_replay
        cpu_batch = map_tensors(self._batch, lambda t: t.detach().cpu())
        inputs: list[Any] = self._gather((cpu_batch, self._rng)) if partner else [None] * world
        inputs[rank] = (self._batch, self._rng)
        originals = self._gather(original)
        opinions: dict[int, list[Opinion]] = {b: [] for b in range(world)}
        raw: dict[int, list[torch.Tensor | None]] = {b: [] for b in range(world)}  # per-parameter digests
        for b, o in enumerate(originals):
            if o is not None:
                opinions[b].append(Opinion(b, "original", o))
                raw[b].append(None)
        own_grads: list[tuple[torch.Tensor, list[torch.Tensor | None]]] = []
        plan = {b: [b] + ([(b + 1) % world] if partner else []) for b in range(world)}
        ballots: dict[int, Ballot] = {}
        while plan:
            mine: dict[int, torch.Tensor] = {}
            for b, devices in plan.items():
                if rank not in devices:
                    continue
                batch, rng = inputs[b]
                if b != rank:
                    batch = map_tensors(batch, self._to_device)
                digests, grads = self._replayer.replay(batch, rng)
                self.stats.replays += 1
                mine[b] = digests
                if b == rank:
                    own_grads.append((group_rows(self.digest, digests, groups), grads))
            for device, results in enumerate(self._gather(mine)):
                for b, digests in results.items():
                    raw[b].append(digests)
                    opinions[b].append(Opinion(device, "replay", group_rows(self.digest, digests, groups)))
            plan = {}
            for b in range(world):
                ballots[b] = vote(opinions[b], self.digest.equal)
                if ballots[b].decided or len(opinions[b]) >= cfg.max_opinions:
                    continue
                plan[b] = [next_device(b, opinions[b], world, others=partner)]
        self._conclude_replay(out, guard_fired, opinions, ballots, raw, own_grads)

    def _conclude_replay(
        self,
        out: StepOutcome,
        guard_fired: bool,
        opinions: dict[int, list[Opinion]],
        ballots: dict[int, Ballot],
        raw: dict[int, list[torch.Tensor | None]],
        own_grads: list[tuple[torch.Tensor, list[torch.Tensor | None]]],
    ) -> None:
        if self.world_size > 1 and any(b.verdict is not Verdict.CLEAN for b in ballots.values()):
            # a replay on another rank proves something only if the replicas are identical: check that first
            ballot, differing = self.reconciler.reconcile(self._gather_tensor)
            self.stats.reconcile_rounds += 1
            if ballot.dissent or not ballot.decided:
                self._diverged(out, ballot, differing)
                return
        fired = self._guard_report.fired if guard_fired and self._guard_report is not None else []
        mechanism = "replay" + (f" (guard: {','.join(fired)})" if fired else "")
        corrupt_original: list[int] = []
        unfixable: list[int] = []
        for b, ballot in ballots.items():
            ops = opinions[b]
            original_bad = ballot.decided and any(ops[i].kind == "original" for i in ballot.dissent)
            if ballot.verdict is Verdict.CLEAN:
                continue
            if original_bad and b in ballot.transient:
                corrupt_original.append(b)
                action, detail = "recomputed", f"rank {b}'s gradients differ from its replay and the vote"
            elif not original_bad and ballot.decided:
                action = "none"
                detail = f"a replay of rank {b}'s batch was wrong; the step itself was right"
            else:
                unfixable.append(b)
                action = "rollback"
                detail = f"rank {b}'s batch: " + ("no majority among the replays" if not ballot.decided else
                                                  "a device reproduces a wrong result")  # fmt: skip
            self._record(out, SDCEvent(out.step, mechanism, ballot.verdict, ballot.suspects, action, detail))
        if guard_fired and not out.events:
            self._record(out, SDCEvent(out.step, mechanism, Verdict.ANOMALY, [], "none",
                                       "the replay reproduced the step: not a hardware fault"))  # fmt: skip
        if unfixable:
            self._fail(out, sorted({s for b in unfixable for s in ballots[b].suspects}))
            return
        if corrupt_original and not self._recompute(out, opinions, ballots, raw, own_grads):
            self._fail(out, corrupt_original)
            return
        if self._guard_report is not None and not corrupt_original:
            self.guards.accept(dataclasses.replace(self._guard_report, param_norm=None))  # folded in after the step

    def _recompute(
        self,
        out: StepOutcome,
        opinions: dict[int, list[Opinion]],
        ballots: dict[int, Ballot],
        raw: dict[int, list[torch.Tensor | None]],
        own_grads: list[tuple[torch.Tensor, list[torch.Tensor | None]]],
    ) -> bool:
        """Replace the corrupt gradients by correct ones; True if the result agrees with the vote everywhere."""
        assert self._replayer is not None and self._rng is not None
        if self._hook is None:  # one rank: install the replay gradients the vote agreed with
            majority = opinions[self.rank][ballots[self.rank].majority[0]].digest
            for digests, grads in own_grads:
                if self.digest.equal(digests, majority):
                    for p, g in zip(self.params, grads):
                        p.grad = g
                    self.stats.recomputed += 1
                    return True
            return False
        # DDP: every rank recomputes with synchronisation, so the all-reduce averages correct contributions
        assert self._synced_loss_fn is not None
        for p in self.params:
            p.grad = None
        self._hook.reset()
        with rng_as(self._rng), torch.enable_grad():
            self._synced_loss_fn(self._batch).backward()
        new, groups = self._hook.collected(), [[i] for i in range(len(self.params))]
        ok = True
        for b, digest in enumerate(self._gather(new)):
            agreed = [d for d in (raw[b][i] for i in ballots[b].majority) if d is not None]
            ok = ok and bool(agreed) and self.digest.equal(group_rows(self.digest, agreed[0], groups), digest)
        if ok:
            self.stats.recomputed += 1
        return ok

    # ------------------------------------------------------------- decisions
    def _record(self, out: StepOutcome, event: SDCEvent) -> None:
        out.events.append(event)
        self.events.append(event)
        if event.verdict not in (Verdict.CLEAN, Verdict.ANOMALY):
            self.stats.detections[event.verdict.value] = self.stats.detections.get(event.verdict.value, 0) + 1
            for s in event.suspects:
                self.suspects[s] = event.verdict.value
            log.warning("SDC at step %d: %s by %s, suspects %s (%s): %s", event.step, event.verdict.value,
                        event.mechanism, event.suspects, event.action, event.detail)  # fmt: skip
        out.suspects = sorted({*out.suspects, *event.suspects})

    def _diverged(self, out: StepOutcome, ballot: Ballot, differing: list[str]) -> None:
        detail = f"replicas differ in {differing[:4]}"
        if not ballot.decided:
            detail += "; two opinions and no majority: every replica is suspect"
        self._record(out, SDCEvent(out.step, "reconcile", Verdict.DIVERGED, ballot.suspects, "rollback", detail))
        self._fail(out, ballot.suspects)

    def _fail(self, out: StepOutcome, suspects: list[int]) -> None:
        out.needs_rollback = True
        out.suspects = sorted({*out.suspects, *suspects})
        self._step_ok = False
        self.dirty = True

    def rollback_target(self, committed: Iterable[int]) -> int | None:
        """Collective: the newest step that every rank has committed and verified clean (None: none)."""
        local = sorted(s for s in set(committed) if s in self.verified_steps)
        common = set.intersection(*(set(g) for g in self._gather(local)))
        self.stats.rollbacks += 1
        return max(common) if common else None

    def meta(self, step: int) -> dict[str, Any]:
        """Checkpoint metadata for ``step``: whether its state was verified clean."""
        return {"sdc_verified": step in self.verified_steps and not (self.dirty and step > max(self.verified_steps))}

    # ------------------------------------------------------------ collectives
    def _gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _gather_tensor(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [t for t in self._gather(tensor)]

    def _any(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return bool(t.item())

    # ------------------------------------------------------------------ state
    def reset(self, step: int = 0) -> None:
        """Forget verdicts and verified steps after a rollback to ``step`` done in place (drills, benchmarks); the
        guard baselines are kept. Collective only in that every rank must call it."""
        self.events, self.suspects, self.dirty = [], {}, False
        self.verified_steps = {step}
        self._force_reconcile = False

    def state_dict(self) -> dict[str, Any]:
        return {"verified_steps": sorted(self.verified_steps)[-64:], "events": [e.to_json() for e in self.events]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.verified_steps |= {int(s) for s in state.get("verified_steps", [])}

    def close(self) -> None:
        """Release the side group's reference (the group itself is destroyed with the default group)."""
        self._group = None
        with contextlib.suppress(Exception):
            if self._hook is not None:
                self._hook.enabled = False
