"""The NeMo bridge without NeMo: translation of exp_manager keys and callbacks built from a ``resilience:`` section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from lightning.pytorch import Callback
from omegaconf import DictConfig, OmegaConf

from lightning_resilience import FaultTolerance, LocalTier, MemoryTier, TieredCheckpoint
from lightning_resilience.integrations.nemo import (
    attach,
    resilience_callbacks,
    resilience_exit_code,
    translate_exp_manager,
)
from lightning_resilience.lightning.callbacks.straggler import StragglerDetection

NEMO_EXP_MANAGER = {
    "exp_dir": "/runs",
    "name": "gpt",
    "resume_if_exists": False,
    "create_checkpoint_callback": True,
    "checkpoint_callback_params": {"monitor": "val_loss", "save_top_k": 3},
    "create_fault_tolerance_callback": True,
    "fault_tolerance": {
        "workload_check_interval": 5.0,
        "initial_rank_heartbeat_timeout": 1800.0,
        "rank_heartbeat_timeout": 300.0,
        "calculate_timeouts": False,
        "safety_factor": 3.0,
        "max_subsequent_job_failures": 2,
    },
    "create_straggler_detection_callback": True,
    "straggler_detection_params": {
        "report_time_interval": 300,
        "calc_relative_gpu_perf": True,
        "calc_individual_gpu_perf": True,
        "num_gpu_perf_scores_to_log": 5,
        "gpu_relative_perf_threshold": 0.8,
        "gpu_individual_perf_threshold": 0.5,
        "stop_if_detected": True,
    },
}
CONF = Path(__file__).resolve().with_name("conf")
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NEMO_KEYS = (
    "create_fault_tolerance_callback",
    "fault_tolerance",
    "create_straggler_detection_callback",
    "straggler_detection_params",
)


def _compose(tmp_path: Path, *overrides: str) -> DictConfig:
    """A NeMo example-style config with the override lines docs/nemo.md gives for NeMo scripts; our config groups
    come from the installed search-path plugin (no ``hydra.searchpath``, no ``register_configs`` call)."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("nemo_tiny", overrides=[f"+run_dir={tmp_path / 'run'}", *overrides])


def test_nemo_keys_are_removed_and_translated() -> None:
    exp = OmegaConf.create(NEMO_EXP_MANAGER)
    stripped, ours = translate_exp_manager(exp)
    assert not set(NEMO_KEYS) & set(stripped)
    assert set(exp) == set(NEMO_EXP_MANAGER)  # the input is not modified
    assert stripped.checkpoint_callback_params.save_top_k == 3 and stripped.name == "gpt"
    assert stripped.create_preemption_callback is False  # our FaultTolerance takes SIGTERM
    assert ours["ft"] == {
        "config": {
            "initial_timeouts_s": {"setup": 1800.0, "step": 300.0, "out_of_section": 300.0},
            "calibrate": False,
            "safety_factor": 3.0,
        }
    }
    straggler = ours["straggler"]["config"]
    assert straggler["detect_on"] == "relative"  # the relative score (and its threshold) wins when both are on
    assert straggler["min_slowdown"] == pytest.approx(1.25)  # NVRx score 0.8 = reference / rank time
    assert [lvl["action"] for lvl in straggler["levels"]] == ["alert", "stop"]
    assert ours["straggler"]["max_logged_ranks"] == 5


def test_only_the_individual_score_maps_to_individual_detection() -> None:
    exp = {
        "create_straggler_detection_callback": True,
        "straggler_detection_params": {"calc_relative_gpu_perf": False, "gpu_individual_perf_threshold": 0.5},
    }
    _, ours = translate_exp_manager(exp)
    straggler = ours["straggler"]["config"]
    assert straggler["detect_on"] == "individual"
    assert straggler["min_slowdown"] == pytest.approx(2.0)
    assert [lvl["action"] for lvl in straggler["levels"]] == ["alert"]  # stop_if_detected defaults False
    assert ours["policy"] == {"config": {"straggler": "alert"}}


def test_keys_switched_off_translate_to_nothing_but_are_still_removed() -> None:
    exp = {**NEMO_EXP_MANAGER, "create_fault_tolerance_callback": False, "create_straggler_detection_callback": False}
    stripped, ours = translate_exp_manager(exp)
    assert ours == {}
    assert not set(NEMO_KEYS) & set(stripped)
    assert "create_preemption_callback" not in stripped  # NeMo's default (on) is left alone


