"""ActionLadder: each level fires once per episode after its slowdown persisted for its number of steps."""

from __future__ import annotations

from lightning_resilience.policy import Action
from lightning_resilience.straggler.config import StragglerLevelConfig
from lightning_resilience.straggler.policy import ActionLadder, StragglerFinding


def _verdict(step: int, rank: int = 3, slowdown: float = 1.3) -> StragglerFinding:
    return StragglerFinding(
        rank=rank,
        node="n1",
        node_index=1,
        section="step",
        slowdown=slowdown,
        score="relative",
        step=step,
        onset_step=step - 3,
    )


LEVELS = [
    StragglerLevelConfig(action="log", slowdown=1.1, persist_steps=1),
    StragglerLevelConfig(action="alert", slowdown=1.2, persist_steps=3),
    StragglerLevelConfig(action="stop", slowdown=1.5, persist_steps=4),
]


def _run(ladder: ActionLadder, start: int, slowdowns: list[float], every: int = 1) -> list[tuple[int, Action]]:
    out = []
    for i, s in enumerate(slowdowns):
        step = start + i * every
        out += [(step, d.action) for d in ladder.observe(3, "step", step, s)]
    return out


def test_levels_fire_by_threshold_and_persistence_once_each() -> None:
    ladder = ActionLadder(LEVELS)
    ladder.start(_verdict(10))
    fired = _run(ladder, 10, [1.3, 1.3, 1.3, 1.6, 1.6, 1.6, 1.6, 1.6, 1.6])
    assert fired == [(10, Action.LOG), (12, Action.ALERT), (16, Action.CHECKPOINT_AND_STOP)]


def test_a_dip_below_a_threshold_resets_its_count() -> None:
    ladder = ActionLadder(LEVELS)
    ladder.start(_verdict(0))
    fired = _run(ladder, 0, [1.25, 1.25, 1.15, 1.25, 1.25, 1.25])
    assert fired == [(0, Action.LOG), (5, Action.ALERT)]


def test_cadence_counts_training_steps_not_samples() -> None:
    ladder = ActionLadder(LEVELS)
    ladder.start(_verdict(10), previous_step=5)  # one sample every 5 steps
    fired = _run(ladder, 10, [1.6], every=5)
    assert fired == [(10, Action.LOG), (10, Action.ALERT), (10, Action.CHECKPOINT_AND_STOP)]


def test_nothing_without_an_episode_and_a_new_episode_fires_again() -> None:
    ladder = ActionLadder(LEVELS)
    assert ladder.observe(3, "step", 0, 3.0) == []
    ladder.start(_verdict(0))
    assert [d.action for d in ladder.observe(3, "step", 0, 1.3)] == [Action.LOG]
    ladder.end(3, "step")
    assert ladder.active == []
    ladder.start(_verdict(50))
    decisions = ladder.observe(3, "step", 50, 1.3)
    assert [d.action for d in decisions] == [Action.LOG]
    assert decisions[0].verdict.slowdown == 1.3 and decisions[0].to_dict()["verdict"]["rank"] == 3
