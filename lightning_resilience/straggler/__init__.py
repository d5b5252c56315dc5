"""Straggler (fail-slow) detection: per-rank step timing, relative and individual scores, change-point verdicts
confirmed by a sustained slowdown, and an action ladder every rank applies at the same step."""

from lightning_resilience.straggler.changepoint import ChangePointEvents, RobustCusum
from lightning_resilience.straggler.detector import (
    GatherFn,
    GlooGather,
    Payload,
    StragglerDetector,
    StragglerGatherError,
    gloo_gather,
)
from lightning_resilience.straggler.kernels import NvrxKernelScores, open_kernel_scores
from lightning_resilience.straggler.policy import STRAGGLER_EXIT_CODE, Action, ActionLadder, Decision, Verdict
from lightning_resilience.straggler.scores import IndividualBaseline, relative_slowdowns
from lightning_resilience.straggler.timing import (
    DATA,
    STEP,
    CudaEventSource,
    StepTimer,
    TimeSource,
    WallClockSource,
)

__all__ = [
    "DATA",
    "STEP",
    "STRAGGLER_EXIT_CODE",
    "Action",
    "ActionLadder",
    "ChangePointEvents",
    "CudaEventSource",
    "Decision",
    "GatherFn",
    "GlooGather",
    "IndividualBaseline",
    "NvrxKernelScores",
    "Payload",
    "RobustCusum",
    "StepTimer",
    "StragglerDetector",
    "StragglerGatherError",
    "TimeSource",
    "Verdict",
    "WallClockSource",
    "gloo_gather",
    "open_kernel_scores",
    "relative_slowdowns",
]
