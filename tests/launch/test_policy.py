"""The restart policy: done, restart, or stop with the code the scheduler acts on."""

from __future__ import annotations

import signal

import pytest

from lightning_resilience.exit_codes import ExitCode
from lightning_resilience.launch.policy import FAILED, INTERRUPTED, RestartPolicy

POLICY = RestartPolicy(max_restarts=3, max_no_progress_restarts=2)


def decide(**kwargs: object) -> tuple[str, int | None]:
    args: dict[str, object] = {"succeeded": False, "restarts_done": 0, "no_progress_count": 0, "culprit_exit_code": 1}
    d = POLICY.decide(**{**args, **kwargs})  # type: ignore[arg-type]
    return d.action, d.exit_code


def test_finished_is_done_with_zero() -> None:
    assert decide(succeeded=True, no_progress_count=5) == ("done", 0)


def test_a_failure_with_budget_left_restarts() -> None:
    assert decide(culprit_exit_code=None) == ("restart", None)  # a SIGKILL
    assert decide(culprit_exit_code=int(ExitCode.HANG), restarts_done=2, no_progress_count=1) == ("restart", None)
    assert decide(culprit_exit_code=int(ExitCode.PREEMPTED)) == ("restart", None)  # a notice to ranks, not to us


def test_no_progress_stops_with_its_code_before_the_budget_is_spent() -> None:
    assert decide(no_progress_count=2) == ("stop", int(ExitCode.NO_PROGRESS))
    # and wins over "restarts used up": the scheduler must not requeue a job that cannot progress
    assert decide(no_progress_count=2, restarts_done=3) == ("stop", int(ExitCode.NO_PROGRESS))
    off = RestartPolicy(max_restarts=3, max_no_progress_restarts=0)
    kwargs = {"succeeded": False, "restarts_done": 0, "no_progress_count": 9, "culprit_exit_code": 1}
    assert off.decide(**kwargs).action == "restart"  # type: ignore[arg-type]


@pytest.mark.parametrize(("culprit", "code"), [(1, FAILED), (None, FAILED), (int(ExitCode.HANG), int(ExitCode.HANG))])
def test_restarts_used_up_pass_the_culprits_verdict_on(culprit: int | None, code: int) -> None:
    assert decide(restarts_done=3, culprit_exit_code=culprit) == ("stop", code)


@pytest.mark.parametrize("verdict", [ExitCode.STRAGGLER, ExitCode.SDC])
def test_verdicts_that_need_other_hardware_go_to_the_scheduler(verdict: ExitCode) -> None:
    assert decide(culprit_exit_code=int(verdict)) == ("stop", int(verdict))


def test_a_signalled_launcher_stops_for_a_requeue() -> None:
    assert decide(signalled=signal.SIGTERM) == ("stop", int(ExitCode.PREEMPTED))
    assert decide(signalled=signal.SIGINT) == ("stop", INTERRUPTED)
    assert decide(signalled=signal.SIGTERM, succeeded=True) == ("done", 0)  # it finished before the signal mattered


def test_bad_settings_name_the_setting() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="max_no_progress_restarts"):
        RestartPolicy(max_restarts=1, max_no_progress_restarts=-2)
