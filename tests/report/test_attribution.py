"""Cause attribution: the culprit (the rank that failed first, and how) and the victims, from launcher records,
exit codes, fault notes and stack dumps; and from the run directory the real writers leave."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from lightning_resilience.attribution.engine import (
    AttemptEvidence,
    FailureKind,
    RankExit,
    Role,
    attribute,
)
from lightning_resilience.attribution.stacks import summarize_stacks
from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.ft.restart import FaultNote
from lightning_resilience.launch.records import AttemptRecord as LaunchedAttempt
from lightning_resilience.launch.records import RankEnd, append_record
from lightning_resilience.report.rundir import explain_run
from tests.report._rundir import GLOO_RESET, SPINNING, WAITING_IN_BACKWARD, stack_dump, write_job


def _note(kind: str, rank: int, at: float, message: str = "", **kw: object) -> FaultNote:
    return FaultNote(kind=kind, rank=rank, attempt=0, step=kw.pop("step", 47), detected_at=at, message=message, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- kills and errors
def test_sigkill_named_by_the_launcher_is_the_cause_and_the_peer_error_a_victim() -> None:
    ev = AttemptEvidence(
        attempt=0,
        world_size=2,
        end_reason="exception",
        exits={
            1: RankExit.from_returncode(1, -int(signal.SIGKILL), exited_at=100.0),
            0: RankExit.from_returncode(0, 1, exited_at=100.4),
        },
        notes=[_note("exception", 0, 100.2, GLOO_RESET)],
    )
    a = attribute(ev)
    assert a.outcome == "fault"
    assert a.cause is not None and a.cause.rank == 1 and a.cause.kind is FailureKind.SIGNAL
    assert "SIGKILL" in a.cause.detail and not a.cause.inferred
    assert [(v.rank, v.role, v.kind) for v in a.victims] == [(0, Role.VICTIM, FailureKind.EXCEPTION)]
    assert "Connection closed by peer" in a.victims[0].brief()


def test_the_launchers_teardown_sigterm_is_not_the_cause() -> None:
    ev = AttemptEvidence(
        attempt=0,
        world_size=3,
        exits={
            0: RankExit.from_returncode(0, -int(signal.SIGTERM), exited_at=50.5),
            1: RankExit.from_returncode(1, -int(signal.SIGTERM), exited_at=50.5),
            2: RankExit.from_returncode(2, 139, exited_at=50.1),  # a segfault, as a shell reports it
        },
    )
    a = attribute(ev)
    assert a.cause is not None and a.cause.rank == 2 and "SIGSEGV" in a.cause.detail
    assert sorted(v.rank for v in a.victims) == [0, 1]


def test_without_a_launcher_a_silent_rank_is_the_inferred_culprit() -> None:
    """Plain torchrun: rank 1 was SIGKILLed and left nothing; rank 0's collective broke (what `make demo` did)."""
    ev = AttemptEvidence(
        attempt=0, world_size=2, end_reason="exception", notes=[_note("exception", 0, 10.0, GLOO_RESET)]
    )
    a = attribute(ev)
    assert a.cause is not None and a.cause.rank == 1 and a.cause.kind is FailureKind.LOST and a.cause.inferred
    assert [v.rank for v in a.victims] == [0]
    assert "rank 1" in a.headline() and "(inferred)" in a.headline()


def test_an_exception_of_its_own_beats_a_peers_broken_collective() -> None:
    ev = AttemptEvidence(
        attempt=0,
        world_size=2,
        end_reason="exception",
        notes=[
            _note("exception", 0, 10.0, GLOO_RESET),  # rank 0 is the ledger owner and wrote first, by chance
            _note("exception", 1, 10.1, "ValueError: loss is NaN at step 47 [bold]x[/bold]"),
        ],
    )
    a = attribute(ev)
    assert a.cause is not None and a.cause.rank == 1 and a.cause.kind is FailureKind.EXCEPTION
    assert a.cause.detail.startswith("ValueError") and [v.rank for v in a.victims] == [0]


def test_the_same_error_on_every_rank_is_no_ranks_fault() -> None:
    """A bug in the script (or a bad config) fails every rank alike: there is no culprit rank and no victim."""
    message = "TypeError: Lightning can't inject a (distributed) sampler into your batch sampler"
    ev = AttemptEvidence(
        attempt=0,
        world_size=2,
        end_reason="exception",
        notes=[_note("exception", 1, 3.0, message, step=0), _note("exception", 0, 3.1, message, step=0)],
    )
    a = attribute(ev)
    assert a.cause is not None and a.cause.rank is None and a.victims == ()
    assert a.cause.detail.startswith("the same failure on ranks 0, 1: TypeError") and a.cause.at == 3.0


def test_the_launchers_first_failing_rank_is_trusted() -> None:
    ev = AttemptEvidence(
        attempt=0,
        world_size=2,
        first_failing_rank=0,
        exits={0: RankExit(0, signal=int(signal.SIGKILL)), 1: RankExit(1, signal=int(signal.SIGKILL))},
    )
    a = attribute(ev)
    assert a.cause is not None and a.cause.rank == 0 and "launcher: failed first" in a.cause.evidence


