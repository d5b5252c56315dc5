"""StragglerDetector: per-rank step timing, a bounded-cadence exchange of timings, change-point verdicts and the
action ladder, with no framework dependency.

Every rank runs the same detector. At each gather step the ranks all-gather one small record each (the median time
per section since the previous gather); every rank then runs the same deterministic computation on the same
gathered records, so all ranks reach the same verdicts and decisions at the same step without any further
collective.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_resilience.straggler.changepoint import MIN_HISTORY, RobustCusum
from lightning_resilience.straggler.config import StragglerConfig
from lightning_resilience.straggler.kernels import KERNELS, NvrxKernelScores, open_kernel_scores
from lightning_resilience.straggler.policy import Action, ActionLadder, Decision, Verdict
from lightning_resilience.straggler.scores import IndividualBaseline, relative_slowdowns
from lightning_resilience.straggler.timing import STEP, CudaEventSource, StepTimer

__all__ = ["GatherFn", "GlooGather", "Payload", "StragglerDetector", "StragglerGatherError", "gloo_gather"]

log = logging.getLogger(__name__)

Payload = dict[str, Any]
"""One rank's record for one exchange: ``{"rank", "host", "local_world_size", "times": {section: seconds}}``."""
GatherFn = Callable[[Payload], Sequence[Payload]]
"""All-gather of one payload per rank; every rank gets every rank's payload."""

_HISTORY_CAP = 20_000  # gathered samples kept for the plot and the report


class StragglerGatherError(RuntimeError):
    """The exchange of timings did not complete: a rank is hung, gone, or far behind."""


