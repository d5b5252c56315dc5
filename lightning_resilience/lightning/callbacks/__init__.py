"""One callback per module."""

from lightning_resilience.lightning.callbacks.fault_tolerance import HANG_EXIT_CODE, PREEMPT_EXIT_CODE, FaultTolerance
from lightning_resilience.lightning.callbacks.policy import ResiliencePolicy
from lightning_resilience.lightning.callbacks.resilience_report import ResilienceReportCallback
from lightning_resilience.lightning.callbacks.sdc import SDCVerification
from lightning_resilience.lightning.callbacks.sdc_inject import BitFlipInjection
from lightning_resilience.lightning.callbacks.straggler import STRAGGLER_EXIT_CODE, StragglerDetection
from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint

__all__ = [
    "BitFlipInjection",
    "HANG_EXIT_CODE",
    "PREEMPT_EXIT_CODE",
    "STRAGGLER_EXIT_CODE",
    "FaultTolerance",
    "ResiliencePolicy",
    "ResilienceReportCallback",
    "SDCVerification",
    "StragglerDetection",
    "TieredCheckpoint",
]
