"""Failure attribution: from what an attempt left behind (rank exits, fault notes, stack dumps), which rank failed
first and why, and which ranks only ended because of it. One engine, used by the launcher (its restart decision and
attempt records) and by the end-of-run report, so both name the same culprit. Framework-free; it imports neither the
launcher nor the report."""

from lightning_resilience.attribution.engine import (
    AttemptEvidence,
    Attribution,
    FailureKind,
    RankExit,
    RankFailure,
    Role,
    attribute,
    attribute_all,
)

__all__ = [
    "AttemptEvidence",
    "Attribution",
    "FailureKind",
    "RankExit",
    "RankFailure",
    "Role",
    "attribute",
    "attribute_all",
]
