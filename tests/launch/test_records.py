"""Attempt records: the culprit told apart from its victims (by the suite's attribution engine, fed what the launcher
collected), and the JSON-lines file read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_resilience.launch.analysis import evidence, name_culprit
from lightning_resilience.launch.records import (
    RECORDS_FILE,
    SCHEMA,
    AttemptRecord,
    Cause,
    RankEnd,
    append_record,
    read_records,
)

GLOO_RESET = {
    "type": "RuntimeError",
    "message": "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5550: Connection reset by peer.",
}


def attribute(ranks: list[RankEnd], notes: list[dict[str, Any]] | None = None) -> Cause | None:
    return name_culprit(ranks, evidence(0, ranks, notes or [], {}, succeeded=False))


def test_sigkilled_rank_is_the_culprit_and_its_peer_with_a_gloo_reset_the_victim() -> None:
    # the victim's own record is *earlier* than the agent's observation of the kill: time alone would blame it
    victim = RankEnd(rank=0, exit_code=1, exception=GLOO_RESET, ended_at=100.0)
    killed = RankEnd(rank=1, signal="SIGKILL", ended_at=101.0)
    cause = attribute([victim, killed])
    assert cause is not None and (cause.rank, cause.kind, cause.detail) == (1, "signal", "SIGKILL")
    assert (victim.role, killed.role) == ("victim", "culprit")


def test_an_exception_beats_a_lost_peer_and_the_first_failure_of_its_own_is_named() -> None:
    bad = RankEnd(rank=3, exit_code=1, exception={"type": "ValueError", "message": "bad batch"}, ended_at=5.0)
    peer = RankEnd(rank=0, exit_code=1, exception=GLOO_RESET, ended_at=1.0)
    cause = attribute([peer, bad])
    assert cause is not None and (cause.rank, cause.detail, cause.message) == (3, "ValueError", "bad batch")
    hung = RankEnd(rank=2, exit_code=86, ended_at=9.0)  # its watchdog fired after the bad batch
    cause = attribute([peer, bad, hung])
    assert cause is not None and cause.rank == 3
    cause = attribute([peer, RankEnd(rank=2, exit_code=86, ended_at=4.0), bad])
    assert cause is not None and (cause.rank, cause.kind, cause.detail, cause.exit_code) == (2, "verdict", "hang", 86)


def test_the_rank_that_noticed_first_is_named_among_equal_verdicts() -> None:
    ranks = [RankEnd(rank=0, exit_code=87, ended_at=10.0), RankEnd(rank=1, exit_code=87, ended_at=11.0)]
    note = {"kind": "preemption", "rank": 1, "step": 7, "detected_at": 5.0, "message": "SIGTERM on this rank"}
    cause = attribute(ranks, [note])  # rank 1 received the SIGTERM; both then exited 87
    assert cause is not None and (cause.rank, cause.detail) == (1, "preempted")
    assert [r.role for r in ranks] == ["agreed", "culprit"]  # stopped together by agreement: no victim


def test_stopped_and_teardown_signals_blame_nobody() -> None:
    finished = RankEnd(rank=0, exit_code=0, teardown_signal="SIGABRT")  # aborted in interpreter teardown
    stopped = RankEnd(rank=1, stopped_by_launcher=True)
    assert attribute([finished, stopped]) is None
    assert (finished.role, stopped.role) == ("ok", "stopped")


def _attempt(n: int) -> AttemptRecord:
    ranks = [RankEnd(rank=0, exit_code=1, exception=GLOO_RESET), RankEnd(rank=1, signal="SIGKILL")]
    return AttemptRecord(
        launch_id="abc",
        attempt=n,
        started_at=1.0,
        ended_at=2.0,
        outcome="failed",
        agent_exit_code=1,
        ranks=ranks,
        cause=attribute(ranks),
        step_at_start=None,
        step_at_end=4,
        progress=True,
        no_progress_count=0,
        decision="restart",
        exit_code=None,
        reason="restart 1 of 2",
    )


def test_records_round_trip_and_foreign_or_torn_lines_are_skipped(tmp_path: Path) -> None:
    append_record(tmp_path, _attempt(0))
    with open(tmp_path / RECORDS_FILE, "a") as f:
        f.write(json.dumps({"schema": SCHEMA + 1, "kind": "attempt", "attempt": 9}) + "\n")  # a newer format
        f.write('{"schema": 1, "kind": "attem')  # a launcher killed mid-line, before the fsync
        f.write("\n")
    append_record(tmp_path, _attempt(1))
    records = list(read_records(tmp_path))
    assert [r.attempt for r in records if isinstance(r, AttemptRecord)] == [0, 1]
    back = records[0]
    assert isinstance(back, AttemptRecord) and back == _attempt(0)
    assert back.cause is not None and back.cause.rank == 1 and back.ranks[0].role == "victim"