def test_nothing_left_at_all_names_no_rank() -> None:
    a = attribute(AttemptEvidence(attempt=3, world_size=2, end_reason="lost"))
    assert a.outcome == "fault" and a.cause is not None and a.cause.rank is None and a.cause.inferred


def test_a_finished_attempt_has_no_cause() -> None:
    a = attribute(AttemptEvidence(attempt=0, world_size=2, end_reason="finished"))
    assert (a.outcome, a.cause, a.victims) == ("finished", None, ())
    ok = {r: RankExit.from_returncode(r, 0) for r in range(2)}
    assert attribute(AttemptEvidence(attempt=1, world_size=2, exits=ok)).outcome == "finished"


# ------------------------------------------------------------------------------------------- job-level stops
@pytest.mark.parametrize(
    ("code", "kind", "outcome"),
    [
        (ExitCode.PREEMPTED, FailureKind.PREEMPTION, "preempted"),
        (ExitCode.STRAGGLER, FailureKind.STRAGGLER, "stopped"),
        (ExitCode.SDC, FailureKind.SDC, "stopped"),
        (ExitCode.NO_PROGRESS, FailureKind.NO_PROGRESS, "stopped"),
    ],
)
def test_a_decided_stop_ends_every_rank_with_its_code_and_makes_no_victims(
    code: ExitCode, kind: FailureKind, outcome: str
) -> None:
    exits = {r: RankExit.from_returncode(r, int(code), exited_at=20.0 + r) for r in range(4)}
    notes = [_note(kind.value, 2, 19.0, f"{kind.value} on rank 2")] if kind is not FailureKind.NO_PROGRESS else []
    a = attribute(AttemptEvidence(attempt=0, world_size=4, exits=exits, notes=notes))
    assert a.outcome == outcome and a.cause is not None and a.cause.kind is kind and a.victims == ()
    if notes:
        assert a.cause.rank == 2 and "fault note" in a.cause.evidence
    else:  # nothing says which rank triggered it: the job as a whole stopped
        assert a.cause.rank is None and a.cause.detail.startswith("ranks 0, 1, 2, 3: exited with code 88")


def test_an_agreed_preemption_without_a_launcher_blames_no_silent_rank() -> None:
    ev = AttemptEvidence(
        attempt=1, world_size=4, end_reason="preempted", notes=[_note("preemption", 3, 5.0, "SIGTERM on this rank")]
    )
    a = attribute(ev)
    assert a.outcome == "preempted" and a.cause is not None and a.cause.rank == 3 and a.victims == ()


# ------------------------------------------------------------------------------------------------- hangs
def test_stack_dumps_say_where_the_training_thread_stood() -> None:
    spinning, waiting = summarize_stacks(SPINNING), summarize_stacks(WAITING_IN_BACKWARD)
    assert spinning.innermost is not None and spinning.innermost.func == "_spin"
    assert not spinning.waits_on_peers and spinning.phase == "batch start"
    assert waiting.waits_on_peers and waiting.phase == "backward"
    assert summarize_stacks("not a dump").innermost is None


def _hang(rank: int, at: float, stuck: float) -> FaultNote:
    return _note("hang", rank, at, "section 'step' open", section="step", detection_s=stuck, stacks=f"r{rank}.txt")


def test_the_hung_rank_is_the_culprit_and_the_one_waiting_for_it_a_victim() -> None:
    # rank 0's watchdog fired first: it waits in backward's all-reduce for rank 1, which spins in a callback
    ev = AttemptEvidence(
        attempt=0,
        world_size=2,
        end_reason="hang",
        notes=[_hang(0, 100.0, 12.0), _hang(1, 100.3, 12.3)],
        stacks={0: WAITING_IN_BACKWARD, 1: SPINNING},
    )
    a = attribute(ev)
    assert a.cause is not None and a.cause.rank == 1 and a.cause.kind is FailureKind.HANG
    assert a.cause.where is not None and "_spin" in a.cause.where and "stack dump" in a.cause.evidence
    assert [v.rank for v in a.victims] == [0] and a.detection_s == pytest.approx(12.3)


