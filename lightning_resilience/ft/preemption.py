"""Preemption notices: a signal on any rank makes every rank stop at the same step boundary, without a collective.

The signal handler only sets a flag. At the next step boundary the rank that got it publishes a stop step through the
c10d key-value store (first writer wins, ``compare_set``); every rank checks the key at each boundary
(``store.check``, one round trip to the store, no collective) and stops once it reaches the published step.

Why ``step + 1``: data-parallel ranks run in lockstep (every optimizer step waits for the gradient all-reduce of all
ranks), so when one rank is at boundary ``k`` no rank has passed boundary ``k + 1``, but a peer may already be past
``k``. Every rank therefore stops at boundary ``k + 1``, and the key was written before any rank can get there.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import FrameType
from typing import Any

import torch.distributed as dist

__all__ = ["PreemptionNotice", "connect_store"]

log = logging.getLogger(__name__)

_KEY = "stop_step"


def connect_store(timeout: timedelta, namespace: str) -> tuple[dist.Store | None, str]:
    """A client of the job's c10d store, in a key namespace of this attempt; None (and why) when there is none.

    Prefers a new TCPStore client on ``MASTER_ADDR:MASTER_PORT`` (the store torchrun, ft_launcher and Lightning's
    launchers set up); falls back to the default process group's store.
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    store: dist.Store | None = None
    why = ""
    if addr and port:
        try:
            store = dist.TCPStore(addr, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
            why = f"TCPStore client of {addr}:{port}"
        except (RuntimeError, ValueError) as err:
            why = f"no TCPStore at {addr}:{port} ({err})"
    if store is None and dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        getter = getattr(distributed_c10d, "_get_default_store", None)
        if getter is not None:
            store = getter()
            why = f"{why}; using the default process group's store".lstrip("; ")
    if store is None:
        return None, why or "no MASTER_ADDR/MASTER_PORT and no process group"
    return dist.PrefixStore(f"lightning_resilience/ft/{namespace}/", store), why


class PreemptionNotice:
    """Turns a signal on any rank into one stop step agreed by all ranks.

    Args:
        signals: signals taken as a notice (SIGTERM, SIGUSR1, ...).
        store: the job's c10d store (namespaced per attempt), or None for a single process.
        wall_clock: wall-clock seconds, for the time the notice arrived.
    """

    def __init__(
        self,
        signals: Sequence[signal.Signals],
        store: dist.Store | None,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.signals = list(signals)
        self._store = store
        self._wall_clock = wall_clock
        self._received = threading.Event()
        self.received_signal: signal.Signals | None = None
        self.received_at: float | None = None
        self.stop_step: int | None = None
        self.published = False
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def received(self) -> bool:
        """This rank got a notice itself."""
        return self._received.is_set()

    def install(self) -> None:
        """Take over the notice signals (main thread only); :meth:`uninstall` gives them back."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption signals not installed: not on the main thread")
            return
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

    def should_stop(self, step: int) -> bool:
        """Called by every rank at every step boundary (after step ``step``): stop here?"""
        if self.stop_step is None:
            self.stop_step = self._poll(step)
        return self.stop_step is not None and step >= self.stop_step

    def _poll(self, step: int) -> int | None:
        if self._store is None:  # one process: nobody to agree with
            return step if self.received else None
        if self.received and not self.published:
            self.published = True
            agreed = int(self._store.compare_set(_KEY, "", str(step + 1)))
            log.warning(
                "preemption notice (%s) at step %d: all ranks stop after step %d", self.received_signal, step, agreed
            )
            return agreed
        try:
            if self._store.check([_KEY]):
                return int(self._store.get(_KEY))
        except (RuntimeError, OSError) as err:  # a store that went away with a peer: the peer's loss ends the step
            log.warning("preemption check at step %d could not reach the store: %s", step, err)
        return None