class GlooGather:
    """All-gather of payloads over ``group`` (a side gloo group; its timeout bounds every wait).

    The first exchange all-gathers the whole payloads as objects (host names, ranks per node, section names); later
    ones all-gather only a float64 tensor of the times, in the section order of the first exchange (the same on
    every rank: it comes from the shared configuration). A payload whose sections differ from the first one's goes
    back to objects; since every rank's sections come from the same configuration, all ranks take the same path.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self._first: list[Payload] | None = None
        self._keys: list[str] = []

    def __call__(self, payload: Payload) -> Sequence[Payload]:
        keys = sorted(payload["times"])
        if self._first is None or keys != self._keys:
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, payload, group=self.group)
            if self._first is None:
                self._first, self._keys = out, keys
            return out
        local = torch.tensor([float(payload["times"][k]) for k in keys], dtype=torch.float64)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return [{**first, "times": dict(zip(keys, part.tolist()))} for first, part in zip(self._first, parts)]


def gloo_gather(group: Any) -> GatherFn:
    """An all-gather of payloads over ``group`` (a side gloo group); see :class:`GlooGather`."""
    return GlooGather(group)


@dataclass
class _SectionState:
    cusum: RobustCusum
    baseline: IndividualBaseline
    relative: np.ndarray
    individual: np.ndarray
    rel_sum: np.ndarray
    rel_max: np.ndarray
    rel_count: np.ndarray
    time_samples: list[deque[float]] = field(default_factory=list)


class StragglerDetector:
    """Find the rank that slows the job down, name it, and decide what to do about it.

    Example (plain torch, one detector per rank)::

        detector = StragglerDetector.from_process_group(StragglerConfig(sections=["step", "forward"]))
        for step, batch in enumerate(loader):
            detector.start_step()
            with detector.section("forward"):
                loss = model(batch)
            loss.backward(); opt.step()
            for decision in detector.end_step(step):
                if decision.action is Action.STOP:
                    ...  # checkpoint, then exit with STRAGGLER_EXIT_CODE

    Args:
        config: detection and ladder settings.
        rank: this rank.
        world_size: ranks in the job.
        gather: all-gather of payloads (required when ``world_size > 1``); see :func:`gloo_gather`.
        timer: step timer (default: CUDA events on a GPU when ``config.cuda_events``, else the wall clock).
        clock: host clock of the default timer (tests inject a fake one).
        hostname: this rank's node name (default: ``socket.gethostname()``).
        local_world_size: ranks per node (default: ``$LOCAL_WORLD_SIZE`` if set).
        exclude_hook: called on every rank with the verdict when an ``exclude`` level fires (remove the rank,
            rebalance the work); required if the ladder has such a level.
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
        exclude_hook: Callable[[Verdict], None] | None = None,
        kernel_scores: NvrxKernelScores | None = None,
    ) -> None:
        self.config = config or StragglerConfig()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if world_size > 1 and gather is None:
            raise ValueError("a gather function is required with world_size > 1 (see gloo_gather)")
        if any(lvl.action == "exclude" for lvl in self.config.levels) and exclude_hook is None:
            raise ValueError("straggler.levels has an 'exclude' level but no exclude_hook was given")
        self.rank, self.world_size = rank, world_size
        self._gather = gather
        if timer is None:
            use_cuda = self.config.cuda_events and torch.cuda.is_available()
            timer = StepTimer(CudaEventSource() if use_cuda else None, clock=clock)
        self.timer = timer
        self.hostname = hostname or socket.gethostname()
        env_lws = os.environ.get("LOCAL_WORLD_SIZE")
        self.local_world_size = local_world_size or (int(env_lws) if env_lws and env_lws.isdigit() else 0)
        self.exclude_hook = exclude_hook
        self._kernels = kernel_scores if kernel_scores is not None else self._open_kernels()
        self.mode = "relative" if world_size > 1 and self.config.detect_on == "relative" else "individual"
        self.ladder = ActionLadder(self.config.levels)

        self.sections = list(self.config.sections) + ([KERNELS] if self._kernels is not None else [])
        self._payload_sections = sorted({*self.config.sections, STEP})
        self._state = {name: self._new_section_state() for name in self.sections}
        self._buffer: list[dict[str, float]] = []
        self._ended = 0  # end_step calls (every rank makes the same number: it decides when to gather)
        self._last_step: int | None = None
        self._last_gather_step: int | None = None
        self.nodes: list[str] = [""] * world_size
        self.node_index: list[int] = list(range(world_size))
        self.history: deque[tuple[int, list[float]]] = deque(maxlen=_HISTORY_CAP)  # (step, STEP seconds per rank)
        self.verdicts: list[Verdict] = []
        self.decisions: list[Decision] = []
        self.last_decisions: list[Decision] = []
        self.gathers = 0
        self.gather_seconds = 0.0
        self.should_stop = False
        self.stop_decision: Decision | None = None
        self._side_group: Any = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_process_group(cls, config: StragglerConfig | None = None, **kwargs: Any) -> StragglerDetector:
        """A detector on every rank of the initialised default process group, exchanging over a new side gloo group.

        Collective: every rank must call it (creating a group is collective)."""
        config = config or StragglerConfig()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(config, **kwargs)
        group = dist.new_group(backend="gloo", timeout=config.gather_timeout)
        detector = cls(
            config, rank=dist.get_rank(), world_size=dist.get_world_size(), gather=gloo_gather(group), **kwargs
        )
        detector._side_group = group
        return detector

    def _open_kernels(self) -> NvrxKernelScores | None:
        return open_kernel_scores() if self.config.kernel_scores else None

    def _new_section_state(self) -> _SectionState:
        c, n = self.config, self.world_size
        return _SectionState(
            cusum=RobustCusum(
                n,
                min_slowdown=c.min_slowdown,
                confirm_steps=c.confirm_steps,
                threshold=c.cusum_threshold,
                clip=c.cusum_clip,
                noise_floor=c.noise_floor,
                window=max(c.window, MIN_HISTORY),
            ),
            baseline=IndividualBaseline(n, window=c.window, min_samples=max(MIN_HISTORY, c.window // 2)),
            relative=np.full(n, np.nan),
            individual=np.full(n, np.nan),
            rel_sum=np.zeros(n),
            rel_max=np.full(n, np.nan),
            rel_count=np.zeros(n, dtype=np.int64),
        )

    def close(self) -> None:
        """Release the kernel profiler and the side group (collective when a side group exists)."""
        if self._kernels is not None:
            self._kernels.close()
            self._kernels = None
        if self._side_group is not None:
            group, self._side_group = self._side_group, None
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)

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
        """Time a named part of the step: ``with detector.section("data"): batch = next(it)``."""
        return self.timer.section(name)

    @contextlib.contextmanager
    def step(self, step: int | None = None) -> Iterator[None]:
        """``with detector.step(i): ...``: start and end a step; the decisions land in ``last_decisions``."""
        self.start_step()
        yield
        self.end_step(step)

    def end_step(self, step: int | None = None) -> list[Decision]:
        """Close the step; at gather steps exchange timings, update the verdicts and return the decisions taken.

        Collective at gather steps: every rank calls it the same number of times."""
        self.timer.end_step()
        if self._kernels is not None:
            self._kernels.end()
        payload = self.prepare(step)
        if payload is None:
            self.last_decisions = []
            return []
        assert self._last_step is not None
        return self.consume(self._last_step, self._exchange(payload))

    # ------------------------------------------------------------------ exchange
    def prepare(self, step: int | None = None) -> Payload | None:
        """Count a finished step; at a gather step, this rank's payload (else None). ``end_step`` = prepare + gather
        + consume; simulations and tests call the three themselves."""
        self._ended += 1
        self._last_step = self._ended if step is None else step
        records = self.timer.collect()
        warm = self._ended > self.config.warmup_steps
        if warm:
            self._buffer.extend(records)
        if not warm or (self._ended - self.config.warmup_steps) % self.config.gather_every_n_steps:
            return None
        times: dict[str, float] = {}
        for name in self._payload_sections:  # always the same keys (NaN: not timed), so the exchange is fixed-size
            values = [r[name] for r in self._buffer if name in r]
            times[name] = statistics.median(values) if values else math.nan
        self._buffer = []
        if self._kernels is not None:
            times[KERNELS] = self._kernels.slowdown()
        return {"rank": self.rank, "host": self.hostname, "local_world_size": self.local_world_size, "times": times}

    def _exchange(self, payload: Payload) -> Sequence[Payload]:
        if self._gather is None:
            return [payload]
        t0 = time.perf_counter()
        try:
            gathered = self._gather(payload)
        except Exception as err:  # dist raises RuntimeError / DistBackendError on a timeout or a lost peer
            raise StragglerGatherError(
                f"straggler: exchange of step timings failed at step {self._last_step} ({err}); a rank is hung, gone "
                f"or more than {timedelta(seconds=self.config.gather_timeout_s)} behind"
            ) from err
        self.gather_seconds += time.perf_counter() - t0
        return gathered

    def consume(self, step: int, payloads: Sequence[Payload]) -> list[Decision]:
        """Update scores, change points and the ladder from every rank's payload; act on and return the decisions.

        Deterministic in ``payloads``: ranks that consume the same payloads take the same decisions."""
        by_rank = sorted(payloads, key=lambda p: int(p["rank"]))
        if [int(p["rank"]) for p in by_rank] != list(range(self.world_size)):
            raise StragglerGatherError(f"straggler: expected one payload per rank 0..{self.world_size - 1}")
        self.gathers += 1
        self._update_nodes(by_rank)
        previous = self._last_gather_step
        self._last_gather_step = step
        step_times = [float(p["times"].get(STEP, math.nan)) for p in by_rank]
        self.history.append((step, step_times))
        decisions: list[Decision] = []
        for name in self.sections:
            times = np.array([float(p["times"].get(name, np.nan)) for p in by_rank])
            decisions += self._update_section(name, step, previous, times)
        decisions.sort(key=lambda d: (d.action.severity, d.verdict.rank))
        for decision in decisions:
            self._act(decision)
        self.decisions += decisions
        self.last_decisions = decisions
        return decisions

    def _update_nodes(self, payloads: Sequence[Payload]) -> None:
        self.nodes = [str(p.get("host", "")) for p in payloads]
        lws = [int(p.get("local_world_size") or 0) for p in payloads]
        if all(lws) and len(set(lws)) == 1:
            self.node_index = [rank // lws[0] for rank in range(self.world_size)]
        else:
            order: dict[str, int] = {}
            self.node_index = [order.setdefault(host, len(order)) for host in self.nodes]

    def _update_section(self, name: str, step: int, previous: int | None, times: np.ndarray) -> list[Decision]:
        st = self._state[name]
        if name == KERNELS:
            # already a relative factor against the fastest rank (NVRx): use it as is
            st.relative = np.where(np.isfinite(times), np.maximum(times, 1e-9), np.nan)
        else:
            st.relative = relative_slowdowns(times, self.config.reference)
        st.individual = st.baseline.slowdowns(times)
        series = st.relative if self.mode == "relative" or name == KERNELS else st.individual
        events = st.cusum.update(step, series)
        st.baseline.update(times, ~st.cusum.flagged)
        seen = np.isfinite(st.relative)
        st.rel_sum[seen] += st.relative[seen]
        st.rel_count[seen] += 1
        st.rel_max = np.fmax(st.rel_max, st.relative)

        for rank in events.ended.tolist():
            self.ladder.end(rank, name)
            log.info(
                "straggler: rank %d is back within %.2fx in '%s' at step %d", rank, self.config.min_slowdown, name, step
            )
        for rank in events.started.tolist():
            verdict = Verdict(
                rank=rank,
                node=self.nodes[rank],
                node_index=self.node_index[rank],
                section=name,
                slowdown=float(events.slowdown[rank]),
                score="relative" if series is st.relative else "individual",
                step=step,
                onset_step=st.cusum.onset(rank),
            )
            self.verdicts.append(verdict)
            self.ladder.start(verdict, previous)
        out: list[Decision] = []
        for rank in np.flatnonzero(st.cusum.flagged).tolist():
            if math.isfinite(events.slowdown[rank]):
                out += self.ladder.observe(rank, name, step, float(events.slowdown[rank]))
        return out

    def _act(self, decision: Decision) -> None:
        verdict = decision.verdict
        if decision.action is Action.LOG:
            if self.rank == 0:
                log.warning("straggler: %s", verdict.describe())
        elif decision.action is Action.ALERT:
            if self.rank == 0:
                log.error("straggler ALERT: %s (persisted %d steps)", verdict.describe(), decision.persist_steps)
        elif decision.action is Action.EXCLUDE:
            assert self.exclude_hook is not None  # checked at construction
            self.exclude_hook(verdict)
        elif decision.action is Action.STOP:
            if self.rank == 0:
                log.error("straggler STOP: %s; checkpoint and stop so the job restarts without it", verdict.describe())
            self.should_stop = True
            if self.stop_decision is None:
                self.stop_decision = decision

    # ------------------------------------------------------------------ reporting
    @property
    def active(self) -> list[Verdict]:
        """Stragglers whose episode is still going on."""
        return self.ladder.active

    def scores(self, section: str | None = None) -> dict[str, list[float]]:
        """Latest relative and individual slowdowns per rank of ``section`` (default: the first tested section)."""
        st = self._state[section or self.sections[0]]
        return {"relative": st.relative.tolist(), "individual": st.individual.tolist()}

    def report(self) -> dict[str, Any]:
        """JSON-able figures: per-rank statistics per section, verdicts and decisions."""
        sections: dict[str, Any] = {}
        for name, st in self._state.items():
            with np.errstate(invalid="ignore", divide="ignore"):
                mean = st.rel_sum / st.rel_count
            sections[name] = {
                "relative_mean": [_num(v) for v in mean],
                "relative_max": [_num(v) for v in st.rel_max],
                "relative_last": [_num(v) for v in st.relative],
                "individual_last": [_num(v) for v in st.individual],
                "noise_scale": [_num(v) for v in st.cusum.scale],
            }
        medians = self._median_step_times()
        return {
            "world_size": self.world_size,
            "mode": self.mode,
            "gathers": self.gathers,
            "gather_seconds": self.gather_seconds,
            "nodes": list(self.nodes),
            "node_index": list(self.node_index),
            "step_time_median_s": [_num(v) for v in medians],
            "sections": sections,
            "verdicts": [v.to_dict() for v in self.verdicts],
            "decisions": [d.to_dict() for d in self.decisions],
            "active": [v.to_dict() for v in self.active],
            "should_stop": self.should_stop,
        }

    def _median_step_times(self) -> list[float]:
        if not self.history:
            return [math.nan] * self.world_size
        arr = np.array([times for _, times in self.history], dtype=np.float64)
        return [float(v) if np.isfinite(v) else math.nan for v in _nanmedian_cols(arr)]

    def summary(self, max_rows: int = 16) -> str:
        """A compact table: the slowest ranks of the first tested section, then the verdicts."""
        name = self.sections[0]
        st = self._state[name]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = st.rel_sum / st.rel_count
        medians = self._median_step_times()
        order = sorted(range(self.world_size), key=lambda r: -(mean[r] if np.isfinite(mean[r]) else -1.0))
        lines = [
            f"straggler detection: {self.world_size} rank(s), {self.gathers} exchanges, {len(self.verdicts)} "
            f"verdict(s), {len(self.decisions)} action(s){', STOP requested' if self.should_stop else ''}",
            f"  {'rank':>4}  {'node':<16} {'step med':>9}  {name + ' rel mean':>14}  {'rel max':>7}",
        ]
        for r in order[:max_rows]:
            node = f"{self.node_index[r]}:{self.nodes[r]}"[:16]
            lines.append(
                f"  {r:>4}  {node:<16} {_fmt_s(medians[r]):>9}  {_fmt_x(mean[r]):>14}  {_fmt_x(st.rel_max[r]):>7}"
            )
        if self.world_size > max_rows:
            lines.append(f"  ... {self.world_size - max_rows} more rank(s)")
        for d in self.decisions[-8:]:
            lines.append(f"  step {d.step}: {d.action.value}: {d.verdict.describe()}")
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str]) -> Path | None:
        """PNG of the per-rank step times with the verdicts marked; None (and nothing written) without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.info("straggler: matplotlib is not installed; no plot written")
            return None
        if not self.history:
            return None
        steps = [s for s, _ in self.history]
        arr = np.array([t for _, t in self.history], dtype=np.float64)
        fig, ax = plt.subplots(figsize=(9, 4))
        for r in range(self.world_size):
            ax.plot(steps, arr[:, r] * 1e3, lw=0.8, label=f"rank {r}" if self.world_size <= 16 else None)
        for v in self.verdicts:
            ax.axvline(v.step, color="red", ls="--", lw=0.8)
            ax.annotate(f"rank {v.rank} {v.slowdown:.2f}x", (v.step, ax.get_ylim()[1]), fontsize=7, color="red")
        ax.set_xlabel("step")
        ax.set_ylabel("step time (ms)")
        ax.set_title("per-rank step time")
        if self.world_size <= 16:
            ax.legend(fontsize=7, ncol=4)
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return out


def _nanmedian_cols(arr: np.ndarray) -> np.ndarray:
    out = np.full(arr.shape[1], np.nan)
    for j in range(arr.shape[1]):
        col = arr[:, j][np.isfinite(arr[:, j])]
        if col.size:
            out[j] = float(np.median(col))
    return out


def _num(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def _fmt_s(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value * 1e3:.1f} ms"


def _fmt_x(value: float) -> str:
    return "n/a" if not np.isfinite(value) else f"{value:.2f}x"
