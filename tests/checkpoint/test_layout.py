"""One on-disk layout for every tier, the CLI and resharding: names, strict parsing, discovery."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_resilience.checkpoint.layout import (
    is_leftover_of,
    leftover_name,
    parse_rank,
    parse_step,
    rank_dirname,
    rank_dirs,
    step_dirname,
    step_dirs,
    step_of_entry,
)


def test_names_round_trip_and_parsing_is_strict() -> None:
    assert step_dirname(120) == "step_000000000120" and parse_step(step_dirname(120)) == 120
    assert rank_dirname(3) == "rank_00003" and parse_rank(rank_dirname(3)) == 3
    for name in ("step_12", "step_0000000001200", "step_00000000012a", "xstep_000000000120", "rank_00000"):
        assert parse_step(name) is None, name
    for name in ("rank_3", "rank_000003", ".rank_00003.tmp-abc", "step_000000000120"):
        assert parse_rank(name) is None, name
    assert step_of_entry("bucket/run/step_000000000007/") == 7 and step_of_entry("bucket/run/notes") is None
    with pytest.raises(ValueError):
        step_dirname(-1)


def test_leftovers_belong_to_one_shard() -> None:
    tmp, gone = leftover_name("rank_00001", "tmp"), leftover_name("rank_00001", "del")
    assert tmp != leftover_name("rank_00001", "tmp")  # unique per call
    assert is_leftover_of(tmp, "rank_00001") and is_leftover_of(gone, "rank_00001")
    assert not is_leftover_of(tmp, "rank_00011") and not is_leftover_of("rank_00001", "rank_00001")
    with pytest.raises(ValueError):
        leftover_name("rank_00001", "old")


def test_discovery_lists_only_our_directories(tmp_path: Path) -> None:
    for step in (20, 3):
        for rank in (1, 0):
            (tmp_path / step_dirname(step) / rank_dirname(rank)).mkdir(parents=True)
    (tmp_path / step_dirname(3) / leftover_name(rank_dirname(2), "tmp")).mkdir()
    (tmp_path / "step_4").mkdir()
    (tmp_path / step_dirname(5)).write_text("a file, not a step")
    assert list(step_dirs(tmp_path)) == [3, 20]
    assert list(rank_dirs(tmp_path / step_dirname(3))) == [0, 1]
    assert step_dirs(tmp_path / "missing") == {} and rank_dirs(tmp_path / "missing") == {}