@pytest.mark.parametrize(
    ("exp", "match"),
    [
        ({"fault_tolerance": {"heartbeat": 3}}, r"exp_manager.fault_tolerance has keys NeMo does not define: \['hear"),
        (
            {"straggler_detection_params": {"num_gpu_perf_scores_to_print": 3}},
            r"straggler_detection_params has keys NeMo does not define: \['num_gpu_perf_scores_to_print'\]",
        ),
        (
            {
                "create_fault_tolerance_callback": True,
                "fault_tolerance": {"simulated_fault": {"fault_type": "rank_hung"}},
            },
            "simulated_fault is not supported",
        ),
        (
            {
                "create_straggler_detection_callback": True,
                "straggler_detection_params": {"calc_relative_gpu_perf": False, "calc_individual_gpu_perf": False},
            },
            "both false, nothing would be detected",
        ),
        (
            {
                "create_straggler_detection_callback": True,
                "straggler_detection_params": {"gpu_relative_perf_threshold": 1.5},
            },
            r"gpu_relative_perf_threshold must be in \(0, 1\), got 1.5",
        ),
    ],
)
def test_bad_nemo_keys_fail_naming_the_key(exp: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        translate_exp_manager(exp)


def test_tiered_checkpoint_takes_resume_over_from_nemo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resilience = {"checkpoint": {"_target_": "lightning_resilience.TieredCheckpoint", "tiers": []}}
    exp = {"exp_dir": str(tmp_path / "exp"), "name": "gpt", "resume_if_exists": True}
    stripped, _ = translate_exp_manager(exp, resilience=resilience)
    # NeMo would have logged to <exp_dir>/<name> without a version folder: the same place, explicitly
    assert stripped.resume_if_exists is False
    assert stripped.explicit_log_dir == str(tmp_path / "exp" / "gpt")
    assert "exp_dir" not in stripped

    monkeypatch.chdir(tmp_path)  # NeMo's default exp_dir is ./nemo_experiments
    stripped, _ = translate_exp_manager({"resume_if_exists": True}, resilience=resilience)
    assert stripped.explicit_log_dir == str(tmp_path / "nemo_experiments" / "default")

    stripped, _ = translate_exp_manager({"resume_if_exists": True, "version": "v1"}, resilience=resilience)
    assert (stripped.resume_if_exists, stripped.version, "explicit_log_dir" in stripped) == (False, "v1", False)

    # without our checkpoint section NeMo keeps resuming from its own *last.ckpt
    stripped, _ = translate_exp_manager(exp, resilience={"checkpoint": {}, "ft": {"_target_": "x"}})
    assert stripped.resume_if_exists is True and stripped.create_preemption_callback is False


def test_callbacks_from_the_resilience_group_and_nemo_keys(tmp_path: Path) -> None:
    cfg = _compose(
        tmp_path,
        "+resilience=default",
        "++exp_manager.create_fault_tolerance_callback=True",
        "++exp_manager.fault_tolerance.rank_heartbeat_timeout=300",
        "++exp_manager.fault_tolerance.safety_factor=3",
        "++exp_manager.create_straggler_detection_callback=True",
        "++exp_manager.straggler_detection_params.stop_if_detected=True",
        "resilience.ft.config.warmup_steps=7",
        "resilience.checkpoint.tiers.1.every_n_steps=4",
    )
    callbacks = resilience_callbacks(cfg)
    names = [type(cb).__name__ for cb in callbacks]
    assert {"FaultTolerance", "SDCVerification", "StragglerDetection", "ResilienceReportCallback"} <= set(names)
    by_name: dict[str, Any] = {type(cb).__name__: cb for cb in callbacks}
    ft, ckpt, straggler = by_name["FaultTolerance"], by_name["TieredCheckpoint"], by_name["StragglerDetection"]
    assert isinstance(ft, FaultTolerance) and isinstance(ckpt, TieredCheckpoint)
    assert isinstance(straggler, StragglerDetection)
    # NeMo's keys override the group's values; the group's other values (and command-line overrides) stay
    assert ft.config.safety_factor == 3.0 and ft.config.warmup_steps == 7
    assert ft.config.initial_timeouts_s["step"] == 300.0 and ft.config.initial_timeouts_s["setup"] == 900.0
    assert ft.config.run_dir == str(tmp_path / "run" / "resilience")
    assert [type(t) for t in ckpt.tiers] == [MemoryTier, LocalTier] and ckpt.tiers[1].every_n_steps == 4
    assert straggler.config.sections is None  # resilience/straggler/default.yaml: automatic (compute and data)
    assert straggler.config.min_slowdown == pytest.approx(1 / 0.7)  # NeMo's default threshold
    assert [lvl.action for lvl in straggler.config.levels] == ["alert", "stop"]
    if "ResiliencePolicy" in by_name:  # stop_if_detected: a confirmed straggler checkpoints and stops the job
        assert by_name["ResiliencePolicy"].config.straggler == "checkpoint_and_stop"

    stripped, _ = translate_exp_manager(cfg.exp_manager, resilience=cfg.resilience)
    assert not set(NEMO_KEYS) & set(stripped)
    assert (stripped.resume_if_exists, stripped.create_preemption_callback) == (False, False)


def test_nemo_keys_turn_on_a_section_the_group_switches_off(tmp_path: Path) -> None:
    minimal = {"TieredCheckpoint", "ResilienceReportCallback"}
    cfg = _compose(tmp_path, "+resilience=minimal", "++exp_manager.create_fault_tolerance_callback=True")
    assert {type(cb).__name__ for cb in resilience_callbacks(cfg)} == {"FaultTolerance", *minimal}
    # a policy is configured only where resilience has one
    cfg = _compose(tmp_path, "+resilience=minimal", "++exp_manager.create_straggler_detection_callback=True")
    assert {type(cb).__name__ for cb in resilience_callbacks(cfg)} == {"StragglerDetection", *minimal}
    # and without any resilience section, from the component's defaults
    (ft,) = resilience_callbacks(_compose(tmp_path, "++exp_manager.create_fault_tolerance_callback=True"))
    assert isinstance(ft, FaultTolerance) and ft.config.run_dir is None  # <NeMo log dir>/resilience
    assert resilience_callbacks(_compose(tmp_path)) == []


def test_run_dir_defaults_without_one_in_the_app(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("nemo_tiny", overrides=["+resilience=minimal"])
    assert cfg.resilience.run_dir == "runs/lightning_resilience"
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("nemo_tiny", overrides=["+resilience=minimal", f"resilience.run_dir={tmp_path}"])
    ckpt = next(cb for cb in resilience_callbacks(cfg) if isinstance(cb, TieredCheckpoint))
    assert Path(ckpt.tiers[1].root) == tmp_path / "ckpt"


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("resilience.checkpoint.tiers.1.every_n_steps=-1", r"resilience.checkpoint.tiers\[1\].every_n_steps must be"),
        ("++exp_manager.fault_tolerance.safety_factor=0.5", "resilience.ft.config.safety_factor must be a finite"),
        ("resilience.straggler.config.window=2", "resilience.straggler.config.window must be >= 4, got 2"),
    ],
)
def test_bad_settings_fail_naming_the_full_key(tmp_path: Path, override: str, match: str) -> None:
    cfg = _compose(tmp_path, "+resilience=default", "++exp_manager.create_fault_tolerance_callback=True", override)
    with pytest.raises(ValueError, match=match):
        resilience_callbacks(cfg)


