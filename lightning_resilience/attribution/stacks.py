"""Reading a hung rank's stack dump (``faulthandler`` format): where its training thread stood, and whether it
was waiting on its peers.

ByteRobust localises a hang by aggregating the stacks of every rank: the ranks stuck in a collective wait for the
one that is somewhere else. NVRx's flight-recorder attribution orders ranks by how far they got in the sequence of
collectives. A Python stack dump gives both, coarsely: the innermost frame of the training thread says whether the
rank waits in a collective (``torch.distributed``, DDP's all-reduce inside ``backward``), and the outermost
training hook on the stack says how far into the step it got.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Frame", "StackSummary", "summarize_stacks"]

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.+)$')

# How far a rank got in a training step, by the innermost of these frames on its training thread.
_PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch start", ("on_train_batch_start",)),
    ("forward", ("training_step",)),
    ("backward", ("backward", "_engine_run_backward", "manual_backward")),
    ("optimizer step", ("optimizer_step", "on_before_optimizer_step")),
    ("batch end", ("on_train_batch_end",)),
)
_PEER_WAIT_FILES = ("/torch/distributed/", "/torch/nn/parallel/distributed.py")
_PEER_WAIT_FUNCS = ("backward", "_engine_run_backward")  # DDP's all-reduce runs inside autograd's C++ engine


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def short(self) -> str:
        return f"{self.func} ({self.file.rsplit('/', 1)[-1]}:{self.line})"


@dataclass(frozen=True)
class StackSummary:
    """The training thread of one stack dump."""

    innermost: Frame | None
    """Where the training thread stood (None: no training thread found in the dump)."""
    waits_on_peers: bool
    """The innermost frame is a collective (or DDP's backward): the rank waits for another."""
    phase: str | None
    """How far into the step it got: 'batch start', 'forward', 'backward', 'optimizer step', 'batch end'."""
    frames: int

    @property
    def phase_index(self) -> int | None:
        names = [name for name, _ in _PHASES]
        return names.index(self.phase) if self.phase in names else None

    def describe(self) -> str:
        if self.innermost is None:
            return "no training thread in the stack dump"
        where = f"in {self.innermost.short()}"
        if self.phase is not None:
            where += f" during {self.phase}"
        return where + (" (waiting on peers)" if self.waits_on_peers else "")


def _threads(text: str) -> list[tuple[bool, list[Frame]]]:
    """(is the dumping thread, frames innermost first) of every thread block in a faulthandler dump."""
    threads: list[tuple[bool, list[Frame]]] = []
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head is not None:
            threads.append((head.group(1) == "Current thread", []))
            continue
        frame = _FRAME.match(line)
        if frame is not None and threads:
            threads[-1][1].append(Frame(frame["file"], int(frame["line"]), frame["func"].strip()))
    return threads


def _is_main(frames: list[Frame]) -> bool:
    outer = frames[-1]
    return outer.func == "<module>" or (outer.file.endswith("runpy.py") and outer.func.startswith("_run_"))


def summarize_stacks(text: str) -> StackSummary:
    """Summarize a ``faulthandler.dump_traceback(all_threads=True)`` dump (written by the watchdog on a hang).

    The training thread is the one whose outermost frame is the program's ``<module>``; the dumping thread (the
    watchdog) is skipped; without a main thread, the deepest other thread stands in for it.
    """
    threads = [(current, frames) for current, frames in _threads(text) if frames]
    candidates = [frames for current, frames in threads if not current and _is_main(frames)]
    if not candidates:
        candidates = sorted((f for current, f in threads if not current), key=len, reverse=True)[:1]
    if not candidates:
        return StackSummary(None, False, None, 0)
    frames = candidates[0]
    inner = frames[0]
    waits = any(part in inner.file for part in _PEER_WAIT_FILES) or (
        "/torch/" in inner.file and inner.func in _PEER_WAIT_FUNCS
    )
    phase = next(
        (name for frame in frames for name, funcs in _PHASES if frame.func in funcs),
        None,
    )
    return StackSummary(inner, waits, phase, len(frames))
