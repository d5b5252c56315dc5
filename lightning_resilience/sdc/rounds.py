"""Replay rounds of :class:`~lightning_resilience.sdc.monitor.SDCMonitor`: hand each checked batch and RNG state to
its partner, replay (self and partner), vote per batch, conclude, and recompute a corrupt gradient in place. Where
the ranks have no original digests (no communication hook) a round's pairs vote with their neighbours and one
all-reduce ends a clean round; a disagreement, or original digests, take every rank into one vote by gathers.

The seam with the monitor is two objects: :class:`RoundStep`, the step a round checks and why (handed over at the
round's start, never written back), and :class:`RoundHost`, what a round reads of the rank (its replicas, the
replayer, the fingerprint hook, the guards) and the agreements and records it goes through.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_resilience.sdc.config import ReplayScope
from lightning_resilience.sdc.fingerprint import group_rows
from lightning_resilience.sdc.localize import Ballot, Opinion, next_device, vote
from lightning_resilience.sdc.replay import map_tensors, rng_as
from lightning_resilience.sdc.verdict import Diagnosis, SDCEvent, StepOutcome

if TYPE_CHECKING:
    from lightning_resilience.sdc.config import SDCConfig
    from lightning_resilience.sdc.fingerprint import Digest
    from lightning_resilience.sdc.guards import GuardReader, GuardReport, Guards
    from lightning_resilience.sdc.reconcile import ReplicaReconciler
    from lightning_resilience.sdc.replay import BucketFingerprintHook, GradientReplayer, RngState
    from lightning_resilience.sdc.stats import SDCStats

__all__ = ["ReplayRound", "RoundHost", "RoundStep"]

_INCONCLUSIVE = "inconclusive: no majority of three devices, no replay that reproduces a reference; no rank named"
_REPRODUCES = "a device reproduces a wrong result (what it contributed to the step is suspect)"


@dataclass(frozen=True)
class RoundStep:
    """The step a replay round checks, and why: the same fields on every rank except the batch, its RNG state and
    this rank's own guard reports."""

    step: int
    """Optimizer steps done when the step began."""
    batch: Any
    rng: RngState
    guard_fired: bool
    """A guard (on some rank) asked for the round."""
    fired: Sequence[GuardReport] = ()
    """This rank's guard reports that asked for it (empty: its guards did not fire)."""
    guard_report: GuardReport | None = None
    """This rank's guard values of the step (accepted into the baselines when the round finds them genuine)."""
    job_guard: bool = False
    """A guard that is not one rank's own fired (every device replays: see :meth:`ReplayRound._checked`)."""
    restore_check: bool = False
    """The first step after a restore."""
    rotation: int = 0
    """Scheduled rounds before this one: whose batch a rotating round checks."""


class RoundHost(Protocol):
    """What a replay round needs of its rank (an :class:`~lightning_resilience.sdc.monitor.SDCMonitor`)."""

    config: SDCConfig
    rank: int
    world_size: int
    params: list[torch.nn.Parameter]
    digest: Digest
    stats: SDCStats
    guards: Guards
    reader: GuardReader
    reconciler: ReplicaReconciler

    @property
    def replayer(self) -> GradientReplayer:
        """Replays a batch without gradient synchronisation."""
        ...

    @property
    def hook(self) -> BucketFingerprintHook | None:
        """The fingerprinting communication hook (original digests of the buckets), if any."""
        ...

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def synced_loss(self, batch: Any) -> torch.Tensor:
        """The step's forward through the data-parallel wrapper (a recompute synchronises its gradients)."""
        ...

    def any_rank(self, flag: bool) -> bool:
        """Collective: whether any rank raised ``flag``."""
        ...

    def gather(self, obj: Any) -> list[Any]:
        """Collective: every rank's ``obj``, in rank order."""
        ...

    def all_same(self, key: int) -> bool:
        """Collective: whether every rank holds ``key``."""
        ...

    def exchange(self, payload: bytes, send_to: list[int], recv_from: list[int]) -> list[bytes | None]:
        """Send ``payload`` to ``send_to``; one payload from each of ``recv_from``."""
        ...

    def record(self, out: StepOutcome, event: SDCEvent) -> None: ...

    def fail(self, out: StepOutcome, suspects: list[int]) -> None:
        """The step is corrupt and not fixed: roll back."""
        ...

    def diverged(self, out: StepOutcome, ballot: Ballot, differing: list[str]) -> None:
        """The replicas' state differs (a reconciliation's ballot)."""
        ...


