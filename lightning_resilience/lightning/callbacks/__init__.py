"""One callback per module."""

from lightning_resilience.lightning.callbacks.fault_tolerance import FaultTolerance
from lightning_resilience.lightning.callbacks.policy import ResiliencePolicy
from lightning_resilience.lightning.callbacks.resilience_report import ResilienceReportCallback
from lightning_resilience.lightning.callbacks.sdc import SDCVerification
from lightning_resilience.lightning.callbacks.sdc_inject import BitFlipInjection
from lightning_resilience.lightning.callbacks.straggler import StragglerDetection
from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint

__all__ = [
    "BitFlipInjection",
    "FaultTolerance",
    "ResiliencePolicy",
    "ResilienceReportCallback",
    "SDCVerification",
    "StragglerDetection",
    "TieredCheckpoint",
]
