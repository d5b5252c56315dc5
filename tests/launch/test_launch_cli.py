"""`lightning-resilience launch`: torchrun's flags and ours parsed together; bad requests stop before it runs."""

from __future__ import annotations

import pytest

from lightning_resilience.cli import main
from lightning_resilience.cli.launch import build_parser


def test_torchrun_flags_ours_and_the_scripts_own_are_told_apart() -> None:
    args = build_parser().parse_args(
        ["--nproc-per-node", "2", "--max-restarts", "3", "--master-port", "29511", "--run-dir", "runs/r",
         "--max-no-progress-restarts", "2", "train.py", "--run-dir", "elsewhere", "--lr", "1"]
    )  # fmt: skip
    assert (args.nproc_per_node, args.max_restarts, args.master_port) == ("2", 3, 29511)
    assert (args.run_dir, args.max_no_progress_restarts, args.term_timeout) == ("runs/r", 2, 25.0)
    assert args.training_script == "train.py"
    assert args.training_script_args == ["--run-dir", "elsewhere", "--lr", "1"]  # after the script: the script's


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--run-dir", "r", "--max-restarts", "-1", "train.py"], "", "--max-restarts must be >= 0"),
        (["train.py"], 'default run_dir="/shared', "$LIGHTNING_RESILIENCE: No closing quotation"),
    ],
)
def test_bad_requests_exit_2_with_the_setting_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], env: str, message: str
) -> None:
    monkeypatch.setenv("LIGHTNING_RESILIENCE", env)
    assert main(["launch", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_run_directory_can_come_from_the_enablement_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_resilience.cli import launch

    monkeypatch.setenv("LIGHTNING_RESILIENCE", "default run_dir=/shared/run-17 checkpoint.tiers.1.every_n_steps=50")
    assert launch._run_dir_from_env() == "/shared/run-17"
