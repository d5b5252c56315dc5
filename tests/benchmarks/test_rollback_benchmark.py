"""The rollback benchmark's figures from step times (no job is launched: the drill in
``tests/drills/test_rollback_drill.py`` runs the same job path), its markdown and its README line."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.rollback import _figures, readme_summary, render_markdown


def _times(steps: list[tuple[int, int, float]]) -> list[dict[str, Any]]:
    return [{"attempt": a, "step": s, "t": t} for a, s, t in steps]


def test_in_process_figures_start_at_the_deciding_step_and_end_at_the_first_step_after_it() -> None:
    # bad step 5, decided at the end of step 7, restored 5: the next step ends as step 6, step 7 is regained later
    times = _times([(0, 5, 10.0), (0, 6, 11.0), (0, 7, 12.0), (0, 6, 12.05), (0, 7, 13.0), (0, 8, 14.0)])
    f = _figures(times, "in_process")
    assert (f["decided_step"], f["resumed_step"], f["attempts"]) == (7, 5, 1)
    assert f["first_good_s"] == pytest.approx(0.05) and f["regained_s"] == pytest.approx(1.0)


def test_restart_figures_span_the_attempts() -> None:
    times = _times([(0, 9, 1.0), (0, 10, 2.0), (0, 11, 3.0), (1, 11, 40.0), (1, 12, 41.0)])
    f = _figures(times, "restart")
    assert (f["decided_step"], f["resumed_step"], f["attempts"]) == (11, 10, 2)
    assert f["first_good_s"] == pytest.approx(37.0) and f["regained_s"] == pytest.approx(37.0)


def test_no_recovery_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no recovery"):
        _figures(_times([(0, 1, 1.0), (0, 2, 2.0)]), "in_process")


def test_markdown_and_readme_name_the_ratio() -> None:
    def fig(first: float, regained: float) -> dict[str, Any]:
        return {"first_good_s": {"median_s": first, "max_s": first}, "regained_s": {"median_s": regained}}

    result = {
        "title": "T", "command": "python -m benchmarks.rollback --quick", "when": "now", "reps": 1, "steps": 20,
        "bad_step": 14, "hidden": 256, "figures": {"in_process": fig(0.02, 0.05), "restart": fig(20.0, 21.0)},
        "ratios": {"first_good": 1000.0, "regained": 420.0},
        "runs": {"in_process": [{"resumed_step": 14}], "restart": [{"resumed_step": 10}]},
    }  # fmt: skip
    text = render_markdown(result)
    assert "python -m benchmarks.rollback --quick" in text and "CPU only" in text and "1000" in text
    assert "| restart (torchrun, disk) |" in text and "| 10 |" in text
    assert "in-process rollback" in readme_summary(result) and "1000" in readme_summary(result)