def test_when_every_hung_rank_waits_in_a_collective_the_one_least_far_into_the_step_is_the_culprit() -> None:
    # rank 1 is stuck in a collective its peers never join, at the start of the step; rank 0 went on to backward
    stuck_at_start = stack_dump(
        ("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 2806, "all_reduce"),
        ("/work/tests/ft/_ft_script.py", 56, "_stuck_in_collective"),
        ("/work/tests/ft/_ft_script.py", 78, "on_train_batch_start"),
    )
    ev = AttemptEvidence(
        attempt=0,
        world_size=2,
        end_reason="hang",
        notes=[_hang(0, 100.0, 12.0), _hang(1, 100.2, 12.1)],
        stacks={0: WAITING_IN_BACKWARD, 1: stuck_at_start},
    )
    a = attribute(ev)
    assert summarize_stacks(stuck_at_start).waits_on_peers
    assert a.cause is not None and a.cause.rank == 1 and [v.rank for v in a.victims] == [0]


# --------------------------------------------------------------------------- from a run directory
def test_a_job_with_a_hang_a_preemption_and_a_kill_shows_the_three_causes(tmp_path: Path) -> None:
    _, attributions, timeline = explain_run(write_job(tmp_path))
    assert [a.outcome for a in attributions] == ["fault", "preempted", "fault", "finished"]
    hang, preempt, kill, done = attributions
    assert hang.cause is not None and (hang.cause.rank, hang.cause.kind) == (1, FailureKind.HANG)
    assert hang.cause.step == 25 and hang.cause.where is not None and "_spin" in hang.cause.where
    assert [(v.rank, v.kind) for v in hang.victims] == [(0, FailureKind.HANG)]
    assert preempt.cause is not None and (preempt.cause.rank, preempt.cause.kind) == (1, FailureKind.PREEMPTION)
    assert "SIGTERM" in preempt.cause.detail and preempt.victims == ()
    assert kill.cause is not None and (kill.cause.rank, kill.cause.kind) == (1, FailureKind.LOST)
    assert kill.cause.inferred and [v.rank for v in kill.victims] == [0]
    assert done.cause is None
    assert timeline is not None and len(timeline.attempts) == 4


def test_stack_dumps_are_found_after_the_run_directory_moved(tmp_path: Path) -> None:
    job = write_job(tmp_path / "before")
    moved = job.rename(tmp_path / "after")
    _, attributions, _ = explain_run(moved)
    cause = attributions[0].cause
    assert cause is not None and cause.where is not None and "_spin" in cause.where


def test_a_run_directory_without_a_ledger_has_nothing_to_explain(tmp_path: Path) -> None:
    records, attributions, timeline = explain_run(tmp_path)
    assert (records.attempts, attributions, timeline) == ([], [], None)


# --------------------------------------------------------------------------- with the launcher's records
def _launched(run_dir: Path, attempt: int, started: float, ended: float, ranks: list[RankEnd], **kw: Any) -> None:
    record = LaunchedAttempt(
        launch_id="l1", attempt=attempt, started_at=started, ended_at=ended, outcome=kw.pop("outcome", "failed"),
        agent_exit_code=1, ranks=ranks, cause=None, step_at_start=None, step_at_end=None, progress=False,
        no_progress_count=0, decision="restart", exit_code=None, reason="restart 1 of 2", **kw,
    )  # fmt: skip
    append_record(run_dir / "launch", record)


def test_the_launchers_records_name_the_signal_and_who_was_stopped(tmp_path: Path) -> None:
    """Under `lightning-resilience launch`: rank 1's SIGKILL is known, rank 0's broken collective is its victim."""
    run_dir = write_job(tmp_path / "run")
    _, before, _ = explain_run(run_dir)
    kill = before[2]
    ledger_start = json.loads((run_dir / "ft_ledger.json").read_text())["attempts"][2]["started_at"]
    # the writer's clock: the attempt's last step at +12 s, rank 0's note (its broken collective) at +13 s
    _launched(run_dir, 2, ledger_start - 3.0, ledger_start + 20.0, [
        RankEnd(rank=0, exit_code=1, exception={"type": "RuntimeError", "message": GLOO_RESET.split(": ", 1)[1]},
                ended_at=ledger_start + 13.5),
        RankEnd(rank=1, signal="SIGKILL", ended_at=ledger_start + 12.6),
    ], fault_notes=[  # what the launcher collected from the ledger: rank 0's note
        {"kind": "exception", "rank": 0, "step": 57, "detected_at": ledger_start + 13.0, "message": GLOO_RESET},
    ])  # fmt: skip
    # an attempt that never reached its first step: the ledger never saw it, the launcher did
    _launched(run_dir, 9, ledger_start + 500.0, ledger_start + 520.0, [
        RankEnd(rank=0, exit_code=1, exception={"type": "ImportError", "message": "no module named 'x[y]'"},
                ended_at=ledger_start + 510.0),
        RankEnd(rank=1, stopped_by_launcher=True, signal="SIGTERM", ended_at=ledger_start + 511.0),
    ])  # fmt: skip
    records, after, timeline = explain_run(run_dir)
    assert kill.cause is not None and kill.cause.kind is FailureKind.LOST  # before: inferred
    cause = after[2].cause
    assert cause is not None and (cause.rank, cause.kind) == (1, FailureKind.SIGNAL) and not cause.inferred
    assert "SIGKILL" in cause.detail and "launcher record" in cause.evidence
    assert [v.rank for v in after[2].victims] == [0] and after[2].detection_s == pytest.approx(0.4)
    # the other attempts are explained as before
    assert [a.outcome for a in after[:2]] == ["fault", "preempted"]
    extra = after[-1]
    assert len(after) == 5 and records.attempts[-1].restart_count == 9
    assert extra.cause is not None and extra.cause.rank == 0 and extra.cause.detail.startswith("ImportError")
    assert [(v.rank, "stopped by the launcher" in v.evidence) for v in extra.victims] == [(1, True)]
    assert timeline is not None and len(timeline.attempts) == 5
