"""``simulate_main``: flag parsing, errors that name the flag, --from-run, sweeps and the files it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_resilience.sim import load_run_costs, simulate_main
from lightning_resilience.sim.cli import build_parser, config_from_args, parse_duration


def _cfg(*argv: str):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(list(argv)))


def test_parse_duration_units() -> None:
    assert parse_duration("90") == 90.0
    assert parse_duration("500ms") == 0.5
    assert parse_duration("6.47m") == pytest.approx(388.2)
    assert parse_duration("7.9h") == pytest.approx(28440.0)
    assert parse_duration("2d") == 172800.0
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


def test_flags_build_the_config() -> None:
    cfg = _cfg(
        "--gpus", "10000", "--mttf", "7.9h@1024", "--days", "30", "--step-time", "4s", "--interval", "500",
        "--spares", "3", "--weibull-shape", "0.8", "--restart-cost", "cold=6.47m,in_job=45s",
        "--mix", "crash=0.7,hang=0.3", "--detect", "hang=2m",
    )  # fmt: skip
    assert cfg.cluster.gpus == 10000 and cfg.cluster.nodes == 1250 and cfg.cluster.spare_nodes == 3
    assert cfg.failures.job_mttf_s(10000) == pytest.approx(7.9 * 3600 * 1024 / 10000)
    assert cfg.failures.weibull_shape == 0.8
    assert [k.name for k in cfg.failures.kinds] == ["crash", "hang"]
    assert cfg.failures.kind("hang").detection_s == 120.0  # type: ignore[union-attr]
    assert cfg.restart.cold == pytest.approx(388.2) and cfg.restart.in_job == 45.0
    assert cfg.job.horizon_s == 30 * 86400 and cfg.job.step_s == 4.0
    assert cfg.tiers[0].every_n_steps == 500 and cfg.tiers[0].interval_steps(4.0) == 500


def test_mttf_without_reference_is_measured_at_the_job_size() -> None:
    cfg = _cfg("--gpus", "2048", "--mttf", "3h")
    assert cfg.failures.job_mttf_s(2048) == pytest.approx(3 * 3600)


def test_tier_specs_and_auto_interval() -> None:
    cfg = _cfg(
        "--gpus", "8192", "--interval", "auto",
        "--tier", "name=peer,blocking=1s,write=5s,restore=10s,durability=peer",
        "--tier", "name=remote,every=x10,blocking=2s,write=5m,restore=94s,keep=3",
    )  # fmt: skip
    from lightning_resilience.sim import daly_interval

    daly = daly_interval(1.0, 7.9 * 3600 / 8)
    assert cfg.tiers[0].every_s == pytest.approx(daly)
    assert cfg.tiers[1].every_s == pytest.approx(10 * daly)
    assert (cfg.tiers[1].durability, cfg.tiers[1].keep, cfg.tiers[1].write_s) == ("remote", 3, 300.0)


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        (["--gpus", "0"], "--gpus", "must be >= 1"),
        (["--gpus", "many"], "--gpus", "not an integer"),
        (["--mttf", "7.9h@x"], "--mttf", "GPU count"),
        (["--mttf", "fast"], "--mttf", "not a duration"),
        (["--days", "-1"], "--days", "> 0"),
        (["--mix", "crash=0.5,hang=0.2"], "--mix", "sum to 1"),
        (["--mix", "meteor=1"], "--mix", "unknown failure kind"),
        (["--detect", "crash"], "--detect", "KEY=VALUE"),
        (["--restart-cost", "teleport=1s"], "--restart-cost", "unknown restart path"),
        (["--interval", "x3"], "--interval", "multiple"),
        (["--tier", "every=5m"], "--tier", "name="),
        (["--tier", "name=a,durability=tape"], "--tier", "durability"),
        (["--tier", "name=a,speed=3"], "--tier", "unknown tier keys"),
        (["--sweep", "cadence=5m"], "--sweep", "interval="),
        (["--sweep", "gpus=8,zero"], "--sweep", "not an integer"),
        (["--from-run", "/nonexistent/run"], "--from-run", "no resilience_report.json"),
    ],
)
def test_bad_inputs_fail_with_a_message_naming_the_flag(
    argv: list[str], flag: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        simulate_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and words in err, err


def test_detect_for_a_kind_outside_the_mix_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        simulate_main(["--mix", "crash=1", "--detect", "hang=1m"])
    assert "--detect" in capsys.readouterr().err


def test_run_prints_breakdown_and_daly_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = simulate_main(["--gpus", "4096", "--days", "5", "--out", str(tmp_path), "--replications", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| productive |" in out and "ETTR" in out and "Daly" in out
    data = json.loads((tmp_path / "sim_result.json").read_text())
    assert 0 < data["result"]["ettr"] < 1
    assert data["monte_carlo"]["replications"] == 2
    assert data["daly_interval_s"] > 0
    assert sum(data["result"]["breakdown_s"].values()) == pytest.approx(5 * 86400)


def test_sweep_table_and_plot_or_clean_skip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = simulate_main(
        ["--days", "3", "--sweep", "interval=1m,10m", "gpus=1024,8192", "--out", str(tmp_path), "--json"]
    )
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["sweep"]
    assert [(r["gpus"], r["interval_s"]) for r in rows] == [(1024, 60.0), (1024, 600.0), (8192, 60.0), (8192, 600.0)]
    # a larger job fails more often and so has a lower ETTR at the same cadence
    assert rows[2]["ettr_mean"] < rows[0]["ettr_mean"]
    assert (tmp_path / "sweep.md").read_text().startswith("| GPUs |")
    from lightning_resilience.sim import report

    assert (tmp_path / "sweep.png").exists() == report.have_matplotlib()


def test_from_run_report_sets_measured_costs(tmp_path: Path) -> None:
    (tmp_path / "resilience_report.json").write_text(
        json.dumps(
            {
                "step_seconds": 0.25,
                "gpus": 2,
                "tiers": {
                    "memory": {"every_n_steps": 1, "blocking_seconds": 0.004, "restore_seconds": 0.01},
                    "local": {"every_n_steps": 20, "write_seconds": 0.3, "restore_seconds": 0.05},
                },
                "restart_seconds": {"in_job": 12.5},
                "detection_seconds": {"crash": 1.5},
                "failures": {"count": 4, "wall_seconds": 400.0},
            }
        )
    )
    cfg = _cfg("--from-run", str(tmp_path), "--gpus", "2", "--gpus-per-node", "1")
    assert cfg.job.step_s == 0.25
    assert [(t.name, t.durability, t.every_n_steps) for t in cfg.tiers] == [
        ("memory", "process", 1),
        ("local", "host", 20),
    ]
    assert cfg.tiers[0].blocking_s == 0.004 and cfg.tiers[1].write_s == 0.3
    assert cfg.restart.in_job == 12.5 and cfg.restart.cold == 294.0  # a missing key keeps its default
    assert cfg.failures.kind("crash").detection_s == 1.5  # type: ignore[union-attr]
    assert cfg.failures.job_mttf_s(2) == pytest.approx(100.0)  # observed: 400 s / 4 failures at 2 GPUs
    # explicit flags win over the run
    assert _cfg("--from-run", str(tmp_path), "--step-time", "1s", "--mttf", "1h").job.step_s == 1.0


def test_from_run_tolerates_an_empty_report_and_reads_the_recipe_jsonl(tmp_path: Path) -> None:
    (tmp_path / "resilience_report.json").write_text("{}")
    assert _cfg("--from-run", str(tmp_path)).tiers[0].name == "peer"  # all defaults
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    line = {
        "final_step": 80, "median_step_ms": 43.0, "blocking_ms_mean": 7.0, "world_size": 2,
        "tiers": {"memory": {"writes": 80, "seconds": 0.0}, "local": {"writes": 8, "seconds": 0.4}},
        "restored_from": "local", "restore_ms": 44.0,
    }  # fmt: skip
    (legacy / "report.jsonl").write_text(json.dumps({"attempt": 0}) + "\n" + json.dumps(line) + "\n")
    costs = load_run_costs(legacy)
    assert costs.step_s == pytest.approx(0.043)
    memory, local = costs.tiers
    assert (memory.every_n_steps, memory.blocking_s, memory.durability) == (1, pytest.approx(0.007), "process")
    assert (local.every_n_steps, local.write_s, local.restore_s) == (10, pytest.approx(0.05), pytest.approx(0.044))


def test_from_run_bad_value_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "resilience_report.json").write_text(json.dumps({"tiers": {"local": {"restore_seconds": -1}}}))
    with pytest.raises(SystemExit):
        simulate_main(["--from-run", str(tmp_path)])
    assert "tiers.local.restore_seconds" in capsys.readouterr().err