def test_a_plain_dict_config_works_too(tmp_path: Path) -> None:
    cfg: dict[str, Any] = {
        "resilience": {
            "checkpoint": {
                "_target_": "lightning_resilience.TieredCheckpoint",
                "tiers": [{"_target_": "lightning_resilience.config.MemoryTierConfig", "keep": 3}],
            },
            "sdc": {},
        },
        "exp_manager": {"create_straggler_detection_callback": True},
    }
    ckpt, straggler = resilience_callbacks(cfg)  # in the order of the config; the order in a Trainer is free
    assert isinstance(straggler, StragglerDetection) and isinstance(ckpt, TieredCheckpoint)
    assert ckpt.tiers[0].keep == 3


def test_a_section_must_build_a_callback(tmp_path: Path) -> None:
    cfg = {"resilience": {"ft": {"_target_": "lightning_resilience.ft.config.FaultToleranceConfig"}}}
    with pytest.raises(ValueError, match=r"resilience.ft must build a Lightning Callback, got FaultToleranceConfig"):
        resilience_callbacks(cfg)


def test_attach_to_trainer_kwargs_and_to_a_trainer(tmp_path: Path) -> None:
    from lightning.pytorch import Trainer

    cfg = _compose(tmp_path, "+resilience=minimal")
    other = Callback()
    kwargs: dict[str, Any] = {"callbacks": [other], "max_steps": 1}
    added = attach(kwargs, cfg)
    assert kwargs["callbacks"][0] is other and kwargs["callbacks"][1:] == added
    with pytest.raises(ValueError, match=r"already has \['ResilienceReportCallback', 'TieredCheckpoint'\]"):
        attach(kwargs, cfg)

    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    ckpt, _report = attach(trainer, cfg)
    assert isinstance(ckpt, TieredCheckpoint) and ckpt in trainer.callbacks  # type: ignore[attr-defined]
    assert resilience_exit_code(trainer) == 0


def test_exit_code_comes_from_the_suite_only() -> None:
    from lightning.pytorch import Trainer

    class Foreign(Callback):
        exit_code = 7

    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=[Foreign()])
    assert resilience_exit_code(trainer) == 0
