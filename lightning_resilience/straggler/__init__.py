"""Straggler (fail-slow) detection: per-rank timing with the collective waits taken out, relative and individual
scores, change-point verdicts confirmed by a sustained slowdown, a job-wide slowdown verdict, and an action ladder
every rank applies at the same step."""

from lightning_resilience.straggler.changepoint import ChangePointEvents, RobustCusum
from lightning_resilience.straggler.detector import AUTO_SECTIONS, StragglerDetector
from lightning_resilience.straggler.exchange import (
    GatherFn,
    GlooGather,
    Payload,
    StragglerGatherError,
    gloo_gather,
)
from lightning_resilience.straggler.kernels import NvrxKernelScores, open_kernel_scores
from lightning_resilience.straggler.policy import LEVEL_ACTIONS, ActionLadder, Escalation, StragglerFinding
from lightning_resilience.straggler.probes import WaitProbe, find_parallelism
from lightning_resilience.straggler.scoreboard import Scoreboard
from lightning_resilience.straggler.scores import (
    IndividualBaseline,
    excess_slowdowns,
    leave_one_out_reference,
    relative_slowdowns,
)
from lightning_resilience.straggler.timing import (
    BACKWARD,
    COMPUTE,
    DATA,
    FORWARD,
    OPTIMIZER,
    STEP,
    WAIT,
    CudaEventSource,
    StepTimer,
    TimeSource,
    WallClockSource,
)

__all__ = [
    "AUTO_SECTIONS",
    "BACKWARD",
    "COMPUTE",
    "DATA",
    "FORWARD",
    "OPTIMIZER",
    "STEP",
    "WAIT",
    "LEVEL_ACTIONS",
    "ActionLadder",
    "ChangePointEvents",
    "CudaEventSource",
    "Escalation",
    "GatherFn",
    "GlooGather",
    "IndividualBaseline",
    "NvrxKernelScores",
    "Payload",
    "RobustCusum",
    "Scoreboard",
    "StepTimer",
    "StragglerDetector",
    "StragglerGatherError",
    "TimeSource",
    "StragglerFinding",
    "WaitProbe",
    "WallClockSource",
    "excess_slowdowns",
    "find_parallelism",
    "gloo_gather",
    "leave_one_out_reference",
    "open_kernel_scores",
    "relative_slowdowns",
]
