"""Fault tolerance engine: hang detection, preemption agreement, restart awareness and ETTR accounting.

Framework-free (torch and torch.distributed only); the Lightning adapter is
:class:`lightning_resilience.lightning.callbacks.fault_tolerance.FaultTolerance`.
"""

from lightning_resilience.ft.ettr import AttemptRecord, EttrLedger, EttrReport
from lightning_resilience.ft.heartbeat import RankMonitorBridge, connect_rank_monitor
from lightning_resilience.ft.preemption import PreemptionNotice
from lightning_resilience.ft.rendezvous import attempt_store, restart_hazard
from lightning_resilience.ft.restart import Attempt, FaultNote, current_attempt, read_fault_notes, write_fault_note
from lightning_resilience.ft.watchdog import Hang, HangHandler, TimeoutCalibrator, Watchdog, dump_stacks

__all__ = [
    "Attempt",
    "AttemptRecord",
    "EttrLedger",
    "EttrReport",
    "FaultNote",
    "Hang",
    "HangHandler",
    "PreemptionNotice",
    "RankMonitorBridge",
    "TimeoutCalibrator",
    "Watchdog",
    "attempt_store",
    "connect_rank_monitor",
    "current_attempt",
    "dump_stacks",
    "read_fault_notes",
    "restart_hazard",
    "write_fault_note",
]
