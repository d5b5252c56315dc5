"""Bridge to NVRx's rank monitor: heartbeats and sections for ``ft_launcher``'s hang detection and in-job restart.

Under ``ft_launcher`` (nvidia-resiliency-ext), each rank has a ``RankMonitorServer`` reached through the Unix socket
named by ``FT_RANK_MONITOR_IPC_SOCKET``; the launcher restarts the group when a rank misses its heartbeat or overruns
a section. :func:`connect_rank_monitor` connects a ``RankMonitorClient`` when that socket is set, and otherwise says
why not, so the caller logs the reason and relies on its own watchdog.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["RankMonitorBridge", "connect_rank_monitor"]

log = logging.getLogger(__name__)

SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"


class RankMonitorBridge:
    """Heartbeats and sections of one rank, sent to NVRx's ``RankMonitorClient``.

    Sections are forwarded only if the launcher's FT config names them (``--ft-rank-section-timeouts``); others are
    covered by the heartbeat and the out-of-section timeout. Errors of the monitor are logged, never raised into
    training: the launcher's own timeouts then end the rank.

    Args:
        client: an initialised ``nvidia_resiliency_ext.fault_tolerance.RankMonitorClient`` (or a test double).
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        cfg = getattr(client, "cfg", None)
        self.sections = set(getattr(cfg, "rank_section_timeouts", None) or {})
        self._open: set[str] = set()
        self.heartbeats = 0
        self.errors = 0
        self.calibrated = False

    def _call(self, name: str, *args: Any) -> bool:
        try:
            getattr(self.client, name)(*args)
            return True
        except Exception as err:  # the launcher's timeouts still cover this rank
            self.errors += 1
            log.error("NVRx rank monitor: %s%s failed: %s", name, args, err)
            return False

    def heartbeat(self) -> None:
        if self._call("send_heartbeat"):
            self.heartbeats += 1

    def start_section(self, section: str) -> None:
        if section in self.sections and section not in self._open and self._call("start_section", section):
            self._open.add(section)

    def end_section(self, section: str) -> None:
        if section in self._open:
            self._open.discard(section)
            self._call("end_section", section)

    def calibrate(self) -> bool:
        """Let NVRx compute its heartbeat and section timeouts from what it saw (collective: every rank calls)."""
        ok = self._call("calculate_and_set_hb_timeouts", True)
        if self.sections:
            ok = self._call("calculate_and_set_section_timeouts", None, True, True) and ok
        self.calibrated = ok
        return ok

    def state_dict(self) -> dict[str, Any]:
        try:
            return dict(self.client.state_dict())
        except Exception as err:
            log.warning("NVRx rank monitor state not saved: %s", err)
            return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            self._call("load_state_dict", state)

    def close(self) -> None:
        if self._open:
            self._call("end_all_sections")
            self._open.clear()
        self._call("shutdown_workload_monitoring")


def connect_rank_monitor(mode: str = "auto") -> tuple[RankMonitorBridge | None, str]:
    """Connect to NVRx's rank monitor if this rank was started by ``ft_launcher``.

    Args:
        mode: 'auto' (connect when available), 'off', or 'require' (raise if unavailable).

    Returns:
        The bridge (or None) and a one-line reason for the log.
    """
    if mode == "off":
        return None, "NVRx rank monitor disabled (ft.nvrx=off)"
    reason = ""
    if not os.environ.get(SOCKET_ENV):
        reason = f"not launched by NVRx ft_launcher ({SOCKET_ENV} unset)"
    else:
        try:
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
        except Exception as err:  # an ImportError, or a CUDA-only dependency failing at import
            reason = f"nvidia_resiliency_ext.fault_tolerance unavailable: {type(err).__name__}: {err}"
        else:
            client = RankMonitorClient()
            try:
                client.init_workload_monitoring()
            except Exception as err:
                reason = f"NVRx rank monitor did not accept the connection: {type(err).__name__}: {err}"
            else:
                bridge = RankMonitorBridge(client)
                return bridge, f"NVRx rank monitor connected (sections {sorted(bridge.sections)})"
    if mode == "require":
        raise RuntimeError(f"ft.nvrx=require but {reason}; launch with ft_launcher or set ft.nvrx=auto")
    return None, reason
