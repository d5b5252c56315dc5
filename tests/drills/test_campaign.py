"""The bounded CI subset of the fault campaign (``make drills`` runs the rest; docs/reliability.md has its table).

``CAMPAIGN_CI_N`` drills (default 10) of ``tests/drills/campaign.py``, drawn from a seed that rotates with the date
(``DRILL_SEED`` overrides it), each a real torchrun job of the user's path with one random fault, checked bitwise
and for lost steps, corrupt loads, deadlines and leftover processes. One uninterrupted reference run per loader
configuration serves every drill. A failure names the command that replays it: ``make drills N=1 SEED=<seed>``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.drills._harness import Drill, DrillResult, LaunchTimeout, _run_bounded
from tests.drills.campaign import (
    DOCS,
    FAULTS,
    FULL_DISK_UNAVAILABLE,
    Outcome,
    References,
    before_after,
    check,
    draw,
    leftovers,
    rendered,
    run_one,
)

SEED = int(os.environ.get("DRILL_SEED", time.strftime("%Y%m%d", time.gmtime())))
N = int(os.environ.get("CAMPAIGN_CI_N", "10"))


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory.mktemp("references"))


def test_every_fault_kind_can_be_drawn() -> None:
    drawn = {draw(seed).fault for seed in range(200)}
    assert drawn == set(FAULTS[1:])
    assert {draw(seed, faults=("enospc",)).fault for seed in range(5)} == {"enospc"}


def test_the_docs_table_is_generated_from_the_published_results() -> None:
    text = DOCS.read_text()
    assert rendered(text) == text, "docs/reliability.md is stale: run `python -m tests.drills.campaign --docs-only`"


def _campaign(commit: str, variant: str, recovery: float, recomputed: int, faults: str = "sigkill") -> dict:
    drill = {"fault": "sigkill", "problems": [], "recovery_s": recovery, "recomputed": [recomputed], "faults": faults}
    return {"commit": commit, "variant": variant, "overrides": "x=1" if variant else "", "command": "make drills",
            "drills": [drill, drill]}  # fmt: skip


def test_a_variant_is_set_against_the_default_of_the_same_commit_and_filter(tmp_path: Path) -> None:
    before, after = _campaign("abc", "in-process", 8.0, 7), _campaign("abc", "", 2.5, 1)
    other_commit, other_filter = _campaign("def", "", 1.0, 0), _campaign("abc", "", 1.0, 0, faults="node-loss")
    lines = before_after([before, after, other_commit, other_filter])
    assert "| sigkill | 2/2 | 2/2 | 8.0 | 2.5 | 7 / 7 | 1 / 1 |" in lines
    assert sum(line.startswith("| sigkill") for line in lines) == 1
    assert before_after([before, other_commit]) == []  # nothing to compare with: no table
    extra = {"seed": 1, "n": 2, "steps": 40, "elapsed_s": 60, "machine": "m", "date": "d"}
    for name, campaign in (("1_in-process", before), ("1", after)):
        (tmp_path / f"drill_campaign_{name}.json").write_text(json.dumps(campaign | extra))
    out = rendered("<!-- drill-campaign:begin -->\n<!-- drill-campaign:end -->", results_dir=tmp_path)
    assert "| sigkill | 2 | 2 | 0 | 2.5 | 2.5 |" in out  # the table holds the default's drills only
    assert "| sigkill | 2/2 | 2/2 | 8.0 | 2.5 | 7 / 7 | 1 / 1 |" in out


def _fake_run(
    run_dir: Path,
    restored: int | None,
    damaged: int | None,
    weights: torch.Tensor,
    tier: str | None = None,
    restored_from: str = "local",
    elsewhere: dict[str, list[int]] | None = None,
) -> DrillResult:
    """What a drill leaves: a fault record at t=100 (damaging ``tier``'s copy of ``damaged``; None: every copy),
    attempt 0 before it, attempt 1 after it restoring ``restored`` from ``restored_from``, with steps 10 and 20
    committed on both ranks (``elsewhere``: held by tiers other than the disk)."""
    (run_dir / "reports").mkdir(parents=True)
    fault = {"time": 100.0, "kind": "corrupt-shard", "damaged": damaged} | ({"tier": tier} if tier else {})
    (run_dir / "faults.jsonl").write_text(json.dumps(fault))
    for rank in (0, 1):
        before = {"committed": {}, "start_time": 10.0, "restored_step": None, "first_step_time": 11.0}
        after = {"committed": {"10": [0, 1], "20": [0, 1]}, "elsewhere": elsewhere or {}, "start_time": 120.0}
        after |= {"restored_step": restored, "restored_from": restored_from, "first_step_time": 130.0}
        after |= {"final_step": 40}
        (run_dir / "reports" / f"launch0_attempt0_rank{rank}.json").write_text(json.dumps(before))
        (run_dir / "reports" / f"launch0_attempt1_rank{rank}.json").write_text(json.dumps(after))
    torch.save({"w": weights}, run_dir / "weights.pt")
    return DrillResult(Drill(fault="corrupt-shard", step=25), run_dir)


ONES = torch.ones(3)
IN_RAM = {"20": [0, 1]}
OLDER = "restored step 10, but the newest step committed on every rank was 20"


@pytest.mark.parametrize(
    ("restored", "damaged", "weights", "problem", "tier", "restored_from", "elsewhere"),
    [
        (20, None, ONES, None, None, "local", None),
        (20, 20, ONES, "loaded the damaged step 20", None, "local", None),
        (10, None, ONES, OLDER, None, "local", None),
        (10, 20, ONES, None, None, "local", None),
        (20, None, torch.tensor([1.0, 1.0, 1.5]), "final weights differ", None, "local", None),
        # the disk's shard of 20 is damaged; the RAM tier's copy of 20, whole on every rank, is not
        (20, 20, ONES, None, "local", "memory", IN_RAM),
        (20, 20, ONES, "loaded the damaged step 20", "local", "local", IN_RAM),
        (10, 20, ONES, OLDER, "local", "local", IN_RAM),
        (10, 20, ONES, None, "local", "local", {"20": [1]}),
        # a half-made RAM snapshot: the RAM tier's copy is the damaged one
        (20, 20, ONES, "loaded the damaged step 20", "memory", "memory", IN_RAM),
    ],
)
def test_check_names_every_broken_invariant(
    tmp_path: Path,
    restored: int,
    damaged: int | None,
    weights: torch.Tensor,
    problem: str | None,
    tier: str | None,
    restored_from: str,
    elsewhere: dict[str, list[int]] | None,
) -> None:
    outcome = Outcome(1, "corrupt-shard", 1, 25, 0, "local")
    run = _fake_run(tmp_path, restored, damaged, weights, tier, restored_from, elsewhere)
    check(run, {"w": torch.ones(3)}, outcome)
    if problem is None:
        assert outcome.ok, outcome.problems
        assert outcome.recovery_s == 30.0
    else:
        assert any(problem in p for p in outcome.problems), outcome.problems


def test_a_process_left_behind_is_named_and_ended(tmp_path: Path) -> None:
    code = "import sys, threading; threading.Event().wait(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)])
    try:
        left = leftovers(tmp_path, grace_s=0.5)
        assert len(left) == 1 and f"pid {proc.pid}" in left[0], left
        assert proc.wait(timeout=10) != 0
    finally:
        proc.kill()
    assert leftovers(tmp_path, grace_s=0.5) == []


@pytest.mark.slow
@pytest.mark.parametrize("index", range(N))
def test_random_drill(tmp_path: Path, references: References, index: int) -> None:
    outcome: Outcome = run_one(SEED + index, references, tmp_path)
    if any(p.startswith(FULL_DISK_UNAVAILABLE) for p in outcome.problems):
        pytest.skip(f"seed {outcome.seed}: {outcome.problems[0]}")
    print(f"drill seed {outcome.seed}: {outcome.fault} rank {outcome.rank} step {outcome.step}, recovered in "
          f"{outcome.recovery_s} s, restored {outcome.restored}")  # fmt: skip
    assert outcome.ok, f"{outcome.problems}; replay: {outcome.replay()} (run dir {outcome.run_dir})"


def test_a_launch_past_its_bound_is_ended_with_the_processes_it_started(tmp_path: Path) -> None:
    # the child goes to a session of its own, as torchrun's ranks do
    child = f"import threading; threading.Event().wait(60)  # {tmp_path}"
    code = (
        "import subprocess, sys, threading; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}, {str(tmp_path)!r}], start_new_session=True); "
        "threading.Event().wait(60)"
    )
    with pytest.raises(LaunchTimeout) as ended:
        _run_bounded([sys.executable, "-c", code, str(tmp_path)], dict(os.environ), timeout_s=3)
    assert leftovers(tmp_path, grace_s=5) == []
    # where each process stood at the bound comes with it: both waits, each under its own process
    evidence = ended.value.evidence()
    assert evidence.count("Process ") == 2 and evidence.count("(threading.py:") >= 2, evidence
