"""SDCMonitor: the per-step driver of SDC verification. Framework-free: a training loop (or a Lightning callback)
tells it where a step begins, what the loss was, and when the optimizer is about to step and has stepped.

Per step: guards (local, cheap, read late) -> a few flags in the step's one agreement (:meth:`SDCMonitor.contribute`
/ :meth:`SDCMonitor.agreed`; a loop without a step driver agrees at :meth:`SDCMonitor.begin_step`). At the replay
cadence, or when a guard fired on any rank: a replay round compares local pre-all-reduce gradients (a corrupt one is
recomputed before the optimizer step). After the step, at its own cadence: cross-replica reconciliation of state
digests. A corruption that cannot be fixed in place asks for a rollback to the newest step verified clean. Every
decision is computed by every rank from the same gathered data; no device value is read on an ordinary step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lightning_resilience.collective import SideGroup
from lightning_resilience.policy import Event, Verdict
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.fingerprint import Digest, make_digest
from lightning_resilience.sdc.guards import GuardReader, GuardReport, Guards, grad_norm, param_norm
from lightning_resilience.sdc.late_guards import LateGuards, count_fired
from lightning_resilience.sdc.localize import Ballot
from lightning_resilience.sdc.reconcile import ReplicaReconciler
from lightning_resilience.sdc.replay import BucketFingerprintHook, GradientReplayer, RngState, capture_rng
from lightning_resilience.sdc.rounds import ReplayRound, RoundStep
from lightning_resilience.sdc.stats import SDCStats
from lightning_resilience.sdc.verdict import Diagnosis, SDCEvent, StepOutcome, VerifiedSteps
from lightning_resilience.step.driver import Field

__all__ = ["SDCMonitor", "SDCStats", "StepOutcome"]

log = logging.getLogger(__name__)


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
        self.digest: Digest = make_digest(self.config.compare, self.config.rtol, self.config.atol)
        self.guards = Guards(
            self.config.guard_window, self.config.guard_min_history, self.config.guard_threshold,
            self.config.guard_quiet_steps,
        )  # fmt: skip
        self.reader = GuardReader(self.guards, self.config.guard_read_lag)
        self.reconciler = ReplicaReconciler(self.named_params, self.optimizers, self.digest)
        self.stats = SDCStats()
        self.events: list[SDCEvent] = []
        self.verified_steps = VerifiedSteps()
        """Steps (optimizer steps done) whose state was checked and found clean; 0 is the initial state."""
        self.suspects: dict[int, str] = {}
        """Suspect rank -> verdict that named it."""
        self.dirty = False
        """An unfixed corruption was confirmed: no later step is verified until a rollback."""
        self.rank, self.world_size = 0, 1
        self.hosts: list[str] = [socket.gethostname()]
        self._clock = clock
        self._group = SideGroup("sdc", self.config.timeout, local=True)
        """The side group of every agreement (:mod:`lightning_resilience.collective`); a local one until setup."""
        self._hook: BucketFingerprintHook | None = None
        self._replayer: GradientReplayer | None = None
        self._grad_stride = 1  # ranks taking turns at the gradient-norm guard (set by attach)
        self._synced_loss_fn: Callable[[Any], torch.Tensor] | None = None
        self._to_device: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self._step = 0
        self._batch: Any = None
        self._rng: RngState | None = None
        self._loss: torch.Tensor | None = None
        self._guard_report: GuardReport | None = None
        self._fired: list[GuardReport] = []
        """Guard reports (this rank's) that triggered this step's replay round."""
        self._guard_triggered = False
        self._restore_check = False
        """The state was just restored (a rollback, a resume): the next step is replayed (``replay_after_restore``)."""
        self._restore_pending = False
        self._scheduled_rounds = 0
        """Scheduled replay rounds so far (whose batch a rotating round checks)."""
        self._late_triggered = self._late_job_guard = False
        """A guard fired on some rank (agreed at the last step's end): the next step is replayed (by every device
        when a guard that is not a rank's own fired, else the batches of the ranks whose guards fired)."""
        self._job_guard = False
        """This step's replay was asked for by a guard that is not one rank's own (every device replays once)."""
        self.late = LateGuards(self.guards, self.reader, self.stats.guard_fired)
        self._next_fired: list[GuardReport] = []
        """Those of the last agreed round: the next step's replay names them."""
        self._committed: Callable[[], Iterable[int]] | None = None
        self.driven = False
        """A step driver carries the late guards in each step's agreement (:meth:`contribute`)."""
        self._unagreed: list[Verdict] = []
        self.late_nonfinite_step: int | None = None
        """The earliest step (agreed by every rank) whose loss or gradients a late guard found non-finite this step:
        the state that step started from is the newest one not touched by it."""
        self.late_spike_step: int | None = None
        """The same for a loss or gradient-norm spike."""
        self._force_reconcile = False
        self._step_checked = False
        self._step_ok = True

    # ------------------------------------------------------------------ setup
    def setup(self, group: Any = None, *, side: SideGroup | None = None) -> None:
        """Find rank and world size; with several ranks create the side gloo group (or use ``side``, a view of a
        group shared with other components). Collective: all ranks call it."""
        self._group = side or SideGroup("sdc", self.config.timeout, parent=group)
        self.rank, self.world_size = self._group.rank, self._group.world_size
        if self.world_size > 1:
            self.hosts = self.gather(socket.gethostname())

    def attach(
        self,
        loss_fn: Callable[[Any], torch.Tensor],
        *,
        ddp: torch.nn.parallel.DistributedDataParallel | None = None,
        synced_loss_fn: Callable[[Any], torch.Tensor] | None = None,
        to_device: Callable[[torch.Tensor], torch.Tensor] | None = None,
        committed: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        """Say how to recompute a step, and where verified steps are kept.

        Args:
            loss_fn: the step's forward on the unwrapped model, ``loss_fn(batch) -> loss``; replays call it without
                gradient synchronisation.
            ddp: the DDP-wrapped model: its buckets get a fingerprinting communication hook (``sdc.ddp_fingerprint``)
                and replays run under its ``no_sync()``.
            synced_loss_fn: the forward through the DDP wrapper, used to recompute a corrupt step with gradient
                synchronisation (defaults to ``ddp(batch)``).
            to_device: moves a batch tensor received from another rank to this rank's device.
            committed: the committed checkpoint steps a restart could restore (the newest verified one of them goes
                in a non-finite verdict; collective like the verdict).
        """
        self._committed = committed
        # replicated gradients (DDP): the ranks take turns at the gradient-norm guard (sdc.guard_grad_norm_stride)
        self._grad_stride = min(self.world_size, self.config.guard_grad_norm_stride) if ddp is not None else 1
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
        """A step starts (``step`` optimizer steps done): keep the batch, and the RNG state if the step may be replayed.

        With a guard read lag, a guard that fired on any rank (agreed in the previous step's agreement, see
        :meth:`agreed`) makes this step's gradients replayed: no rank waits for another here."""
        self._step, self._batch, self._loss = step, batch, None
        self._step_checked, self._step_ok = False, True
        self._unagreed = []
        if not self.driven and self.step_fields():
            # a loop without a step driver: the late guards are agreed now, in one all-reduce of six integers
            self._unagreed = self.agreed(step, self.late.agree_now(self._group, step, self.late.read(step)))
        self._fired, self._next_fired = self._next_fired, []
        self._guard_triggered, self._late_triggered = self._late_triggered and not self.dirty, False
        self._job_guard, self._late_job_guard = self._late_job_guard, False
        self._restore_check, self._restore_pending = self._restore_pending and not self.dirty, False
        replay = self._guard_triggered or self._restore_check or self._due(self.config.replay_every_n_steps)
        replay = replay or (self.config.guards and self.reader.lag == 0)  # with no lag, a guard may ask at once
        self._rng = capture_rng() if replay else None  # nothing drawn since the step began: the forward comes next
        if self._hook is not None:
            self._hook.reset()
            self._hook.enabled = replay  # digest buckets only when this step's gradients may be compared

    # ------------------------------------------------------------------ the step's agreement
    def step_fields(self) -> list[Field]:
        """The late guards' part of each step's agreement (a step driver's contributor)."""
        return self.late.fields() if self.config.guards and self.reader.lag > 0 else []

    def contribute(self, step: int) -> list[int]:
        """The guard values of earlier steps that reached the host, checked here (no device read, no wait)."""
        self.driven = True
        return self.late.read(step) if self.step_fields() else []

    def agreed(self, step: int, values: Sequence[int]) -> list[Verdict]:
        """What every rank's late guards said (the same on every rank): the next step is replayed when a guard fired
        somewhere, the next reconciliation is forced by a parameter-norm jump, and a non-finite update or a spike
        becomes a verdict naming its step (the newest state not touched by it)."""
        if not values:
            return []
        found = self.late.agreed(step, values)
        self._late_triggered, self._next_fired, self._late_job_guard = found.fired, found.reports, found.job_wide
        self._force_reconcile = self._force_reconcile or found.jumped
        self.late_nonfinite_step, self.late_spike_step = found.nonfinite_step, found.spike_step
        verdicts: list[Verdict] = []
        step += 1  # decided at the end of the step the round was issued at: the state after it
        if found.nonfinite and not self.dirty and found.nonfinite_step is not None:
            steps = sorted({r.step + 1 for r in found.reports if any(f.startswith("nonfinite") for f in r.fired)})
            detail = (
                f"non-finite loss or gradients at step {steps or '(another rank)'}, read {self.reader.lag} step(s) "
                "late: the update is applied; roll back to a verified step"
            )
            self.record(StepOutcome(step), SDCEvent(step, "guard:nonfinite", Diagnosis.ANOMALY, [], "rollback", detail))
            self._step_ok, self.dirty = False, True
            verified = self.rollback_target(self._committed()) if self._committed is not None else None
            verdicts.append(Verdict(Event.NONFINITE, step, self.rank, detail, "sdc", verified, found.nonfinite_step))
        if found.spike_step is not None and not self.dirty:
            detail = f"loss or gradient-norm spike at step {found.spike_step}"
            verdicts.append(Verdict(Event.SPIKE, step, self.rank, detail, "sdc", bad_step=found.spike_step))
        return verdicts

    def _observe_guards(self, replayed: bool = False) -> GuardReport | None:
        pn = param_norm(self.params) if self._due(self.config.param_norm_every_n_steps) else None
        k = self._grad_stride
        gn = grad_norm(self.params) if self._step % k == self.rank % k else None  # this rank's turn
        self._guard_report = self.reader.observe(self._step, self._loss, gn, pn, replayed=replayed)
        return self._guard_report

    def spent_seconds(self) -> float:
        """Seconds this rank's training thread spent on every step's checks so far (what the cost budget counts)."""
        return self.stats.ordinary_seconds()

    def observe_loss(self, loss: torch.Tensor) -> None:
        self._loss = loss.detach()

    def _due(self, every: int) -> bool:
        return every > 0 and (self._step + 1) % every == 0  # checks land on the steps a checkpoint cadence names

    def before_optimizer_step(self) -> StepOutcome:
        """Guards, and a replay round when due or when a guard fired on any rank. Collective."""
        assert self._replayer is not None, "SDCMonitor.attach() must be called before the first step"
        cfg, out = self.config, StepOutcome(self._step + 1)
        self.stats.steps += 1
        if cfg.guards and self.reader.lag == 0:  # checked now: a guard that fires asks for this step's replay
            start = self._clock()
            report = self._observe_guards()
            assert report is not None
            fired = report.asks_replay()
            self._force_reconcile = self._force_reconcile or report.asks_reconciliation()
            self._fired = [report] if fired else []
            self._guard_triggered = self.any_rank(bool(fired))
            count_fired(self.stats.guard_fired, report)
            self.stats.guard_seconds += self._clock() - start
        if self._hook is not None:
            self.stats.fingerprint_seconds = self._hook.seconds
        replay = not self.dirty and (
            self._guard_triggered or self._restore_check or self._due(cfg.replay_every_n_steps)
        )
        if replay:
            start = self._clock()
            self._replay_round(out, self._guard_triggered)
            self.stats.replay_seconds += self._clock() - start
        elif self._guard_report is not None and not self._force_reconcile:
            self.guards.accept(dataclasses.replace(self._guard_report, param_norm=None))  # folded in after the step
        if cfg.guards and self.reader.lag > 0:  # staged after any recompute: the values of the applied update
            start = self._clock()
            self._observe_guards(replayed=replay and not out.needs_rollback)
            self.stats.guard_seconds += self._clock() - start
        for verdict in self._unagreed:  # without a step driver, a late non-finite update is this step's outcome
            if verdict.event is Event.NONFINITE:
                out.events.append(self.events[-1])
                self.fail(out, [])
                out.bad_step = verdict.bad_step
        return out

    def after_optimizer_step(self) -> StepOutcome:
        """Cross-replica reconciliation when due; records whether the new state is verified. Collective."""
        out = StepOutcome(self._step + 1)
        if self.reader.lag > 0:
            force = self._force_reconcile  # agreed at the start of the step
        else:  # only a parameter-norm check (at its cadence) can ask for this: no agreement on the other steps
            param_checked = self.config.guards and self._due(self.config.param_norm_every_n_steps)
            force = self.any_rank(self._force_reconcile) if param_checked else False
        self._force_reconcile = False
        if force and self.world_size == 1:
            detail = "parameter norm jumped; one replica cannot be reconciled (a replay does not cover stored state)"
            self.record(out, SDCEvent(out.step, "guard:param_norm_jump", Diagnosis.ANOMALY, detail=detail))
        elif self.world_size > 1 and not self.dirty and (force or self._due(self.config.reconcile_every_n_steps)):
            start = self._clock()
            ballot, differing = self.reconciler.reconcile(self.gather, self.all_same)
            self.stats.reconcile_rounds += 1
            self._step_checked = True
            if ballot.dissent or not ballot.decided:
                self.diverged(out, ballot, differing)
            elif force:  # the jump that asked for it was the training's own
                self.guards.reconciled(self._step)
            self.stats.reconcile_seconds += self._clock() - start
        if (
            self.reader.lag == 0
            and self._guard_report is not None
            and self._step_ok
            and self._guard_report.param_norm is not None
        ):
            self.guards.accept(GuardReport(self._step, param_norm=self._guard_report.param_norm))
        if self._step_checked and self._step_ok and not self.dirty:
            self.verified_steps.add(out.step)
        out.checked = self._step_checked
        return out

    def _replay_round(self, out: StepOutcome, guard_fired: bool) -> None:
        assert self._rng is not None
        self._step_checked = True
        scheduled = not guard_fired and not self._restore_check
        at = RoundStep(self._step, self._batch, self._rng, guard_fired, self._fired, self._guard_report,
                       self._job_guard, self._restore_check, self._scheduled_rounds)  # fmt: skip
        self._scheduled_rounds += scheduled  # the same on every rank: rounds are collective
        ReplayRound(self, at).run(out)

    # ------------------------------------------------------- what a replay round reads (RoundHost)
    @property
    def replayer(self) -> GradientReplayer:
        assert self._replayer is not None, "SDCMonitor.attach() must be called before the first step"
        return self._replayer

    @property
    def hook(self) -> BucketFingerprintHook | None:
        return self._hook

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._to_device(tensor)

    def synced_loss(self, batch: Any) -> torch.Tensor:
        assert self._synced_loss_fn is not None, "a synchronised recompute needs attach(..., ddp=...)"
        return self._synced_loss_fn(batch)

    def exchange(self, payload: bytes, send_to: list[int], recv_from: list[int]) -> list[bytes | None]:
        return self._group.exchange(payload, send_to=send_to, recv_from=recv_from, op="sdc.neighbours", step=self._step)

    # ------------------------------------------------------------- decisions
    def record(self, out: StepOutcome, event: SDCEvent) -> None:
        out.events.append(event)
        self.events.append(event)
        if event.verdict not in (Diagnosis.CLEAN, Diagnosis.ANOMALY):
            self.stats.detections[event.verdict.value] = self.stats.detections.get(event.verdict.value, 0) + 1
            for s in event.suspects:
                self.suspects[s] = event.verdict.value
            log.warning("SDC at step %d: %s by %s, suspects %s (%s): %s", event.step, event.verdict.value,
                        event.mechanism, event.suspects, event.action, event.detail)  # fmt: skip
        out.suspects = sorted({*out.suspects, *event.suspects})

    def diverged(self, out: StepOutcome, ballot: Ballot, differing: list[str]) -> None:
        detail = f"replicas differ in {differing[:4]}"
        verdict = Diagnosis.DIVERGED
        if not ballot.decided:
            verdict = Diagnosis.INCONCLUSIVE
            detail += "; no strict majority of three or more equal replicas: no rank is named"
        self.record(out, SDCEvent(out.step, "reconcile", verdict, ballot.suspects, "rollback", detail))
        self.fail(out, ballot.suspects)

    def fail(self, out: StepOutcome, suspects: list[int]) -> None:
        out.needs_rollback = True
        out.suspects = sorted({*out.suspects, *suspects})
        self._step_ok = False
        self.dirty = True

    def rollback_target(self, committed: Iterable[int]) -> int | None:
        """Collective: the newest step that every rank has committed and verified clean (None: none)."""
        local = sorted(s for s in set(committed) if s in self.verified_steps)
        common = set.intersection(*(set(g) for g in self.gather(local)))
        self.stats.rollbacks += 1
        return max(common) if common else None

    def meta(self, step: int) -> dict[str, Any]:
        """Checkpoint metadata for ``step``: its verification state (:mod:`lightning_resilience.checkpoint.certify`):
        'verified' when a clean check covered it, 'rejected' when an unfixed corruption was found since the last
        one, else 'unverified'; and the older flag ``sdc_verified``."""
        verified = step in self.verified_steps and not (self.dirty and step > self.verified_steps.newest)
        state = "verified" if verified else "rejected" if self.dirty and step > self.verified_steps.newest else None
        return {"verification": state or "unverified", "sdc_verified": verified}

    # ------------------------------------------------------------ collectives
    def gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        return self._group.all_gather_object(obj, op="sdc.gather", step=self._step, any_type=True)

    def all_same(self, key: int) -> bool:
        """Whether every rank holds ``key`` (>= 0): one all-reduce of two integers, the same at any number of ranks."""
        high, neg_low = self._group.reduce_max_each([key, -key], op="sdc.reconcile", step=self._step)
        return high == -neg_low

    def any_rank(self, flag: bool) -> bool:
        """Whether any rank raised ``flag`` (collective)."""
        return self._any_of(flag)[0]

    def _any_of(self, *flags: bool) -> tuple[bool, ...]:
        """Whether any rank raised each flag: one all-reduce of host values on the side gloo group."""
        if self.world_size == 1:
            return flags
        values = self._group.reduce_max_each([int(f) for f in flags], op="sdc.any", step=self._step)
        return tuple(bool(v) for v in values)

    # ------------------------------------------------------------------ state
    def reset(self, step: int = 0) -> None:
        """Forget verdicts and verified steps after a rollback to ``step`` done in place (drills, benchmarks); the
        guard baselines are kept. Collective only in that every rank must call it."""
        self.events, self.suspects, self.dirty = [], {}, False
        self.verified_steps = VerifiedSteps([step])
        self._force_reconcile = False
        self.reader.clear()

    def restored(self) -> None:
        """The state was restored (a resume, a rollback; every rank alike): with ``replay_after_restore`` the first
        step after it is replayed, with partner, so that a device that corrupts every step is named at once and a
        restored state that does not reproduce is found before it is built on."""
        self._restore_pending = self.config.replay_after_restore

    def rolled_back(self, step: int) -> None:
        """The state of ``step`` was restored in the running process (every rank alike): forget the later verdicts
        and verified steps and the guard values still on their way; events and baselines are kept."""
        self.restored()
        self.dirty, self._force_reconcile, self._late_triggered, self._late_job_guard = False, False, False, False
        self.late_nonfinite_step, self.late_spike_step, self._next_fired = None, None, []
        self.late.clear()
        self.verified_steps.keep_until(step)
        self.reader.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"verified_steps": self.verified_steps.newest_few(64), "events": [e.to_json() for e in self.events]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.verified_steps = VerifiedSteps([*self.verified_steps, *state.get("verified_steps", [])])

    def close(self) -> None:
        """Release the side group (its gloo group is destroyed with the default group)."""
        self._group = SideGroup("sdc", self.config.timeout, local=True)
        with contextlib.suppress(Exception):
            if self._hook is not None:
                self._hook.enabled = False
