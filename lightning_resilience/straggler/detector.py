"""StragglerDetector: per-rank timing, a bounded-cadence exchange of timings, change-point verdicts and the action
ladder, with no framework dependency.

Every rank times its own steps and, every ``gather_every_n_steps`` steps, sends its timings of each step since. Along
the step agreement's tree to rank 0 alone (:meth:`StragglerDetector.with_tree`, the Lightning callback's way): issued
without waiting, taken at a later step and handed unparsed to rank 0's scorer (a process of its own by default), which
decides; the policy's next agreement tells the others, and nothing in a training process parses N records. Or by an
all-gather (``gather``, :meth:`StragglerDetector.from_process_group`): every rank reaches the same decisions.

By default the tested series are each rank's ``compute`` (its step minus the collective waits the probes measure)
and ``data`` (its wait for the next batch), scored against the other ranks; a job-wide slowdown (every rank's own
work slower than its own history) is a separate job verdict. Scores, change points and the ladder run step by step
on the gathered records, the calm steps of an exchange at once (the same state).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lightning_resilience.collective import SideGroup
from lightning_resilience.links import Blob
from lightning_resilience.step.agreement import Pending, TreeAgreement
from lightning_resilience.straggler import presentation
from lightning_resilience.straggler.config import StragglerConfig
from lightning_resilience.straggler.episodes import Episodes
from lightning_resilience.straggler.exchange import (
    GatherFn,
    Payload,
    StragglerGatherError,
    Table,
    decode_gathered,
    encode_payload,
    gloo_gather,
    node_layout,
    table_of,
)
from lightning_resilience.straggler.kernels import KERNELS, NvrxKernelScores, open_kernel_scores
from lightning_resilience.straggler.policy import Escalation, StragglerFinding
from lightning_resilience.straggler.probes import WaitProbe
from lightning_resilience.straggler.scoreboard import Scoreboard
from lightning_resilience.straggler.scoring import Scored, Scorer, open_scorer
from lightning_resilience.straggler.timing import COMPUTE, DATA, STEP, WAIT, CudaEventSource, StepTimer

__all__ = ["AUTO_SECTIONS", "StragglerDetector"]

log = logging.getLogger(__name__)

AUTO_SECTIONS = (COMPUTE, DATA)  # tested when the configuration names none
_HISTORY_CAP, _HISTORY_VALUES = 20_000, 2_000_000  # samples kept for the plot and the report; timings in them
_KEPT = (STEP, COMPUTE, DATA, WAIT)  # the sections the history keeps, in this order


class StragglerDetector:
    """Find the rank that slows the job down, name it and its slow component, and decide what to do about it.

    Example (plain torch, one detector per rank)::

        detector = StragglerDetector.from_process_group(StragglerConfig())
        detector.attach(ddp_model)                  # probes DDP's collective waits
        for step, batch in enumerate(loader):
            detector.start_step()
            loss = ddp_model(batch)
            with detector.backward(loss):
                loss.backward()
            opt.step()
            for decision in detector.end_step(step):
                if decision.action is Action.CHECKPOINT_AND_STOP:
                    ...  # checkpoint, then exit with ExitCode.STRAGGLER

    Args:
        config: detection and ladder settings.
        rank: this rank.
        world_size: ranks in the job.
        gather: all-gather of payloads (``world_size > 1`` needs it or ``tree``); see :func:`gloo_gather`.
        tree: exchange along this agreement's tree to rank 0 instead (see :meth:`with_tree`).
        timer: step timer (default: CUDA events on a GPU when ``config.cuda_events``, else the wall clock).
        clock: host clock of the default timer (tests inject a fake one).
        hostname: this rank's node name (default: ``socket.gethostname()``).
        local_world_size: ranks per node (default: ``$LOCAL_WORLD_SIZE`` if set).
        kernel_scores: NVRx CUPTI kernel scores (default: opened when ``config.kernel_scores``).
    """

    def __init__(
        self,
        config: StragglerConfig | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        gather: GatherFn | None = None,
        timer: StepTimer | None = None,
        clock: Callable[[], float] | None = None,
        hostname: str | None = None,
        local_world_size: int | None = None,
        kernel_scores: NvrxKernelScores | None = None,
        tree: TreeAgreement | None = None,
    ) -> None:
        self.config = c = config or StragglerConfig()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if world_size > 1 and gather is None and tree is None:
            raise ValueError("a gather function or a tree is required with world_size > 1 (see gloo_gather)")
        self.rank, self.world_size = rank, world_size
        self._gather, self._tree = gather, tree
        self._inflight: Pending | None = None
        self._scorer: Scorer | None = None  # rank 0 of a tree: scores off the training thread (config.scoring)
        use_cuda = timer is None and c.cuda_events and torch.cuda.is_available()
        self.timer = timer = timer or StepTimer(CudaEventSource() if use_cuda else None, clock=clock)
        self.probe = WaitProbe(timer)
        self.hostname = hostname or socket.gethostname()
        env_lws = os.environ.get("LOCAL_WORLD_SIZE")
        self.local_world_size = local_world_size or (int(env_lws) if env_lws and env_lws.isdigit() else 0)
        if kernel_scores is None and c.kernel_scores:
            kernel_scores = open_kernel_scores()
        self._kernels = kernel_scores
        self.mode = "relative" if world_size > 1 and c.detect_on == "relative" else "individual"
        self.episodes = Episodes(c, rank)

        tested = list(c.sections) if c.sections is not None else list(AUTO_SECTIONS)
        self.sections = tested + ([KERNELS] if self._kernels is not None else [])
        self._payload_sections = sorted({*tested, STEP, DATA, COMPUTE, WAIT})
        self.scoreboard = Scoreboard(self.sections, world_size, c, relative=self.mode == "relative")
        self._ended = 0  # end_step calls (every rank makes the same number: it decides when to gather)
        self._last_step: int | None = None
        self._last_gather_step: int | None = None
        self.nodes, self.node_index = [""] * world_size, list(range(world_size))  # host and node index per rank
        cap = max(64, self.config.confirm_steps, min(_HISTORY_CAP, _HISTORY_VALUES // (4 * world_size)))
        self.history: deque[tuple[int, dict[str, np.ndarray]]] = deque(maxlen=cap)  # the newest samples
        """Per gathered step: (step, {section: seconds per rank}) for step, compute, data and wait."""
        self._texts: dict[bytes, tuple[str, tuple[str, ...]]] = {}  # where it scores: the payloads' texts read
        self.last_decisions: list[Escalation] = []
        self.gathers, self.gather_seconds = 0, 0.0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_process_group(cls, config: StragglerConfig | None = None, **kwargs: Any) -> StragglerDetector:
        """A detector on every rank of the initialised default process group, exchanging over a new side gloo group.

        Collective: every rank must call it (creating a group is collective)."""
        config = config or StragglerConfig()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(config, **kwargs)
        group = SideGroup("straggler", config.gather_timeout)
        return cls(config, rank=group.rank, world_size=group.world_size, gather=gloo_gather(group), **kwargs)

    @classmethod
    def with_tree(cls, config: StragglerConfig, tree: TreeAgreement, **kwargs: Any) -> StragglerDetector:
        """A detector that sends its timings along ``tree`` (the step agreement's) to rank 0, which alone scores and
        decides; nothing is created (not collective)."""
        group = tree.group
        return cls(config, rank=group.rank, world_size=group.world_size, tree=tree, **kwargs)

    def attach(self, model: nn.Module) -> str:
        """Probe the collective waits of ``model`` (a DDP wrapper, or a model holding FSDP modules) so that
        ``compute`` excludes them; returns ``"ddp"``, ``"fsdp"`` or ``"none"``."""
        return self.probe.attach(model)

    def close(self) -> None:
        """Finish the scoring in flight; release the scorer (its process or thread), the probes and the kernel
        profiler."""
        try:
            self.drain()
        except StragglerGatherError as err:  # the scoring process died: what it scored is lost, the fit goes on
            log.warning("%s", err)
        if self._scorer is not None:
            self._scorer.close()
            self._scorer = None
        self.probe.detach()
        if self._kernels is not None:
            self._kernels.close()
            self._kernels = None

    # ------------------------------------------------------------------ timing
    def start_step(self) -> None:
        self.timer.start_step()
        if self._kernels is not None:
            self._kernels.begin()

    def begin(self, name: str) -> None:
        self.timer.begin(name)

    def end(self, name: str) -> None:
        self.timer.end(name)

    def section(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a named part of the step: ``with detector.section("augment"): batch = augment(batch)``."""
        return self.timer.section(name)

    def arm_backward(self, loss: torch.Tensor) -> None:
        """Just before ``loss.backward()``: the collective wait opens once the local gradients are computed."""
        self.probe.arm_backward(loss)

    def backward_done(self) -> None:
        """Once ``backward`` has returned: the collective wait closes."""
        self.probe.backward_done()

    @contextlib.contextmanager
    def backward(self, loss: torch.Tensor) -> Iterator[None]:
        """``with detector.backward(loss): loss.backward()``: time the backward's collective wait."""
        self.arm_backward(loss)
        try:
            yield
        finally:
            self.backward_done()

    @contextlib.contextmanager
    def step(self, step: int | None = None) -> Iterator[None]:
        """``with detector.step(i): ...``: start and end a step; the decisions land in ``last_decisions``."""
        self.start_step()
        yield
        self.end_step(step)

    def end_step(self, step: int | None = None) -> list[Escalation]:
        """Close the step; at exchange steps exchange timings, update the verdicts and return the decisions taken.

        With an all-gather, collective at exchange steps: every rank calls it the same number of times. Along a
        tree, the exchange is issued here and taken at a later call (rank 0 decides; the others return nothing)."""
        self.timer.end_step()
        if self._kernels is not None:
            self._kernels.end()
        payload = self.prepare(step)
        decisions: list[Escalation] = []
        if self._tree is not None:
            decisions = self._take(wait=payload is not None)
            if payload is not None:
                self._inflight = self._tree.gather(encode_payload(payload), op="straggler.exchange", step=step)
        elif payload is not None:
            assert self._last_step is not None
            decisions = self.consume(self._last_step, self._exchange(payload))
        self.last_decisions = decisions
        self.timer.mark_idle()  # the exchange and the scoring are not a wait for data
        return decisions

    @property
    def scoring(self) -> bool:
        """Rank 0 of a tree is scoring an exchange (in its scorer): its scores and ladder are read once it is done."""
        return self._scorer is not None and self._scorer.pending > 0

    def drain(self, *, wait: bool = True) -> list[Escalation]:
        """The decisions of the scoring done (``wait``: of all in flight, and the scorer's whole state with them, off
        the step path: a fit's end, a report)."""
        if self._scorer is None:
            return []
        decisions: list[Escalation] = []
        elsewhere = self._scorer.scores_elsewhere  # a thread updates this detector itself: nothing to read back
        for scored in self._scorer.take(wait=wait):
            decisions += self._apply(scored) if elsewhere else list(scored.decisions)
        if wait and (state := self._scorer.state()) is not None:  # the report's, from where it was scored
            self.scoreboard, self.episodes, self.history, self.nodes, self.node_index = state
        return decisions

    def _score_bodies(self, step: int, blobs: Sequence[Blob]) -> Scored:
        """Where the scorer runs: read, decode and score the blobs of one exchange; what the training process needs."""
        decisions, board = self.consume(step, decode_gathered(blobs, self._texts)), self.scoreboard
        scores = (board.relative, board.individual, board.job_last)
        return Scored(decisions, self.episodes, self.gathers, self._last_gather_step, scores)

    def _apply(self, scored: Scored) -> list[Escalation]:
        self.episodes, self.gathers, self._last_gather_step = scored.episodes, scored.gathers, scored.last_gather_step
        self.scoreboard.relative, self.scoreboard.individual, self.scoreboard.job_last = scored.scores
        return list(scored.decisions)

    def _take(self, *, wait: bool) -> list[Escalation]:
        """Decisions of the scoring that finished, and the exchange in flight once it has arrived (or now, waiting,
        before the next is issued), handed to rank 0's scorer as it came; the other ranks have nothing to do."""
        decisions = self.drain(wait=False)
        pending = self._inflight
        if pending is None or not (wait or pending.done()):
            return decisions
        self._inflight = None
        try:
            gathered = pending.result()
        except Exception as err:  # CollectiveError from the tree
            raise self._failed(pending.step, err) from err
        self.gather_seconds += time.perf_counter() - pending.issued
        if gathered:  # handed on unparsed: nothing here grows with the number of ranks
            self.start_scorer().submit(int(pending.step or 0), gathered.blobs)
        return decisions

    def start_scorer(self) -> Scorer:
        """Rank 0 of a tree: start its scorer now (the callback does at setup, before the first step: forking a
        scoring process takes tens of ms) rather than at the first exchange."""
        if self._scorer is None:
            state = lambda: (self.scoreboard, self.episodes, self.history, self.nodes, self.node_index)  # noqa: E731
            self._scorer = open_scorer(self.config.scoring, self._score_bodies, state, self.config.gather_timeout_s)
        return self._scorer

    # ------------------------------------------------------------------ exchange
    def prepare(self, step: int | None = None) -> Payload | None:
        """Count a finished step; at an exchange step, this rank's payload (else None): its timings of every step
        since the last exchange. ``end_step`` = prepare + exchange + consume; simulations call them themselves."""
        self._ended += 1
        self._last_step = self._ended if step is None else step
        self.timer.label_finished(self._last_step)
        if self._ended <= self.config.warmup_steps:  # the warm-up's timings are dropped as they end
            self.timer.collect()
            return None
        if (self._ended - self.config.warmup_steps) % self.config.gather_every_n_steps:
            return None  # the steps' timings stay in the timer until the exchange: nothing read on an ordinary step
        kernels = {KERNELS: self._kernels.slowdown()} if self._kernels is not None else {}
        steps, times = [], []
        for step_, record in self.timer.collect_labelled():  # the same keys in every row (NaN: not timed)
            steps.append(step_)  # every finished step was named above, at the latest by this call
            times.append({**{name: float(record.get(name, math.nan)) for name in self._payload_sections}, **kernels})
        return {"rank": self.rank, "host": self.hostname, "local_world_size": self.local_world_size, "steps": steps,
                "times": times}  # fmt: skip

    def _exchange(self, payload: Payload) -> Sequence[Payload]:
        if self._gather is None:
            return [payload]
        t0 = time.perf_counter()
        try:
            gathered = self._gather(payload)
        except Exception as err:  # CollectiveError from the side group, or what a custom gather raises
            raise self._failed(self._last_step, err) from err
        self.gather_seconds += time.perf_counter() - t0
        return gathered

    def _failed(self, step: int | None, err: Exception) -> StragglerGatherError:
        return StragglerGatherError(
            f"straggler: exchange of step timings failed at step {step} ({err}); a rank is hung, gone or more than "
            f"{timedelta(seconds=self.config.gather_timeout_s)} behind",
            op="straggler.exchange",
            group="straggler",
        )

    def consume(self, step: int, payloads: Sequence[Payload] | Table) -> list[Escalation]:
        """Update scores, change points and the ladder from every rank's payload (dicts, or a :class:`~.exchange.Table`)
        one gathered step at a time; act on and return the decisions. Deterministic in ``payloads``."""
        table = payloads if isinstance(payloads, Table) else table_of(payloads)
        if table.ranks != list(range(self.world_size)):
            raise StragglerGatherError(f"straggler: expected one payload per rank 0..{self.world_size - 1}")
        self.gathers += 1
        if self.gathers == 1:  # host names and ranks per node travel with every exchange; read once
            self.nodes, self.node_index = node_layout(table.hosts, table.local_world_sizes, self.world_size)
        missing = np.full(self.world_size, np.nan)
        names = [*self._payload_sections, *([KERNELS] if KERNELS in self.sections else [])]
        decisions: list[Escalation] = []
        steps = [int(table.steps[j]) if j < len(table.steps) else step for j in range(table.times.shape[1])]
        measured, j, calm = table.measured(self.sections), 0, True
        while j < len(steps):  # calm samples several at a time (the same state as one by one); the others one by one:
            if calm and measured[j] and self.scoreboard.calm:  # an episode, or a value not measured (after a pause)
                end = next((k for k in range(j, len(steps)) if not measured[k]), len(steps))  # the measured run
                if taken := self._score_calm(steps[j:end], table, j):
                    j += taken
                    continue
                calm = False  # a measured sample the board would not take (near a threshold): one by one from here
            column = {n: c if (c := table.column(j, n)) is not None else missing for n in names}
            decisions += self._score(steps[j], column)
            j += 1
        decisions.sort(key=lambda d: (d.action.severity, d.verdict.rank))
        self.episodes.act(decisions)
        return decisions

    def _score_calm(self, steps: list[int], table: Table, start: int) -> int:
        """The leading samples the scoreboard takes at once (:meth:`Scoreboard.update_calm`), kept in the history."""
        times, kept = (table.block(start, names, start + len(steps)) for names in (self.sections, _KEPT))
        if times is None or kept is None:
            return 0
        work = kept[:, 1] + np.where(np.isnan(kept[:, 2]), 0.0, kept[:, 2])  # compute + data wait, as in _score
        calm = self.scoreboard.update_calm(steps, times, work)
        self.history.extend((steps[t], dict(zip(_KEPT, kept[t].copy()))) for t in range(calm))
        self._last_gather_step = steps[calm - 1] if calm else self._last_gather_step
        return calm

    def _score(self, step: int, column: dict[str, np.ndarray]) -> list[Escalation]:
        """One gathered step: every rank's seconds per section."""
        previous = self._last_gather_step
        self._last_gather_step = step
        data = column[DATA]
        work = column[COMPUTE] + np.where(np.isnan(data), 0.0, data)  # no data wait measured (after a pause)
        self.history.append((step, {k: column[k].copy() for k in _KEPT}))
        board = self.scoreboard
        events = board.update(step, np.stack([column[name] for name in self.sections]), work)
        score = "relative" if self.mode == "relative" else "individual"
        evidence = presentation.wait_evidence(self.history, self.config.confirm_steps)
        decisions: list[Escalation] = []
        for i in events.ended.tolist():
            self.episodes.ended(*board.series(i), step)
        for i in np.flatnonzero(board.cusum.flagged).tolist():
            rank, name = board.series(i)
            series_score = "relative" if name == KERNELS else score if rank >= 0 else "individual"
            decisions += self.episodes.update(
                i, rank, name, step, previous, events, board.cusum, score=series_score, nodes=self.nodes,
                node_index=self.node_index,
                evidence=evidence,
            )  # fmt: skip
        return decisions

    # ------------------------------------------------------------------ reporting
    @property
    def verdicts(self) -> list[StragglerFinding]:
        """Stragglers and job-wide slowdowns found, in order."""
        return self.episodes.verdicts

    @property
    def noise_level(self) -> list[StragglerFinding]:
        """Confirmations within the series' jitter (``noise_level``): listed in the report, never acted on."""
        return self.episodes.noise_level

    @property
    def decisions(self) -> list[Escalation]:
        return self.episodes.decisions

    @property
    def should_stop(self) -> bool:
        return self.episodes.should_stop

    @property
    def stop_decision(self) -> Escalation | None:
        return self.episodes.stop_decision

    @property
    def active(self) -> list[StragglerFinding]:
        """Verdicts whose episode is still going on (stragglers, then a job-wide slowdown)."""
        return self.episodes.active

    def scores(self, section: str | None = None) -> dict[str, list[float]]:
        """Latest relative and individual slowdowns per rank of ``section`` (default: the first tested section)."""
        i = self.sections.index(section or self.sections[0])
        return {"relative": self.scoreboard.relative[i].tolist(), "individual": self.scoreboard.individual[i].tolist()}

    def report(self) -> dict[str, Any]:
        """JSON-able figures: per-rank statistics per section, verdicts, noise-level confirmations, decisions."""
        self.drain()
        return presentation.report(self)

    def summary(self, max_rows: int = 16) -> str:
        """A compact table: the slowest ranks, then the verdicts and decisions."""
        self.drain()
        return presentation.summary(self, max_rows)

    def plot(self, path: str | os.PathLike[str]) -> Path | None:
        """PNG of the per-rank compute and data times with the verdicts marked; None without matplotlib."""
        self.drain()
        return presentation.plot(self, path)
