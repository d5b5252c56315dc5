"""Hydra integration of the configs: explicit schema registration, and errors that name the full key."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from lightning_resilience import FaultTolerance, FaultToleranceConfig, LocalTier, MemoryTier, TieredCheckpoint
from lightning_resilience.config.registry import ResilienceConfigError, build, build_all, register_configs, schemas

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(autouse=True)
def _registered() -> None:
    register_configs()  # what a recipe does before Hydra composes its config


def _compose(*overrides: str) -> object:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("pretrain_gpt", overrides=["run_dir=/tmp/lr-test", *overrides])


def test_registration_is_explicit_and_complete() -> None:
    store = ConfigStore()
    register_configs(store)
    stored = store.repo["resilience"]["schema"]
    assert sorted(n.removesuffix(".yaml") for n in stored) == sorted(schemas())
    # a stored schema type-checks a value at composition
    node = OmegaConf.merge(stored["ft.yaml"].node, {"warmup_steps": 3})
    assert node.warmup_steps == 3
    with pytest.raises(Exception, match="warmup_steps"):
        OmegaConf.merge(stored["ft.yaml"].node, {"warmup_steps": "many"})


@pytest.mark.parametrize("preset", ["minimal", "default", "full"])
def test_presets_build_their_callbacks(preset: str) -> None:
    cfg = _compose(f"resilience={preset}")
    built = build_all(cfg.resilience, skip=lambda name: name == "run_dir")  # type: ignore[attr-defined]
    assert isinstance(built["checkpoint"], TieredCheckpoint)
    everything = {"checkpoint", "straggler", "sdc", "ft", "policy", "report"}
    assert set(built) == ({"checkpoint", "report"} if preset == "minimal" else everything)
    if "ft" in built:
        assert isinstance(built["ft"], FaultTolerance)
        assert built["ft"].config.run_dir == "/tmp/lr-test/resilience"


def test_group_choice_overrides_the_preset() -> None:
    cfg = _compose("resilience=minimal", "resilience/checkpoint=tiered", "resilience/ft=watchdog")
    built = build_all(cfg.resilience, skip=lambda name: name == "run_dir")  # type: ignore[attr-defined]
    tiers = built["checkpoint"].tiers
    assert [type(t).__name__ for t in tiers] == ["MemoryTier", "PeerTier", "LocalTier"]
    assert isinstance(tiers[0], MemoryTier) and isinstance(tiers[2], LocalTier)
    assert isinstance(built["ft"].config, FaultToleranceConfig)


def test_the_budget_preset_leaves_both_cadences_to_the_budget() -> None:
    cfg = _compose(
        "resilience=minimal", "resilience/checkpoint=budget", "resilience.checkpoint.config.overhead_budget=0.05"
    )
    checkpoint = build_all(cfg.resilience, skip=lambda name: name == "run_dir")["checkpoint"]  # type: ignore[attr-defined]
    assert [t.every_n_steps for t in checkpoint.tiers] == [0, 0] and checkpoint.config.overhead_budget == 0.05


def test_a_bad_value_names_its_full_key() -> None:
    cfg = _compose("resilience.checkpoint.tiers.1.keep=0")
    with pytest.raises(ResilienceConfigError) as err:
        build_all(cfg.resilience, skip=lambda name: name == "run_dir")  # type: ignore[attr-defined]
    assert str(err.value) == "resilience.checkpoint.tiers[1].keep must be >= 1, got 0"


def test_a_wrong_type_fails_at_composition_naming_its_full_key() -> None:
    with pytest.raises(Exception, match=r"resilience\.ft\.config\.warmup_steps=many"):
        _compose("resilience=default", "resilience.ft.config.warmup_steps=many")


def test_every_schema_field_can_be_overridden_without_a_plus() -> None:
    cfg = _compose(
        "resilience=default", "resilience.ft.config.min_timeout_s=2", "resilience.sdc.config.guard_window=16"
    )
    built = build_all(cfg.resilience, skip=lambda name: name == "run_dir")  # type: ignore[attr-defined]
    assert built["ft"].config.min_timeout_s == 2 and built["sdc"].config.guard_window == 16


def test_a_wrong_type_built_outside_hydra_names_its_full_key() -> None:
    node = OmegaConf.create({"ft": {"_target_": "lightning_resilience.FaultToleranceConfig", "warmup_steps": "many"}})
    with pytest.raises(ResilienceConfigError, match=r"^resilience\.ft\.warmup_steps: .*'many'"):
        build(node)


def test_unknown_target_and_nested_errors() -> None:
    with pytest.raises(ResilienceConfigError, match=r"^resilience\.x\._target_: cannot import"):
        build(OmegaConf.create({"x": {"_target_": "lightning_resilience.NoSuchThing"}}))
    node = OmegaConf.create(
        {"straggler": {"_target_": "lightning_resilience.straggler.config.StragglerConfig", "window": 2}}
    )
    with pytest.raises(ResilienceConfigError, match=r"^resilience\.straggler\.window must be >= 4, got 2$"):
        build(node)
