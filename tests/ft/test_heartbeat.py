"""The NVRx rank-monitor bridge: clean detection of ``ft_launcher``, sections forwarded only when configured, monitor
errors logged instead of raised into training."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_resilience.ft.heartbeat import SOCKET_ENV, RankMonitorBridge, connect_rank_monitor


class FakeClient:
    """Records the calls a ``RankMonitorClient`` receives (the protocol of nvidia_resiliency_ext 0.4.1)."""

    def __init__(self, sections: dict[str, float], fail: set[str] | None = None) -> None:
        self.cfg = SimpleNamespace(rank_section_timeouts=sections)
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail or set()

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.calls.append((name, *args))
            if name in self.fail:
                raise ConnectionError(f"{name} failed")
            return {"current_timeouts": {"heartbeat": {"initial": 1.0}}} if name == "state_dict" else None

        return call


def test_only_configured_sections_are_forwarded_and_never_opened_twice() -> None:
    client = FakeClient({"step": 60.0, "checkpointing": 120.0})
    bridge = RankMonitorBridge(client)
    bridge.start_section("setup")  # not in the launcher's config: the heartbeat covers it
    bridge.start_section("step")
    bridge.start_section("step")
    bridge.heartbeat()
    bridge.end_section("step")
    bridge.end_section("step")
    assert client.calls == [("start_section", "step"), ("send_heartbeat",), ("end_section", "step")]
    assert bridge.heartbeats == 1


def test_monitor_errors_are_counted_not_raised() -> None:
    client = FakeClient({"step": 60.0}, fail={"send_heartbeat", "start_section"})
    bridge = RankMonitorBridge(client)
    bridge.heartbeat()
    bridge.start_section("step")
    bridge.end_section("step")  # never opened: nothing sent
    assert bridge.errors == 2 and bridge.heartbeats == 0
    assert ("end_section", "step") not in client.calls


def test_calibration_state_and_close() -> None:
    client = FakeClient({"step": 60.0})
    bridge = RankMonitorBridge(client)
    assert bridge.calibrate() and bridge.calibrated
    assert ("calculate_and_set_hb_timeouts", True) in client.calls
    assert ("calculate_and_set_section_timeouts", None, True, True) in client.calls
    state = bridge.state_dict()
    bridge.load_state_dict(state)
    assert ("load_state_dict", state) in client.calls
    bridge.start_section("step")
    bridge.close()
    assert client.calls[-2:] == [("end_all_sections",), ("shutdown_workload_monitoring",)]


def test_without_ft_launcher_auto_falls_back_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    bridge, reason = connect_rank_monitor("auto")
    assert bridge is None and SOCKET_ENV in reason
    bridge, reason = connect_rank_monitor("off")
    assert bridge is None and "disabled" in reason
    with pytest.raises(RuntimeError, match=r"ft\.nvrx=require"):
        connect_rank_monitor("require")


def test_a_socket_nobody_serves_falls_back_with_a_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv(SOCKET_ENV, str(tmp_path / "no-server.socket"))
    monkeypatch.setenv("RANK", "0")
    bridge, reason = connect_rank_monitor("auto")
    assert bridge is None and "did not accept the connection" in reason
