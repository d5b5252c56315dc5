"""The attempt-scoped store and the restart-hazard message (the launch lines that hang are drilled in
tests/drills/test_launch.py)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_resilience.ft.rendezvous import SCOPED_STORE_ENV, agent_store_shared, attempt_store, restart_hazard
from lightning_resilience.ft.restart import ATTEMPT_ENV, current_attempt

TORCHRUN_ENV = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*TORCHRUN_ENV, SCOPED_STORE_ENV, ATTEMPT_ENV, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    return monkeypatch


def test_hazard_named_for_restarts_on_a_shared_store(torchrun_env: pytest.MonkeyPatch) -> None:
    message = restart_hazard()
    assert message is not None and "--max-restarts 2" in message
    assert "lightning-resilience launch" in message and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in message


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TORCHELASTIC_MAX_RESTARTS", "0"),  # no restarts: nothing can hang on one
        ("TORCHELASTIC_USE_AGENT_STORE", "False"),  # c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a new store each
        (ATTEMPT_ENV, "3"),  # our launcher: a new agent and store each attempt
        (SCOPED_STORE_ENV, "lightning_resilience/run-7/attempt_0"),  # ResilientDDPStrategy scoped the store
    ],
)
def test_no_hazard(torchrun_env: pytest.MonkeyPatch, name: str, value: str) -> None:
    torchrun_env.setenv(name, value)
    assert restart_hazard() is None


def test_attempt_store_hides_the_keys_of_earlier_attempts(torchrun_env: pytest.MonkeyPatch) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    torchrun_env.setenv("MASTER_ADDR", "127.0.0.1")
    torchrun_env.setenv("MASTER_PORT", str(server.port))
    torchrun_env.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = attempt_store(timedelta(seconds=10))
    assert first is not None
    first.set("default_pg/0//cpu//0/1", "address of rank 1 in attempt 0")
    torchrun_env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = attempt_store(timedelta(seconds=10))
    assert second is not None
    assert not second.check(["default_pg/0//cpu//0/1"])  # the restarted rank waits for its peer's new address
    assert first.check(["default_pg/0//cpu//0/1"])
    assert os.environ[SCOPED_STORE_ENV] == "lightning_resilience/run-7/attempt_1"
    assert restart_hazard() is None


def test_no_attempt_store_when_each_attempt_has_a_new_store(torchrun_env: pytest.MonkeyPatch) -> None:
    torchrun_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert not agent_store_shared()
    assert attempt_store(timedelta(seconds=1)) is None


def test_launcher_attempt_wins_over_torchrun_restart_count(torchrun_env: pytest.MonkeyPatch) -> None:
    torchrun_env.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    torchrun_env.setenv(ATTEMPT_ENV, "4")
    attempt = current_attempt(rank=1, world_size=2)
    assert attempt.launcher == "lightning-resilience" and attempt.restart_count == 4
