"""StragglerConfig validates itself at construction, naming the key."""

from __future__ import annotations

import pytest

from lightning_resilience.straggler.config import StragglerConfig, StragglerLevelConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 2}, "straggler.window must be >= 4, got 2"),
        ({"gather_every_n_steps": 0}, "straggler.gather_every_n_steps must be >= 1"),
        ({"confirm_steps": 0}, "straggler.confirm_steps must be >= 1"),
        ({"confirm_steps": 10, "window": 8}, "straggler.confirm_steps must be <= straggler.window"),
        ({"min_slowdown": 1.0}, "straggler.min_slowdown must be a finite factor > 1.0"),
        ({"cusum_threshold": 0}, "straggler.cusum_threshold must be > 0"),
        ({"reference": "mean"}, "straggler.reference must be 'median' or 'fastest'"),
        ({"detect_on": "both"}, "straggler.detect_on must be 'relative' or 'individual'"),
        ({"sections": []}, "straggler.sections must name at least one section"),
        ({"sections": ["step", "step"]}, "straggler.sections must not repeat"),
        ({"warmup_steps": -1}, "straggler.warmup_steps must be >= 0"),
        (
            {"levels": [StragglerLevelConfig(action="log"), StragglerLevelConfig(action="log", slowdown=2.0)]},
            "straggler.levels must name each action at most once",
        ),
    ],
)
def test_bad_values_fail_naming_the_key(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StragglerConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"action": "reboot"}, "straggler.levels.action must be one of"),
        ({"action": "log", "slowdown": 0.9}, "straggler.levels.slowdown must be a finite factor > 1.0, got 0.9"),
        ({"action": "log", "persist_steps": 0}, "straggler.levels.persist_steps must be >= 1, got 0"),
    ],
)
def test_bad_level_fails_naming_the_key(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StragglerLevelConfig(**kwargs)


def test_levels_from_plain_dicts_as_hydra_passes_them() -> None:
    cfg = StragglerConfig(levels=[{"action": "stop", "slowdown": 1.5, "persist_steps": 20}])  # type: ignore[list-item]
    assert cfg.levels == [StragglerLevelConfig(action="stop", slowdown=1.5, persist_steps=20)]
    with pytest.raises(ValueError, match=r"straggler\.levels\.persist_steps"):
        StragglerConfig(levels=[{"action": "stop", "persist_steps": 0}])  # type: ignore[list-item]


def test_defaults_are_valid_and_never_stop() -> None:
    cfg = StragglerConfig()
    assert {lvl.action for lvl in cfg.levels} == {"log", "alert"}
    assert cfg.gather_timeout.total_seconds() == cfg.gather_timeout_s
