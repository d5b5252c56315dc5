"""`lightning-resilience ckpt ...` and `report` on checkpoints written by the real engine and a real Lightning run."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_resilience.checkpoint.delta_tier import DeltaLocalTier
from lightning_resilience.checkpoint.local import LocalTier, step_dirname
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.cli import main
from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint
from lightning_resilience.report import assemble, save_json
from lightning_resilience.testing.faults import FaultPlan
from tests.lightning._training import SettlePersists, assert_bitwise_equal, build, trainer, weights


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 32, generator=g)
    # a few entries move each step, most stay: the delta tier stores small deltas
    moved = base.clone()
    moved[:4] += step
    return {"model": {"w": moved, "b": torch.full((32,), float(step))}, "step": step, "note": "engine test"}


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """Two tiers written by the engine: ``local`` (full shards, steps 2..8) and ``delta`` (full at 3, deltas after)."""
    tiers = [
        LocalTier(tmp_path / "ckpt" / "local", every_n_steps=2, keep=10),
        DeltaLocalTier(tmp_path / "ckpt" / "delta", every_n_steps=3, keep=10, name="delta", full_every=10),
    ]
    manager = CheckpointManager(tiers)
    manager.setup()
    manager.add_meta_provider(lambda step: {"sdc_verified": step % 2 == 0})
    try:
        for step in range(1, 10):
            manager.on_step(step, partial(_state, step), meta={"epoch": 0})
            assert manager.wait()
    finally:
        manager.close()
    yield tmp_path / "ckpt"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_ls_lists_tiers_steps_kinds_and_verification(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "ckpt", "ls", str(root))
    assert rc == 0
    assert "tier local" in out and "tier delta" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    assert set(rows) == {"2", "4", "6", "8", "3", "9"}
    assert "full" in rows["3"] and "delta of 3" in rows["9"]
    assert "1/1" in rows["4"] and "yes" in rows["4"]
    assert "verified, content print" in rows["4"] and "unverified" in rows["9"]


def test_ls_shows_a_rejected_step_and_verify_refuses_another_steps_tensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = LocalTier(tmp_path / "durable", every_n_steps=1, keep=10, name="durable")
    FaultPlan().fail_at(None, 3, "tier.durable.write", "stale").instrument(tier)  # step 3 holds step 2's tensors
    manager = CheckpointManager([tier])
    manager.setup()
    try:
        for step in range(1, 6):
            manager.on_step(step, partial(_state, step))
            assert manager.wait()
        assert manager.reject(4, "SDC at step 6: inconclusive") == [5]
    finally:
        manager.close()
    rc, out, _ = _run(capsys, "ckpt", "ls", str(tmp_path / "durable"))
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    assert rc == 0 and "rejected: SDC at step 6: inconclusive" in rows["5"] and "unverified" in rows["4"]
    rc, out, _ = _run(capsys, "ckpt", "verify", str(tmp_path / "durable"))
    assert rc == 1 and "3 valid, 1 corrupt" in out and "REJECTED tier durable step 5" in out
    [corrupt] = [line for line in out.splitlines() if line.startswith("CORRUPT")]
    assert "step_000000000003" in corrupt and "are not the state that was snapshotted" in corrupt


def test_verify_passes_then_names_the_corrupt_file(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "ckpt", "verify", str(root))
    assert rc == 0 and "7 valid, 0 corrupt" in out  # local 2, 4, 6, 8; delta 3, 6, 9
    delta_bin = root / "delta" / step_dirname(9) / "rank_00000" / "delta.bin"
    raw = bytearray(delta_bin.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    delta_bin.write_bytes(bytes(raw))
    rc, out, _ = _run(capsys, "ckpt", "verify", str(root))
    assert rc == 1
    assert f"CORRUPT  {delta_bin.parent}: checksum mismatch in delta.bin" in out
    assert "6 valid, 1 corrupt" in out
    # the other steps are still good, one at a time
    assert _run(capsys, "ckpt", "verify", str(root), "--step", "6")[0] == 0
    # the top-level alias is the same command
    assert _run(capsys, "verify", str(root / "delta"))[0] == 1


def test_verify_names_a_delta_whose_base_is_gone(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "delta" / step_dirname(3) / "rank_00000" / "manifest.json").unlink()  # base step 3 uncommitted
    rc, out, _ = _run(capsys, "ckpt", "verify", str(root / "delta"))
    assert rc == 1
    assert "delta against full step 3, which is missing" in out
    assert "no manifest" in out  # the base itself


def test_verify_detects_a_truncated_file(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = next((root / "local" / step_dirname(4) / "rank_00000").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-3])
    rc, out, _ = _run(capsys, "ckpt", "verify", str(root), "--tier", "local")
    assert rc == 1 and f"file {data.name} has" in out and "manifest says" in out


def test_inspect_shows_a_manifest(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "ckpt", "inspect", str(root), "--step", "9", "--rank", "0")
    assert rc == 0
    assert "delta of step 3" in out and "rank / world size │ 0 / 1" in out
    assert "2 tensors, 8.12 KiB" in out  # 64x32 + 32 float32
    assert '"sdc_verified": false' in out and "lightning_resilience" in out and "zstandard" in out
    assert "model/w" in out and "[64, 32]" in out
    # step 4 is in one tier only: it is found there; step 6 is in both: the choice is said, --tier overrides it
    rc, out, _ = _run(capsys, "inspect", str(root), "--step", "4")
    assert rc == 0 and "tier              │ local" in out
    rc, out, _ = _run(capsys, "ckpt", "inspect", str(root), "--step", "6")
    assert rc == 0 and "step 6 is in tiers delta, local; using 'delta' (choose with --tier)" in out
    rc, out, _ = _run(capsys, "ckpt", "inspect", str(root), "--step", "6", "--tier", "local")
    assert rc == 0 and "tier              │ local" in out and "kind              │ full" in out
    # without --step or --rank the top-level `inspect` lists, like `ckpt ls`
    rc, out, _ = _run(capsys, "inspect", str(root))
    assert rc == 0 and "tier local" in out and "tier delta" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["ckpt", "inspect", "{root}", "--step", "5"],
            "step 5 not found under {root}; steps present: [2, 3, 4, 6, 8, 9]",
        ),
        (["ckpt", "inspect", "{root}", "--step", "4", "--rank", "3"], "rank 3 not found for step 4"),
        (["ckpt", "verify", "{root}", "--tier", "s3"], "no tier 's3' under {root}; tiers present: delta, local"),
        (["ckpt", "verify", "{root}/nothing"], "{root}/nothing does not exist"),
        (["ckpt", "export", "{root}", "--to", "{root}/out.bin"], "--to must end in .ckpt, .pt, .pth or .safetensors"),
        (["ckpt", "export", "{root}", "--step", "8", "--to", "{root}/x.ckpt"], "not a Lightning checkpoint"),
        (["report", "{root}"], "no resilience report at {root}/resilience_report.json"),
    ],
)
def test_bad_requests_fail_with_a_clear_message(
    root: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    rc, _, err = _run(capsys, *[a.format(root=root) for a in argv])
    assert rc == 2
    assert err.startswith("error: ") and message.format(root=root) in err


def test_bad_arguments_are_refused_by_the_parser(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["ckpt"], ["ckpt", "inspect", str(root), "--step", "-1"], ["ckpt", "export", str(root)]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "must be >= 0, got -1" in err and "the following arguments are required: --to" in err


def test_empty_directory_has_no_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "ckpt", "ls", str(tmp_path))
    assert rc == 2 and f"no checkpoint shards under {tmp_path}" in err


def test_report_renders_a_saved_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = assemble(
        {"run": {"status": "finished"}, "fault_tolerance": {"ettr": {"ettr": 0.875, "wall_s": 8.0}, "attempts": []}},
        summaries={"fault_tolerance": "fault tolerance: timeouts step 30s"},
        step_seconds=0.5,
    )
    save_json(report, tmp_path)
    rc, out, _ = _run(capsys, "report", str(tmp_path), "--summaries")
    assert rc == 0
    assert "ETTR" in out and "0.875" in out and "500.00 ms" in out
    assert "fault tolerance: timeouts step 30s" in out


# ------------------------------------------------------------------------------------- Lightning export
class _Record(Callback):
    """Keeps the weights after a given step, and the step and weights a run starts from."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.at_weights: dict[str, torch.Tensor] | None = None
        self.start_step: int | None = None
        self.start_weights: dict[str, torch.Tensor] | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start_step, self.start_weights = trainer.global_step, weights(pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.at:
            self.at_weights = weights(pl_module)


def test_export_resumes_a_plain_lightning_trainer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A step exported from a TieredCheckpoint run (a delta shard) resumes a stock Trainer at that step, with the
    weights the run had then; the safetensors export holds the model's state_dict."""
    ckpt = tmp_path / "ckpt"
    model, data = build()
    record = _Record(at=8)
    tiers = [MemoryTier(every_n_steps=1), DeltaLocalTier(ckpt, every_n_steps=4, keep=5, full_every=3)]
    tiered = TieredCheckpoint(tiers)
    # each persist finishes before the next step: on a loaded machine a busy worker would defer step 8's to step 9
    trainer(10, [tiered, SettlePersists(1), record]).fit(model, datamodule=data)
    final = weights(model)
    rc, out, _ = _run(capsys, "ckpt", "ls", str(ckpt))
    assert rc == 0 and "delta of 4" in out  # steps 4 (full), 8 and 10 (deltas)

    exported = tmp_path / "export" / "step8.ckpt"
    rc, out, _ = _run(capsys, "ckpt", "export", str(ckpt), "--step", "8", "--to", str(exported))
    assert rc == 0 and "global step 8" in out
    assert not [p for p in exported.parent.iterdir() if p.name.startswith(".")]

    model2, data2 = build(seed=99)  # other initial weights: the checkpoint must replace them
    resumed = _Record(at=-1)
    plain = trainer(12, [resumed])
    plain.fit(model2, datamodule=data2, ckpt_path=str(exported))
    assert resumed.start_step == 8
    assert record.at_weights is not None and resumed.start_weights is not None
    assert_bitwise_equal(resumed.start_weights, record.at_weights)
    assert plain.global_step == 12

    st = tmp_path / "final.safetensors"
    rc, out, _ = _run(capsys, "ckpt", "export", str(ckpt), "--to", str(st))  # newest step: 10
    assert rc == 0 and "global step 10" in out
    from safetensors.torch import load_file

    assert_bitwise_equal(load_file(str(st)), final)
    header = json.loads(st.read_bytes()[8 : 8 + int.from_bytes(st.read_bytes()[:8], "little")])
    assert header["__metadata__"]["global_step"] == "10"


def test_a_save_checkpoint_directory_is_understood(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The layout ``Trainer.save_checkpoint(path)`` writes (one shard per rank, no step directories)."""
    from lightning_resilience.checkpoint.standalone import save_checkpoint_dir

    path = tmp_path / "epoch=1.ckpt"
    for rank in range(2):
        save_checkpoint_dir(path, {"state_dict": {"w": torch.full((3,), float(rank))}}, step=7, rank=rank, world_size=2)
    rc, out, _ = _run(capsys, "ckpt", "ls", str(path))
    assert rc == 0 and "2/2" in out and "yes" in out
    rc, out, _ = _run(capsys, "ckpt", "verify", str(path))
    assert rc == 0 and "2 valid, 0 corrupt" in out
    rc, out, _ = _run(capsys, "ckpt", "inspect", str(path / "rank_00001"))
    assert rc == 0 and "rank / world size │ 1 / 2" in out and "step              │ 7" in out
    shutil.rmtree(path / "rank_00001")
    rc, out, _ = _run(capsys, "ckpt", "verify", str(path))
    assert rc == 0 and "no valid shard here for ranks [1]" in out
    exported = tmp_path / "w.safetensors"
    assert _run(capsys, "ckpt", "export", str(path), "--to", str(exported))[0] == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(exported))["w"], torch.zeros(3))
