"""Silent data corruption (SDC) verification: cheap guards, dual-run replay of a step's local gradients,
cross-replica reconciliation of parameters and optimizer state, localisation by vote, and bit-flip injection."""

from lightning_resilience.sdc.fingerprint import BitwiseDigest, Digest, ToleranceDigest, make_digest
from lightning_resilience.sdc.guards import GuardReport, Guards, RobustBaseline
from lightning_resilience.sdc.inject import BIT_CLASSES, LOCATIONS, BitFlipInjector, FlipRecord, FlipSpec, flip_bit_
from lightning_resilience.sdc.localize import Ballot, Opinion, vote
from lightning_resilience.sdc.monitor import SDCMonitor, SDCStats, StepOutcome
from lightning_resilience.sdc.reconcile import ReplicaReconciler
from lightning_resilience.sdc.replay import BucketFingerprintHook, GradientReplayer, capture_rng, rng_as
from lightning_resilience.sdc.verdict import Diagnosis, SDCEvent, SilentDataCorruptionError

__all__ = [
    "BIT_CLASSES",
    "LOCATIONS",
    "Ballot",
    "BitFlipInjector",
    "BitwiseDigest",
    "BucketFingerprintHook",
    "Digest",
    "FlipRecord",
    "FlipSpec",
    "GradientReplayer",
    "GuardReport",
    "Guards",
    "Opinion",
    "ReplicaReconciler",
    "RobustBaseline",
    "SDCEvent",
    "SDCMonitor",
    "SDCStats",
    "SilentDataCorruptionError",
    "StepOutcome",
    "ToleranceDigest",
    "Diagnosis",
    "capture_rng",
    "flip_bit_",
    "make_digest",
    "rng_as",
    "vote",
]
