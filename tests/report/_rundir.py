"""Run directories written by the real writers (the ETTR ledger, fault notes, stack dumps) on an injected clock:
a job whose attempts end in a hang, a preemption and a kill, then finish."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lightning_resilience.ft.ettr import EttrLedger
from lightning_resilience.ft.restart import FaultNote, write_fault_note

# A peer's view of a killed rank, as gloo words it (brackets included: they broke the table once).
GLOO_RESET = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
    "peer [127.0.0.1]:40123"
)


def stack_dump(*main_frames: tuple[str, int, str]) -> str:
    """A faulthandler dump: the watchdog thread (dumping), a helper thread, and the training thread whose frames
    (innermost first) are ``main_frames`` on top of Lightning's loop down to the script's ``<module>``."""
    loop = [
        ("/venv/lib/python3.11/site-packages/lightning/pytorch/loops/fit_loop.py", 217, "advance"),
        ("/venv/lib/python3.11/site-packages/lightning/pytorch/trainer/trainer.py", 1026, "_run_stage"),
        ("/venv/lib/python3.11/site-packages/lightning/pytorch/trainer/trainer.py", 561, "fit"),
        ("/work/recipes/pretrain_gpt.py", 44, "<module>"),
    ]
    frames = "\n".join(f'  File "{f}", line {n} in {fn}' for f, n, fn in [*main_frames, *loop])
    return (
        "# stacks of pid 4242 at 2026-01-01T00:00:00+0000\n"
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/work/lightning_resilience/ft/watchdog.py", line 262 in dump_stacks\n'
        '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n'
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n'
        '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n'
        f"Thread 0x00007f0000000003 (most recent call first):\n{frames}\n"
    )


SPINNING = stack_dump(
    ("/work/recipes/_resilience.py", 81, "_spin"),
    ("/work/recipes/_resilience.py", 70, "on_train_batch_start"),
    ("/venv/lib/python3.11/site-packages/lightning/pytorch/trainer/call.py", 222, "_call_callback_hooks"),
)
WAITING_IN_BACKWARD = stack_dump(
    ("/venv/lib/python3.11/site-packages/torch/autograd/graph.py", 829, "_engine_run_backward"),
    ("/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", 354, "backward"),
    ("/venv/lib/python3.11/site-packages/lightning/pytorch/core/module.py", 1098, "backward"),
    ("/work/recipes/_gpt.py", 90, "training_step"),
    ("/venv/lib/python3.11/site-packages/lightning/pytorch/core/optimizer.py", 154, "step"),
    ("/venv/lib/python3.11/site-packages/lightning/pytorch/core/module.py", 1300, "optimizer_step"),
)


class Clock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _train(ledger: EttrLedger, clock: Clock, start: int, stop: int, *, step_s: float = 0.5,
           persist_every: int = 10, restored: tuple[int, str, float] | None = None) -> None:  # fmt: skip
    rs, rf, rt = restored if restored else (None, None, None)
    ledger.first_step(start, restored_step=rs, restored_from=rf, restore_s=rt)
    for step in range(start + 1, stop + 1):
        clock.t += step_s
        committed = step - step % persist_every - persist_every  # a persist lands one interval later
        ledger.heartbeat(step, checkpoint_blocking_s=0.001 * step, persisted={"local": committed})


def write_job(run_dir: Path, *, kill_notes: Callable[[Path, Clock], None] | None = None) -> Path:
    """Four attempts under torchrun, 2 ranks, ledger and notes in ``run_dir``:

    0. rank 1 hangs at step 25 (spinning in a callback); rank 0 waits for it in backward; both watchdogs fire;
    1. restored from step 20, rank 1 gets SIGTERM (preemption) at step 40; every rank stops after step 41, saved;
    2. restored from step 41, rank 1 is SIGKILLed at step 57; rank 0's next collective breaks (connection closed);
    3. restored from step 50, finishes at step 80.
    """
    clock = Clock()
    ledger = EttrLedger(run_dir, wall_clock=clock, interval_s=0.0)

    ledger.begin_attempt(restart_count=0, launcher="torchrun", world_size=2, job_id="job")
    clock.t += 5.0
    _train(ledger, clock, 0, 25)
    stuck = clock.t
    clock.t += 12.0  # the watchdog's timeout
    stacks = run_dir / "stacks"
    stacks.mkdir(parents=True, exist_ok=True)
    (stacks / "attempt0_rank1.txt").write_text(SPINNING)
    (stacks / "attempt0_rank0.txt").write_text(WAITING_IN_BACKWARD)
    for rank, delay in ((1, 0.0), (0, 0.4)):
        write_fault_note(run_dir, FaultNote(
            kind="hang", rank=rank, attempt=0, step=25, detected_at=clock.t + delay, section="step",
            detection_s=clock.t + delay - stuck, timeout_s=12.0, stacks=str(stacks / f"attempt0_rank{rank}.txt"),
            message=f"section 'step' open for {clock.t + delay - stuck:.1f}s > timeout 12.0s (calibrated)",
        ))  # fmt: skip
    clock.t += 8.0

    ledger.begin_attempt(restart_count=1, launcher="torchrun", world_size=2, job_id="job")
    clock.t += 4.0
    _train(ledger, clock, 20, 41, restored=(20, "local", 0.25))
    write_fault_note(run_dir, FaultNote(
        kind="preemption", rank=1, attempt=1, step=41, detected_at=clock.t - 0.3,
        message="SIGTERM on this rank; stopped after step 41, saved step 41",
    ))  # fmt: skip
    ledger.end_attempt("preempted")
    clock.t += 30.0  # requeued

    ledger.begin_attempt(restart_count=0, launcher="torchrun", world_size=2, job_id="job-2")
    clock.t += 4.0
    _train(ledger, clock, 41, 57, restored=(41, "local", 0.2))
    clock.t += 1.0
    note = FaultNote(kind="exception", rank=0, attempt=0, step=57, detected_at=clock.t, message=GLOO_RESET)
    ledger.end_attempt("exception", note)
    if kill_notes is not None:
        kill_notes(run_dir, clock)
    clock.t += 6.0

    ledger.begin_attempt(restart_count=1, launcher="torchrun", world_size=2, job_id="job-2")
    clock.t += 4.0
    _train(ledger, clock, 50, 80, restored=(50, "local", 0.3))
    ledger.end_attempt("finished")
    return run_dir
