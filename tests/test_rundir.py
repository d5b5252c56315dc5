"""RunDir.resolve: one rule for where a component writes, and a warning when it is not where the launcher reads."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lightning_resilience.rundir import DEFAULT_SUBDIR, RUN_DIR_ENV, RunDir


def test_own_setting_then_the_launchers_then_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    assert RunDir.resolve(None, tmp_path).root == tmp_path / DEFAULT_SUBDIR
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "launched"))
    assert RunDir.resolve(None, tmp_path).root == tmp_path / "launched"
    assert RunDir.resolve(tmp_path / "own", tmp_path).root == tmp_path / "own"


def test_a_setting_apart_from_the_launchers_is_honoured_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "launched"))
    with caplog.at_level(logging.WARNING, logger="lightning_resilience.rundir"):
        RunDir.resolve(tmp_path / "launched", tmp_path)  # the same directory: nothing to say
        assert not caplog.records
        assert RunDir.resolve(tmp_path / "elsewhere", tmp_path).root == tmp_path / "elsewhere"
    assert len(caplog.records) == 1 and "will not see the fault notes" in caplog.records[0].getMessage()
