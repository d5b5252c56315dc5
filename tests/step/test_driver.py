"""The step driver: one written order at every step end, whatever order the components registered in; a verdict
posted during a step is decided at the end of the next one (it travels in that step's agreement), an agreed one at
once; nothing is captured after a rollback or when the state is suspect."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from lightning_resilience.policy import Action, Decision, Event, PolicyConfig, Verdict
from lightning_resilience.step.agreement import Op
from lightning_resilience.step.driver import Field, StepDriver


class Log:
    def __init__(self) -> None:
        self.events: list[str] = []


class Component:
    """Every protocol at once, writing what it is asked into a shared log."""

    def __init__(self, name: str, log: Log, *, verdicts: dict[int, list[Verdict]] | None = None) -> None:
        self.name, self.log = name, log
        self.verdicts = verdicts or {}
        self.suspect = False
        self.agreed_values: list[tuple[int, list[int]]] = []

    def step_fields(self) -> Sequence[Field]:
        return [Field(f"{self.name}.flag", Op.OR), Field(f"{self.name}.min", Op.MIN)]

    def contribute(self, step: int) -> Sequence[int]:
        self.log.events.append(f"contribute:{self.name}:{step}")
        return [1, step]

    def agreed(self, step: int, values: Sequence[int]) -> Sequence[Verdict]:
        self.log.events.append(f"agreed:{self.name}:{step}")
        self.agreed_values.append((step, list(values)))
        return self.verdicts.get(step, [])

    def finish_step(self, step: int) -> None:
        self.log.events.append(f"finish:{self.name}")

    def snapshot(self, step: int) -> None:
        self.log.events.append(f"snapshot:{step}")

    def state_suspect(self) -> bool:
        return self.suspect

    def after_step(self, step: int, decision: Decision | None) -> None:
        self.log.events.append(f"bookkeeping:{self.name}")


class Actor:
    def __init__(self, log: Log, escalate: Decision | None = None) -> None:
        self.log, self.escalate = log, escalate

    def rollback(self, decision: Decision) -> Decision | None:
        self.log.events.append(f"rollback:{decision.step}")
        return self.escalate

    def stop(self, decision: Decision) -> None:
        self.log.events.append(f"stop:{decision.action.value}")

    def note(self, decision: Decision) -> None:
        self.log.events.append(f"note:{decision.action.value}")


def _driver(log: Log, policy: PolicyConfig | None = None, **kwargs: dict[int, list[Verdict]]) -> tuple:
    driver = StepDriver(policy)
    a, b = Component("a", log, verdicts=kwargs.get("a")), Component("b", log)
    # registered in an order unlike the phases': the phases still run in theirs
    driver.add_bookkeeper(b)
    driver.add_snapshotter(a)
    driver.add_witness(b)
    driver.add_finisher(a)
    driver.add_contributor(b)
    driver.add_contributor(a)
    return driver, a, b


def test_the_phases_run_in_the_written_order() -> None:
    log = Log()
    driver, _, _ = _driver(log)
    driver.begin_step(4)
    driver.begin_step(4)  # a second micro-batch of the same step issues nothing
    assert driver.end_step(5, Actor(log)) is None
    assert log.events == [
        "contribute:b:4",
        "contribute:a:4",
        "finish:a",
        "agreed:b:4",
        "agreed:a:4",
        "snapshot:5",
        "bookkeeping:b",
    ]
    assert driver.fields == ["policy.decision", "b.flag", "b.min", "a.flag", "a.min"]
    assert driver.stats.steps == 1 and set(driver.stats.per_step_ms()) >= {"agree", "snapshot"}


def test_a_posted_verdict_is_decided_one_step_later_and_an_agreed_one_at_once() -> None:
    log = Log()
    driver, _, _ = _driver(log)
    driver.begin_step(1)
    driver.post(Verdict(Event.STRAGGLER, 1, 0, "slow"))  # during step 1: after its round was issued
    assert driver.end_step(2, Actor(log)) is None
    driver.begin_step(2)
    decision = driver.end_step(3, Actor(log))
    assert decision is not None and decision.step == 3 and decision.action is Action.CHECKPOINT_AND_STOP
    assert "stop:checkpoint_and_stop" in log.events and driver.decision is decision
    log.events.clear()
    driver.begin_step(3)
    driver.post(Verdict(Event.SPIKE, 3, 0, "spike"), agreed=True)
    decision = driver.end_step(4, Actor(log))
    assert decision is not None and decision.event is Event.SPIKE and "note:log" in log.events


def test_a_contributor_verdict_is_decided_at_the_end_of_its_round() -> None:
    log = Log()
    nan = Verdict(Event.NONFINITE, 7, 0, "nan", bad_step=6)
    driver, _, _ = _driver(log, a={7: [nan]})
    driver.begin_step(7)
    decision = driver.end_step(8, Actor(log))
    assert decision is not None and decision.action is Action.ROLLBACK_IN_PROCESS and decision.verdicts == [nan]
    # training goes on from the restored state: it is captured after the rollback (a fault that comes back at once
    # finds it in RAM)
    assert log.events.index("rollback:8") < log.events.index("snapshot:8")


def test_an_escalated_rollback_stops_and_a_corrupt_state_is_not_captured() -> None:
    log = Log()
    nan = Verdict(Event.NONFINITE, 7, 0, "nan", bad_step=6)
    unrestored = Decision(8, Action.ROLLBACK, Event.NONFINITE)
    driver, _, _ = _driver(log, a={7: [nan]})
    driver.begin_step(7)
    driver.end_step(8, Actor(log, escalate=unrestored))
    assert "snapshot:8" not in log.events and "stop:rollback" in log.events


def test_a_suspect_state_is_not_captured() -> None:
    log = Log()
    driver, _, b = _driver(log)
    b.suspect = True
    driver.begin_step(1)
    driver.end_step(2, Actor(log))
    assert not any(e.startswith("snapshot") for e in log.events)


def test_settle_agrees_at_once_on_what_was_posted_last() -> None:
    log = Log()
    driver, _, _ = _driver(log, PolicyConfig(straggler="alert"))
    driver.begin_step(9)
    driver.end_step(10, Actor(log))
    driver.post(Verdict(Event.STRAGGLER, 10, 0, "slow"))
    decision = driver.settle(10, Actor(log))
    assert decision is not None and decision.action is Action.ALERT


def test_contributors_join_before_the_first_step() -> None:
    log = Log()
    driver, _, _ = _driver(log)
    driver.begin_step(0)
    with pytest.raises(RuntimeError, match="registered"):
        driver.add_contributor(Component("late", log))


def test_a_contributor_giving_the_wrong_number_of_values_is_named() -> None:
    class Short(Component):
        def contribute(self, step: int) -> Sequence[int]:
            return [1]

    driver = StepDriver()
    driver.add_contributor(Short("short", Log()))
    with pytest.raises(ValueError, match="Short contributed 1 values for 2 fields"):
        driver.begin_step(0)
