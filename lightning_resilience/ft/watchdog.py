"""Hang detection for one rank: a watchdog thread times named sections against calibrated timeouts.

The training thread reports where it is (``watchdog.switch("step")``); the watchdog thread sleeps until the current
section's deadline (at most ``max_wait_s``) and, when a section outlives its timeout, hands a :class:`Hang` to the
``on_hang`` handler. A switch wakes the thread only when the new section's deadline comes before the thread's own
wake-up: on an ordinary step (a timeout longer than the wait) the training thread sets no event and causes no
thread switch. The default handler (:class:`HangHandler`) dumps every thread's stack, writes a fault note
and ends the process with ``ExitCode.HANG``: the main thread is stuck, so nothing else can end it.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from lightning_resilience._lifetime import end_daemon_children
from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.ft.restart import FaultNote, write_fault_note
from lightning_resilience.rundir import RunDir

__all__ = ["ChildCheck", "Hang", "HangHandler", "TimeoutCalibrator", "Watchdog", "dump_stacks"]

log = logging.getLogger(__name__)

_CHILDREN_GRACE_S = 1.0
"""How long a hung rank's daemonic children get to end on SIGTERM before they are killed with it."""
_CHILDREN_EVERY_S = 2.0
"""How often the thread looks for children stuck in their fork."""

OUT_OF_SECTION = "out_of_section"


@dataclass
class _Timing:
    samples: int = 0
    longest_s: float = 0.0
    timeout_s: float | None = None  # None until calibrated
    provisional_s: float | None = None  # after a first observation, until calibrated