class ReplayRound:
    """One replay round (a new one per round).

    Args:
        host: the rank whose step is replayed; the round reads its replicas and records through it.
        at: the step checked, and why.
    """

    def __init__(self, host: RoundHost, at: RoundStep) -> None:
        self.host, self.at = host, at

    def _originals(self) -> tuple[torch.Tensor | None, list[list[int]]]:
        groups = [[i] for i in range(len(self.host.params))]
        if self.host.hook is not None and self.host.hook.digests:
            return self.host.hook.collected(), groups
        if self.host.world_size > 1:  # the gradients on the parameters are averaged already: nothing local to compare
            return None, groups
        return self.host.replayer.local_digests(), groups

    def _checked(self, scheduled: bool, every_device: bool) -> list[int]:
        """The batches (by rank) this round checks. With ``every_device`` (a job-wide guard, pairs that replay each
        batch twice) every other rank's from rank 0, and for a scheduled round with ``replay_scope=devices`` and a
        partner from an offset that moves with the round: each device replays once (one twice when the number of
        ranks is odd). One by turns for a scheduled round with ``replay_scope=rotate``; else every rank's. The same
        on every rank (rounds are collective, counted alike)."""
        world, scope = self.host.world_size, self.host.config.replay_scope
        if world > 1 and every_device:
            return _every_other(world, 0)
        if not scheduled or world == 1 or scope == ReplayScope.all:
            return list(range(world))
        if scope == ReplayScope.rotate:
            return [self.at.rotation % world]
        return _every_other(world, self.at.rotation) if self.host.config.partner_replay else list(range(world))

    def run(self, out: StepOutcome) -> None:
        """Replay the step (and with partner replay a neighbour's), vote per batch, record and act."""
        cfg, world, rank, guard_fired = self.host.config, self.host.world_size, self.host.rank, self.at.guard_fired
        self.host.stats.replay_rounds += 1
        original, groups = self._originals()
        partner = world > 1 and cfg.partner_replay
        # with nothing of its own to compare (no hook), a batch goes to its partner alone, and a round whose pairs
        # agree ends with one all-reduce: a clean round costs a rank the same at 2 ranks and at 10,000
        neighbours = partner and original is None and self.host.hook is None
        # only ranks' own guards (a loss) fired: their batches are checked, which each of them and its partner alone
        # know (the partner from the batch it receives), so a false alarm on one of N ranks costs two replays, not N
        own = (
            neighbours and guard_fired and self.host.reader.lag > 0 and not (self.at.job_guard or self.at.restore_check)
        )
        # a job-wide guard (the gradient norm, taken after the all-reduce) names no batch: every device replays once,
        # its own batch or its neighbour's, which meets a faulty device wherever it is for one replay a rank
        every = self._checked(
            scheduled=not guard_fired and not self.at.restore_check,
            every_device=neighbours and guard_fired and self.at.job_guard and not self.at.restore_check,
        )
        checked = ([rank] if self.at.fired else []) if own else every
        if neighbours and self.host.any_rank(
            not _plain((self.at.batch, self.at.rng))
        ):  # other types: the gather's pickle
            neighbours = own = False
            checked = every
        mine_in = None
        if partner and rank in checked:  # the batches travel on the host (one read of this rank's batch, on a replay)
            mine_in = (map_tensors(self.at.batch, lambda t: t.detach().cpu()), self.at.rng)
        inputs: list[Any]
        if neighbours:
            inputs = [None] * world
            prev = (rank - 1) % world
            inputs[prev] = self._neighbours(mine_in, both=False).get(prev)
            if own and inputs[prev] is not None:
                checked = sorted({*checked, prev})
            originals: list[torch.Tensor | None] = [None] * world
        else:  # one gather carries both what a partner replays and each rank's own digests (None where it has none)
            inputs, originals = (list(column) for column in zip(*self.host.gather((mine_in, original))))
        inputs[rank] = (self.at.batch, self.at.rng)
        opinions: dict[int, list[Opinion]] = {b: [] for b in checked}
        raw: dict[int, list[torch.Tensor | None]] = {b: [] for b in checked}  # per-parameter digests
        for b, o in enumerate(originals):
            if o is not None and b in opinions:
                opinions[b].append(Opinion(b, "original", o))
                raw[b].append(None)
        own_grads: list[tuple[torch.Tensor, list[torch.Tensor | None]]] = []
        plan = {b: [b] + ([(b + 1) % world] if partner else []) for b in checked}
        mine = self._replay(plan, inputs, groups, own_grads)
        if neighbours:  # every rank takes part in the pairs' check, with or without replays of its own
            if not self.host.any_rank(not self._pairs_agree(mine, checked, groups)):
                clean = {b: Ballot(decided=True, majority=[0, 1]) for b in checked}
                self._conclude_replay(out, opinions, clean, raw, own_grads)
                return
            # a pair disagrees: every rank takes part in the vote from here, with every batch (a rare round)
            inputs = [x for x, _ in self.host.gather((mine_in, None))]
            if own:  # the batches checked, now known everywhere: those that travelled
                checked = [b for b, x in enumerate(inputs) if x is not None]
                opinions, raw = {b: [] for b in checked}, {b: [] for b in checked}
            inputs[rank] = (self.at.batch, self.at.rng)
        ballots: dict[int, Ballot] = {}
        while True:
            for device, results in enumerate(self.host.gather(mine)):
                for b, digests in results.items():
                    raw[b].append(digests)
                    opinions[b].append(Opinion(device, "replay", group_rows(self.host.digest, digests, groups)))
            plan = {}
            for b in checked:
                ballots[b] = vote(opinions[b], self.host.digest.equal)
                if ballots[b].decided or len(opinions[b]) >= cfg.max_opinions:
                    continue
                plan[b] = [next_device(b, opinions[b], world, others=partner)]
            if not plan:
                break
            mine = self._replay(plan, inputs, groups, own_grads)
        self._conclude_replay(out, opinions, ballots, raw, own_grads)

    def _replay(
        self,
        plan: dict[int, list[int]],
        inputs: list[Any],
        groups: list[list[int]],
        own_grads: list[tuple[torch.Tensor, list[torch.Tensor | None]]],
    ) -> dict[int, torch.Tensor]:
        """Replay the batches ``plan`` gives this rank; their digests by batch (its own batch's gradients are kept
        in ``own_grads`` for a recompute)."""
        mine: dict[int, torch.Tensor] = {}
        for b, devices in plan.items():
            if self.host.rank not in devices:
                continue
            batch, rng = inputs[b]
            if b != self.host.rank:
                batch = map_tensors(batch, self.host.to_device)
            digests, grads = self.host.replayer.replay(batch, rng)
            self.host.stats.replays += 1
            mine[b] = digests
            if b == self.host.rank:
                own_grads.append((group_rows(self.host.digest, digests, groups), grads))
        return mine

    def _neighbours(self, obj: object, *, both: bool) -> dict[int, Any]:
        """Send ``obj`` to the next rank in the ring (and the previous one with ``both``); returns what came from the
        previous rank (and the next one), by rank. The neighbours are one rank at 2 ranks."""
        world, rank = self.host.world_size, self.host.rank
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        send_to, recv_from = ([nxt, prev], [prev, nxt]) if both and nxt != prev else ([nxt], [prev])
        got = self.host.exchange(_dumps(obj), send_to, recv_from)
        # a rank of this job, as in any_type gathers
        return {src: _loads(data) for src, data in zip(recv_from, got) if data is not None}

    def _pairs_agree(self, mine: dict[int, torch.Tensor], checked: list[int], groups: list[list[int]]) -> bool:
        """Whether the batches this rank replayed agree with their other replay, from one exchange of every replay
        with both neighbours: a rank's own batch against the next rank's replay of it, the previous rank's batch
        against that rank's own replay."""
        rank, world = self.host.rank, self.host.world_size
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        got = self._neighbours(mine, both=True)
        theirs = {rank: got.get(nxt, {}).get(rank), prev: got.get(prev, {}).get(prev)}
        for b in (rank, prev):
            if b not in checked:
                continue
            here, there = mine.get(b), theirs.get(b)
            if here is None or there is None:
                return False
            rows = group_rows(self.host.digest, here, groups), group_rows(self.host.digest, there, groups)
            if not self.host.digest.equal(*rows):
                return False
        return True

    def _conclude_replay(
        self,
        out: StepOutcome,
        opinions: dict[int, list[Opinion]],
        ballots: dict[int, Ballot],
        raw: dict[int, list[torch.Tensor | None]],
        own_grads: list[tuple[torch.Tensor, list[torch.Tensor | None]]],
    ) -> None:
        if self.host.world_size > 1 and any(b.verdict is not Diagnosis.CLEAN for b in ballots.values()):
            # a replay on another rank proves something only if the replicas are identical: check that first
            ballot, differing = self.host.reconciler.reconcile(self.host.gather, self.host.all_same)
            self.host.stats.reconcile_rounds += 1
            if ballot.dissent or not ballot.decided:
                self.host.diverged(out, ballot, differing)
                return
        guard_fired = self.at.guard_fired
        fired = [f"{f}@{r.step + 1}" for r in self.at.fired for f in r.fired] if guard_fired else []
        mechanism = "replay" + (f" (guard: {','.join(fired)})" if fired else "")
        mechanism += " (first step after a restore)" if self.at.restore_check else ""
        corrupt_original: list[int] = []
        unfixable: list[int] = []
        for b, ballot in ballots.items():
            ops = opinions[b]
            original_bad = ballot.decided and any(ops[i].kind == "original" for i in ballot.dissent)
            has_original = any(op.kind == "original" for op in ops)
            if ballot.verdict is Diagnosis.CLEAN:
                continue
            if original_bad and b in ballot.transient:
                corrupt_original.append(b)
                action, detail = "recomputed", f"rank {b}'s gradients differ from its replay and the vote"
            elif ballot.decided and has_original and not original_bad:
                action = "none"
                detail = f"a replay of rank {b}'s batch was wrong; the step itself was right"
            elif ballot.decided and not ballot.persistent:
                action = "none"
                detail = f"a replay of rank {b}'s batch glitched once (its original result was not digested)"
            else:
                unfixable.append(b)
                action = "rollback"
                detail = f"rank {b}'s batch: " + (_INCONCLUSIVE if not ballot.decided else _REPRODUCES)
            self.host.record(out, SDCEvent(out.step, mechanism, ballot.verdict, ballot.suspects, action, detail))
        if guard_fired and not out.events:
            if self.host.reader.lag > 0:
                detail = "a guard fired at an earlier step; the replay of this step reproduced it: no faulty device"
            else:
                detail = "the replay reproduced the step: not a hardware fault"
            self.host.record(out, SDCEvent(out.step, mechanism, Diagnosis.ANOMALY, [], "none", detail))
        if unfixable:
            self.host.fail(out, sorted({s for b in unfixable for s in ballots[b].suspects}))
            return
        if corrupt_original and not self._recompute(out, opinions, ballots, raw, own_grads):
            self.host.fail(out, corrupt_original)
            return
        if not corrupt_original:  # the values were genuine: the baselines follow them
            for report in self.at.fired:
                self.host.guards.genuine(report)
                self.host.guards.accept(
                    dataclasses.replace(report, param_norm=None) if self.host.reader.lag == 0 else report
                )
            if self.at.guard_report is not None and not self.at.fired:
                self.host.guards.accept(dataclasses.replace(self.at.guard_report, param_norm=None))

    def _recompute(
        self,
        out: StepOutcome,
        opinions: dict[int, list[Opinion]],
        ballots: dict[int, Ballot],
        raw: dict[int, list[torch.Tensor | None]],
        own_grads: list[tuple[torch.Tensor, list[torch.Tensor | None]]],
    ) -> bool:
        """Replace the corrupt gradients by correct ones; True if the result agrees with the vote everywhere."""
        if self.host.hook is None:  # one rank: install the replay gradients the vote agreed with
            majority = opinions[self.host.rank][ballots[self.host.rank].majority[0]].digest
            for digests, grads in own_grads:
                if self.host.digest.equal(digests, majority):
                    for p, g in zip(self.host.params, grads):
                        p.grad = g
                    self.host.stats.recomputed += 1
                    return True
            return False
        # DDP: every rank recomputes with synchronisation, so the all-reduce averages correct contributions
        for p in self.host.params:
            p.grad = None
        self.host.hook.reset()
        with rng_as(self.at.rng), torch.enable_grad():
            self.host.synced_loss(self.at.batch).backward()
        new, groups = self.host.hook.collected(), [[i] for i in range(len(self.host.params))]
        ok = True
        for b, digest in enumerate(self.host.gather(new)):
            if b not in ballots:  # a batch this round did not check
                continue
            agreed = [d for d in (raw[b][i] for i in ballots[b].majority) if d is not None]
            ok = ok and bool(agreed) and self.host.digest.equal(group_rows(self.host.digest, agreed[0], groups), digest)
        if ok:
            self.host.stats.recomputed += 1
        return ok


def _every_other(world: int, offset: int) -> list[int]:
    """Every other rank from ``offset`` round the ring: with each batch replayed by its rank and the next, every rank
    replays once (the rank at ``offset`` twice when ``world`` is odd)."""
    return sorted({(offset + 2 * i) % world for i in range((world + 1) // 2)})


_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, bytes, type(None))


def _plain(obj: object) -> bool:
    """Whether ``obj`` is tensors and built-in values in dicts, lists and tuples: what a neighbour reads back with
    ``torch.load(weights_only=True)`` (a batch of the user's own types goes by the gather instead)."""
    if isinstance(obj, _PLAIN_LEAVES):
        return True
    if isinstance(obj, (list, tuple)):
        return all(_plain(x) for x in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in obj.items())
    return False


def _dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)
