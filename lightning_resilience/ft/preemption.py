"""Preemption notices: a signal on any rank makes every rank stop at the same step boundary, with no extra wait.

The signal handler only sets a flag. The flag is this rank's field of the next step's one agreement
(:mod:`lightning_resilience.step`, reduced by OR): it is contributed at the start of the step after the signal and
agreed by its end, where every rank stops together. A notice that arrives during step ``k`` therefore stops every
rank at the end of step ``k + 1`` (one step later, with no store poll and no collective of its own), whatever rank
got it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from lightning_resilience._lifetime import end_daemon_children_at_exit
from lightning_resilience.policy import Event, Verdict
from lightning_resilience.step.agreement import Op
from lightning_resilience.step.driver import Field

__all__ = ["PreemptionNotice"]

log = logging.getLogger(__name__)


class PreemptionNotice:
    """Turns a signal on any rank into one stop step agreed by all ranks (a step driver's contributor).

    Args:
        signals: signals taken as a notice (SIGTERM, SIGUSR1, ...).
        rank: this rank (named in the verdict).
        wall_clock: wall-clock seconds, for the time the notice arrived.
    """

    def __init__(
        self,
        signals: Sequence[signal.Signals],
        *,
        rank: int = 0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.signals = list(signals)
        self.rank = rank
        self._wall_clock = wall_clock
        self._received = threading.Event()
        self.received_signal: signal.Signals | None = None
        self.received_at: float | None = None
        self.stop_step: int | None = None
        """The step boundary every rank stops at (None until agreed)."""
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def received(self) -> bool:
        """This rank got a notice itself."""
        return self._received.is_set()

    def install(self) -> None:
        """Take over the notice signals (main thread only); :meth:`uninstall` gives them back.

        A child forked meanwhile (a loader worker) inherits the handler until it sets its own; one stuck before it
        could (a fork beside a thread holding an interpreter lock) would outlive SIGTERM and hold the exit of this
        process: its daemonic children are ended at exit, killed if SIGTERM does not do it
        (:func:`~lightning_resilience._lifetime.end_daemon_children_at_exit`)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals not installed: not on the main thread")
            return
        end_daemon_children_at_exit()
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # a signal handler: set flags only; the agreement happens at the next step boundary
        if not self._received.is_set():
            self.received_signal = signal.Signals(signum)
            self.received_at = self._wall_clock()
        self._received.set()

    def notify(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Record a notice as if ``sig`` had arrived (a scheduler API, a test)."""
        self._handle(int(sig), None)

    # ------------------------------------------------------------------ the step's agreement
    def step_fields(self) -> list[Field]:
        return [Field("ft.preemption", Op.OR)]

    def contribute(self, step: int) -> list[int]:
        return [int(self.received)]

    def agreed(self, step: int, values: Sequence[int]) -> list[Verdict]:
        """Some rank got a notice: every rank stops at the end of this step (the first agreement holds)."""
        if not values[0] or self.stop_step is not None:
            return []
        self.stop_step = step
        here = (
            f"{self.received_signal.name if self.received_signal else 'notice'} on this rank" if self.received else ""
        )
        detail = f"preemption notice{' (' + here + ')' if here else ' on another rank'}, agreed at step {step}"
        log.warning("rank %d: %s; every rank stops at the end of this step", self.rank, detail)
        return [Verdict(Event.PREEMPTION, step, self.rank, detail, "ft")]
