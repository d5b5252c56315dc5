"""In-process rollback: restore the newest RAM snapshot before a bad step in the running process, skip the offending
batch, and continue (the policy action ``rollback_in_process``). The engine here imports no Lightning; the adapter is
:mod:`lightning_resilience.lightning.rollback`."""

from lightning_resilience.rollback.config import RollbackConfig
from lightning_resilience.rollback.governor import LrCooldown, RollbackGovernor, RollbackPlan, RollbackRecord
from lightning_resilience.rollback.quarantine import append_quarantine, quarantined_indices, read_quarantine

__all__ = [
    "LrCooldown",
    "RollbackConfig",
    "RollbackGovernor",
    "RollbackPlan",
    "RollbackRecord",
    "append_quarantine",
    "quarantined_indices",
    "read_quarantine",
]
