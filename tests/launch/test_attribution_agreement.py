"""The launcher and the report name the same culprit: both read the same run directory (what torchrun's agent saw,
each rank's record, the fault notes, the stack dumps, the ledger) through ``RunDir`` and judge it with the one
attribution engine. Each case writes the files a real attempt leaves, then asks both consumers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_resilience.attribution.engine import FailureKind
from lightning_resilience.ft.ettr import EttrLedger
from lightning_resilience.ft.restart import FaultNote, write_fault_note
from lightning_resilience.launch.analysis import analyse
from lightning_resilience.launch.records import AttemptRecord, append_record
from lightning_resilience.report.rundir import explain_run
from lightning_resilience.rundir import RunDir
from tests.report._rundir import GLOO_RESET, SPINNING, WAITING_IN_BACKWARD, Clock

T0 = 1_000.0
_LAUNCHER_KIND = {FailureKind.SIGNAL: "signal", FailureKind.EXCEPTION: "exception", FailureKind.LOST: "lost"}


def _rank(run: RunDir, rank: int, **end: object) -> None:
    path = run.launch().rank_record(0, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "local_rank": rank, "pid": 100 + rank, "started_at": T0, **end}))


def _outcome(run: RunDir, failures: dict[int, dict[str, object]]) -> None:
    data = {"result": "failed", "failures": {str(r): {"local_rank": r, **f} for r, f in failures.items()}}
    run.launch().outcome(0).write_text(json.dumps(data))


def _note(run: RunDir, kind: str, rank: int, at: float, **kw: object) -> None:
    write_fault_note(run.root, FaultNote(kind=kind, rank=rank, attempt=0, step=25, detected_at=at, pid=7, **kw))


def killed_with_a_victim_reporting_first(run: RunDir) -> None:
    _rank(run, 0, exit_code=1, ended_at=T0 + 9.0, exception={"type": "RuntimeError", "message": GLOO_RESET})
    _rank(run, 1)  # SIGKILLed: only its start
    _outcome(run, {0: {"exitcode": 1, "timestamp": T0 + 9}, 1: {"exitcode": -9, "timestamp": T0 + 10}})
    _note(run, "exception", 0, T0 + 9.0, message=GLOO_RESET)


def hang_where_the_waiting_rank_noticed_first(run: RunDir) -> None:
    # rank 0 waits in backward for rank 1, which spins in a callback; rank 0's watchdog fires first
    for rank, text in ((0, WAITING_IN_BACKWARD), (1, SPINNING)):
        run.stack_dump(0, rank).parent.mkdir(parents=True, exist_ok=True)
        run.stack_dump(0, rank).write_text(text)
        _rank(run, rank)  # the watchdog ends the process with os._exit(86): no end record
    _outcome(run, {0: {"exitcode": 86, "timestamp": T0 + 31}, 1: {"exitcode": 86, "timestamp": T0 + 32}})
    for rank, at in ((0, T0 + 30.0), (1, T0 + 30.5)):
        _note(run, "hang", rank, at, section="step", detection_s=12.0, stacks=str(run.stack_dump(0, rank)))


def preemption_noticed_on_one_rank(run: RunDir) -> None:
    ledger = EttrLedger(run.root, wall_clock=Clock(T0), interval_s=0.0)
    ledger.begin_attempt(restart_count=0, launcher="lightning-resilience", world_size=2, job_id="job")
    note = FaultNote(kind="preemption", rank=0, attempt=0, step=25, detected_at=T0 + 5.0, message="SIGTERM")
    ledger.end_attempt("preempted", note)
    for rank in (0, 1):
        _rank(run, rank, exit_code=87, ended_at=T0 + 8.0 - rank)  # rank 1 happened to exit first
    _outcome(run, {0: {"exitcode": 87}, 1: {"exitcode": 87}})


def a_bad_batch_and_a_broken_collective(run: RunDir) -> None:
    _rank(run, 0, exit_code=1, ended_at=T0 + 3.0, exception={"type": "RuntimeError", "message": GLOO_RESET})
    _rank(run, 1, exit_code=1, ended_at=T0 + 4.0, exception={"type": "ValueError", "message": "bad batch"})
    _outcome(run, {0: {"exitcode": 1}, 1: {"exitcode": 1}})


def the_same_error_on_every_rank(run: RunDir) -> None:
    for rank in (0, 1):
        _rank(run, rank, exit_code=1, ended_at=T0 + rank, exception={"type": "KeyError", "message": "'lr'"})
    _outcome(run, {0: {"exitcode": 1}, 1: {"exitcode": 1}})


@pytest.mark.parametrize(
    ("write", "rank", "kind"),
    [
        (killed_with_a_victim_reporting_first, 1, "signal"),
        (hang_where_the_waiting_rank_noticed_first, 1, "verdict"),
        (preemption_noticed_on_one_rank, 0, "verdict"),
        (a_bad_batch_and_a_broken_collective, 1, "exception"),
        (the_same_error_on_every_rank, None, "exception"),
    ],
)
def test_the_launcher_and_the_report_name_the_same_culprit(
    tmp_path: Path, write: Callable[[RunDir], None], rank: int | None, kind: str
) -> None:
    run = RunDir(tmp_path / "run")
    run.launch().attempt(0).mkdir(parents=True)
    write(run)

    end = analyse(run, run.launch(), 0, nproc_per_node=2)  # the launcher, right after the attempt
    assert not end.succeeded and end.cause is not None
    record = AttemptRecord(
        launch_id="l1", attempt=0, started_at=T0 - 1.0, ended_at=T0 + 40.0, outcome=end.result, agent_exit_code=1,
        ranks=end.ranks, cause=end.cause, step_at_start=None, step_at_end=None, progress=False, no_progress_count=1,
        decision="restart", exit_code=None, reason="restart 1 of 2", hang_dumps=end.hang_dumps,
        fault_notes=end.fault_notes,
    )  # fmt: skip
    append_record(run.launch().root, record)

    _, attributions, _ = explain_run(tmp_path / "run")  # the report, later, on any machine
    found = attributions[-1].cause
    assert found is not None
    launcher_kind = _LAUNCHER_KIND.get(found.kind, "verdict")
    assert (end.cause.rank, end.cause.kind) == (found.rank, launcher_kind) == (rank, kind)
    victims = sorted(v.rank for v in attributions[-1].victims if v.rank is not None)
    assert victims == sorted(r.rank for r in end.ranks if r.role == "victim")