class TimeoutCalibrator:
    """Per-section timeouts: initial values until warmed up, then ``safety_factor`` x the longest observation.

    A calibrated timeout only grows during a run (a longer legitimate section raises it) and is clamped to
    ``[min_s, max_s]``. A hung section never ends, so it never raises its own timeout. Between a section's first
    observation and its warm-up, a provisional timeout of ``provisional_factor`` x the calibrated rule holds (never
    above the initial value): the first step carries compilation and allocator warm-up, so a step after it that runs
    ten times longer than any seen is a hang, not a slow start.

    Args:
        initial: timeout per section before calibration.
        safety_factor: multiplier on the longest observed duration.
        warmup: observations needed per section before calibrating (sections not named: 1).
        min_s: lower bound of a calibrated timeout.
        max_s: upper bound of a calibrated timeout.
        enabled: False keeps the initial timeouts for good.
        sections: the sections to calibrate (None: all); the others keep their initial timeouts.
        provisional_factor: multiplier on the calibrated rule before warm-up (0: the initial timeout until then).
    """

    def __init__(
        self,
        initial: Mapping[str, float],
        *,
        safety_factor: float = 5.0,
        warmup: Mapping[str, int] | None = None,
        min_s: float = 60.0,
        max_s: float = 3600.0,
        enabled: bool = True,
        sections: Collection[str] | None = None,
        provisional_factor: float = 0.0,
    ) -> None:
        self.initial = dict(initial)
        self.provisional_factor = provisional_factor
        self.sections = None if sections is None else set(sections)
        self.safety_factor = safety_factor
        self.warmup = dict(warmup or {})
        self.min_s, self.max_s = min_s, max_s
        self.enabled = enabled
        self._timings: dict[str, _Timing] = {}

    def timeout(self, section: str) -> float:
        """Seconds ``section`` may last before it counts as hung (``inf`` for an unknown section)."""
        timing = self._timings.get(section)
        if timing is not None and timing.timeout_s is not None:
            return timing.timeout_s
        if timing is not None and timing.provisional_s is not None:
            return timing.provisional_s
        return self.initial.get(section, math.inf)

    def calibrated(self, section: str) -> bool:
        return self.basis(section) == "calibrated"

    def basis(self, section: str) -> str:
        """Where ``section``'s timeout comes from: 'calibrated', 'provisional' or 'initial'."""
        timing = self._timings.get(section)
        if timing is not None and timing.timeout_s is not None:
            return "calibrated"
        return "provisional" if timing is not None and timing.provisional_s is not None else "initial"

    def observe(self, section: str, seconds: float) -> None:
        """Record one completed ``section`` of ``seconds``."""
        timing = self._timings.setdefault(section, _Timing())
        timing.samples += 1
        timing.longest_s = max(timing.longest_s, seconds)
        if not self._calibrates(section):
            return
        if timing.samples >= self.warmup.get(section, 1):
            proposed = min(max(self.safety_factor * timing.longest_s, self.min_s), self.max_s)
            timing.timeout_s = max(timing.timeout_s or 0.0, proposed)
        elif self.provisional_factor > 0:
            early = max(self.provisional_factor * self.safety_factor * timing.longest_s, self.min_s)
            early = min(early, self.max_s, self.initial.get(section, math.inf))
            timing.provisional_s = max(timing.provisional_s or 0.0, early)

    def _calibrates(self, section: str) -> bool:
        return self.enabled and (self.sections is None or section in self.sections)

    def timeouts(self) -> dict[str, float]:
        return {name: self.timeout(name) for name in sorted({*self.initial, *self._timings})}

    def state_dict(self) -> dict[str, Any]:
        return {name: asdict(t) for name, t in self._timings.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Adopt timings of an earlier attempt: a restart starts calibrated (never below what it saw already)."""
        for name, saved in state.items():
            calibrated = saved.get("timeout_s") if self._calibrates(name) else None
            provisional = saved.get("provisional_s") if self._calibrates(name) else None
            loaded = _Timing(int(saved["samples"]), float(saved["longest_s"]), calibrated, provisional)
            mine = self._timings.get(name)
            if mine is None:
                self._timings[name] = loaded
                continue
            mine.samples += loaded.samples
            mine.longest_s = max(mine.longest_s, loaded.longest_s)
            if loaded.timeout_s is not None:
                mine.timeout_s = max(mine.timeout_s or 0.0, loaded.timeout_s)
            if loaded.provisional_s is not None:
                mine.provisional_s = max(mine.provisional_s or 0.0, loaded.provisional_s)


@dataclass(frozen=True)
class Hang:
    """What the watchdog saw: ``section`` has been open ``stuck_for_s`` > ``timeout_s``."""

    section: str
    step: int
    stuck_for_s: float
    timeout_s: float
    basis: str
    """'calibrated', 'provisional' or 'initial' (see :meth:`TimeoutCalibrator.basis`)."""

    @property
    def calibrated(self) -> bool:
        return self.basis == "calibrated"


class ChildCheck(Protocol):
    """What the watchdog's thread calls every few seconds: find the children stuck in their fork and kill them
    (:class:`~lightning_resilience._lifetime.StuckForks`); returns their pids."""

    def check(self) -> list[int]: ...


class Watchdog:
    """Times the sections of one rank on an owned daemon thread; calls ``on_hang`` once when one overruns.

    Args:
        calibrator: timeouts per section, updated with every completed section.
        on_hang: called on the watchdog thread with the :class:`Hang`; the default handler ends the process.
        clock: monotonic seconds, injectable for tests (then wake the thread with :meth:`poke`).
        max_wait_s: longest sleep of the thread between two checks.
        children: this process's children stuck in their fork, checked by the thread every few seconds (killed:
            whoever waits for them, a loader, fails instead of waiting for a section's timeout).
    """

    def __init__(
        self,
        calibrator: TimeoutCalibrator,
        on_hang: Callable[[Hang], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        max_wait_s: float = 1.0,
        children: ChildCheck | None = None,
    ) -> None:
        self.calibrator = calibrator
        self._children = children
        self._children_at = -math.inf
        self._on_hang = on_hang
        self._clock = clock
        self._max_wait_s = max_wait_s
        self._lock = threading.Lock()
        self._section: str | None = None
        self._since = 0.0
        self.step = 0
        self._wake = threading.Event()
        self._wake_at = math.inf  # when the thread next checks by itself (clock time; inf: not known, so wake it)
        self.wakes = 0
        """Switches that had to wake the thread (their deadline came before its own wake-up)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.fired: Hang | None = None

    @property
    def section(self) -> str | None:
        return self._section

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="lightning-resilience-watchdog", daemon=True)
        self._thread.start()

    def switch(self, section: str | None, step: int | None = None) -> float | None:
        """Leave the open section (recording its duration) and open ``section`` (None: time nothing).

        Returns the duration of the section just left, if any.
        """
        now = self._clock()
        with self._lock:
            left, since = self._section, self._since
            self._section, self._since = section, now
            if step is not None:
                self.step = step
        elapsed = None
        if left is not None:
            elapsed = now - since
            self.calibrator.observe(left, elapsed)
        if section is not None:
            deadline = now + self.calibrator.timeout(section)
            with self._lock:
                wake = deadline < self._wake_at  # the thread would check too late (or its time is not known)
                if wake:
                    self._wake_at = math.inf
            if wake:
                self.wakes += 1
                self._wake.set()
        return elapsed

    def poke(self) -> None:
        """Wake the thread to check now (after a fake clock moved, or timeouts were loaded)."""
        self._wake.set()

    def check(self) -> Hang | None:
        """The hang, if the open section has outlived its timeout now."""
        with self._lock:
            section, since, step = self._section, self._since, self.step
        if section is None:
            return None
        timeout = self.calibrator.timeout(section)
        stuck = self._clock() - since
        if stuck > timeout:
            return Hang(section, step, stuck, timeout, self.calibrator.basis(section))
        return None

    def next_check(self) -> float:
        """Seconds until the thread's next check by itself (the open section's deadline and a small margin, so that
        the check sees it overrun; at most ``max_wait_s``), recorded as its wake-up time: a :meth:`switch` to a
        section due earlier wakes it. The thread calls it before each wait."""
        with self._lock:
            section, since = self._section, self._since
            now = self._clock()
            left = math.inf if section is None else self.calibrator.timeout(section) - (now - since)
            wait = min(max(left + 0.01, 0.001), self._max_wait_s)
            self._wake_at = now + wait
        return wait

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                hang = self.check()
                if hang is not None:
                    self.fired = hang
                    self._on_hang(hang)
                    return
                self._check_children()
                self._wake.wait(self.next_check())
        except BaseException as err:  # re-raised on the training thread by stop()
            self._error = err

    def _check_children(self) -> None:
        if self._children is None:
            return
        now = self._clock()
        if now - self._children_at >= _CHILDREN_EVERY_S:
            self._children_at = now
            self._children.check()

    def stop(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Stop and join the thread (bounded); re-raise an error it hit."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout.total_seconds())
            if thread.is_alive():
                log.error("watchdog thread did not stop within %s", timeout)
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("the watchdog thread failed") from err


def dump_stacks(path: Path) -> Path:
    """Write every thread's Python stack of this process to ``path`` (``faulthandler``, safe while others hang)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"# stacks of pid {os.getpid()} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
        f.flush()
        os.fsync(f.fileno())
    return path


class HangHandler:
    """The default reaction to a hang: dump stacks, write a fault note, then end the rank with ExitCode.HANG.

    Args:
        run_dir: the run directory (stacks under ``stacks/``, notes under ``faults/``).
        rank: global rank of this process.
        attempt: restart count of this attempt (names the files).
        dump: write the stack dump.
        exit: end the process; False only logs (the main thread stays stuck).
        wall_clock: wall-clock seconds for the note.
    """

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        attempt: int,
        *,
        dump: bool = True,
        exit: bool = True,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.run_dir, self.rank, self.attempt = run_dir, rank, attempt
        self.dump, self.exit = dump, exit
        self._wall_clock = wall_clock

    def __call__(self, hang: Hang) -> None:
        try:
            self._record(hang)
        finally:
            if self.exit:
                # the training thread is stuck (a Python loop or a collective): nothing else can end this process,
                # and a failure to record the hang must not keep it alive; nor may its daemonic children (a loader
                # worker stuck since its fork would outlive it, and hold the launcher's output open)
                try:
                    end_daemon_children(_CHILDREN_GRACE_S)
                finally:
                    for handler in logging.getLogger().handlers:
                        handler.flush()
                    os._exit(int(ExitCode.HANG))

    def _record(self, hang: Hang) -> None:
        stacks = None
        if self.dump:
            try:
                stacks = dump_stacks(RunDir(self.run_dir).stack_dump(self.attempt, self.rank))
            except OSError as err:
                log.error("could not dump stacks to %s: %s", self.run_dir, err)
        note = FaultNote(
            kind="hang",
            rank=self.rank,
            attempt=self.attempt,
            step=hang.step,
            detected_at=self._wall_clock(),
            section=hang.section,
            detection_s=hang.stuck_for_s,
            timeout_s=hang.timeout_s,
            message=f"section {hang.section!r} open for {hang.stuck_for_s:.1f}s > timeout {hang.timeout_s:.1f}s"
            f" ({hang.basis})",
            stacks=str(stacks) if stacks else None,
        )
        log.critical(
            "rank %d hung in section %r at step %d: %s; stacks in %s",
            self.rank,
            hang.section,
            hang.step,
            note.message,
            stacks,
        )
        write_fault_note(self.run_dir, note)
