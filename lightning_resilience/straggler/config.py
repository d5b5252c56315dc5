"""Configuration of the straggler (fail-slow) detector and its action ladder."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta

from lightning_resilience._configurable import ConfigError, StrEnum, as_enum

__all__ = ["DetectOn", "LevelAction", "Reference", "ScoringPlace", "StragglerConfig", "StragglerLevelConfig"]


class LevelAction(StrEnum):
    """What a rung of the ladder does (see :class:`~lightning_resilience.straggler.policy.Action`)."""

    log = "log"
    alert = "alert"
    stop = "stop"


class Reference(StrEnum):
    """What a rank's time is compared with in the relative score."""

    median = "median"
    fastest = "fastest"


class DetectOn(StrEnum):
    """The series the change-point test runs on."""

    relative = "relative"
    individual = "individual"


class ScoringPlace(StrEnum):
    """Where rank 0 scores the exchanged timings."""

    process = "process"
    thread = "thread"


@dataclass(kw_only=True)
class StragglerLevelConfig:
    """One rung of the action ladder: what to do once a confirmed straggler stays this slow for this long."""

    action: LevelAction
    """'log' (a warning), 'alert' (a logged event and a metric), or 'stop' (checkpoint now and stop with the
    straggler exit code)."""
    slowdown: float = 1.1
    """Slowdown factor (straggler time / reference time) at or above which this level counts a step."""
    persist_steps: int = 1
    """Consecutive gathered steps at or above ``slowdown`` (after confirmation) before the level fires."""

    def __post_init__(self) -> None:
        self.action = as_enum(LevelAction, self.action, "straggler.levels", "action")
        if not (math.isfinite(self.slowdown) and self.slowdown > 1.0):
            raise ConfigError("straggler.levels", "slowdown", f"must be a finite factor > 1.0, got {self.slowdown}")
        if self.persist_steps < 1:
            raise ConfigError("straggler.levels", "persist_steps", f"must be >= 1, got {self.persist_steps}")


def _default_levels() -> list[StragglerLevelConfig]:
    return [
        StragglerLevelConfig(action=LevelAction.log, slowdown=1.1, persist_steps=1),
        StragglerLevelConfig(action=LevelAction.alert, slowdown=1.2, persist_steps=5),
    ]


@dataclass(kw_only=True)
class StragglerConfig:
    """Behaviour of the straggler detector: what it times, how often ranks compare, how it decides, what it does."""

    gather_every_n_steps: int = 10
    """Steps between two exchanges of timings. Each exchange carries every rank's timings of each step since the
    previous one to rank 0 along the tree of the step agreement (off the training thread; never N records to every
    rank), where they are scored step by step as if gathered every step. A verdict comes at most this many steps
    (plus one) after the slow steps it rests on; rank 0 then posts what the ladder decided, and the next step's
    agreement carries it to every rank."""
    warmup_steps: int = 5
    """Steps ignored at the start of a run (and after a resume): compilation, allocator and cache warm-up."""
    reference: Reference = Reference.median
    """Relative score reference: the median or the fastest of the OTHER ranks' times for the same step."""
    detect_on: DetectOn = DetectOn.relative
    """Series the change-point test runs on: 'relative' (rank vs the other ranks, insensitive to job-wide slowdowns)
    or 'individual' (rank vs its own best history). A single-rank job always uses 'individual'."""
    window: int = 64
    """Gathered samples kept per rank and section for the robust statistics (median / MAD, own best history)."""
    min_slowdown: float = 1.15
    """Confirmation (FALCON-style): a change point becomes a verdict only if the last ``confirm_steps`` samples, all
    but one, are slowdowns of at least this factor; also the shift the CUSUM is tuned to detect. Real step times
    jitter by several percent on a busy host: 1.15 keeps that out while a 1.2x rank is still named."""
    confirm_steps: int = 5
    """Recent samples that must show ``min_slowdown`` (all of them below 3, else all but one): a shorter hiccup is
    never a straggler; also sets the episode-end hysteresis (2 x this many calm samples)."""
    cusum_threshold: float = 5.0
    """CUSUM decision threshold h, in robust standard deviations (higher: fewer false alarms, slower detection)."""
    cusum_clip: float = 4.0
    """Largest contribution of one sample to the CUSUM, in robust standard deviations: bounds what one spike adds."""
    noise_floor: float = 0.01
    """Smallest noise scale assumed (log units, ~1% jitter): keeps a perfectly steady series from alarming on noise."""
    sections: list[str] | None = None
    """Sections whose series are tested. Unset (the default): 'compute' (the rank's own work: the step minus the
    collective waits the probes measure under DDP and FSDP) and 'data' (the wait for the next batch), so the verdict
    names the slow component. Or name them: 'step' (the whole step), 'forward', 'backward', 'optimizer', 'wait',
    or your own sections. Under data parallelism the gradient all-reduce equalises whole-step times across ranks:
    'step' shows that the job is slower, not who is slow."""
    job_verdicts: bool = True
    """Also report a job-wide slowdown (every rank's own work slower than its own history) as a job verdict
    (rank -1, section 'work'); it reaches only the 'log' and 'alert' levels (no rank to exclude or restart
    without)."""
    job_min_slowdown: float = 1.2
    """Smallest job-wide slowdown reported as a job verdict."""
    noise_level: float = 2.0
    """A confirmed slowdown within this many robust standard deviations of the series' step-to-step jitter is
    noise-level: it is listed as such in the report and never becomes a verdict (on a quiet machine the jitter is
    a few percent and this never matters; on a loaded one it keeps jitter from reading like a finding)."""
    levels: list[StragglerLevelConfig] = field(default_factory=_default_levels)
    """Action ladder; each level fires at most once per straggler episode."""
    gather_timeout_s: float = 120.0
    """Longest wait for the cross-rank exchange of timings (and for rank 0's scorer, when a result is needed)."""
    scoring: ScoringPlace = ScoringPlace.process
    """Where rank 0 scores the exchanged timings: 'process' (a child process forked at the first exchange, which
    dies with its rank: the scoring never holds the training process's interpreter lock) or 'thread' (a thread of
    the training process: its Python competes with the training thread for that lock, measured at about 3 ms per
    exchange of 10 steps on 2 CPU ranks). Where the platform cannot fork, 'process' scores on a thread."""
    cuda_events: bool = True
    """On a GPU, time sections with CUDA events (device time) instead of the host wall clock."""
    kernel_scores: bool = False
    """On a GPU, add the CUPTI kernel scores of nvidia-resiliency-ext as an extra series ('kernels'); ignored (with
    a warning) where CUPTI is unavailable."""

    def __post_init__(self) -> None:
        # Hydra hands over plain dicts for list-of-dataclass fields
        self.levels = [
            lvl if isinstance(lvl, StragglerLevelConfig) else StragglerLevelConfig(**lvl) for lvl in self.levels
        ]
        if self.sections is not None:
            self.sections = [str(s) for s in self.sections]
        for key in ("gather_every_n_steps", "confirm_steps"):
            if getattr(self, key) < 1:
                raise ConfigError("straggler", key, f"must be >= 1, got {getattr(self, key)}")
        if self.warmup_steps < 0:
            raise ConfigError("straggler", "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        self.reference = as_enum(Reference, self.reference, "straggler", "reference")
        self.detect_on = as_enum(DetectOn, self.detect_on, "straggler", "detect_on")
        self.scoring = as_enum(ScoringPlace, self.scoring, "straggler", "scoring")
        if self.window < 4:
            raise ConfigError("straggler", "window", f"must be >= 4, got {self.window}")
        if self.confirm_steps > self.window:
            raise ConfigError(
                "straggler", "confirm_steps", f"must be <= straggler.window ({self.window}), got {self.confirm_steps}"
            )
        if not (math.isfinite(self.min_slowdown) and self.min_slowdown > 1.0):
            raise ConfigError("straggler", "min_slowdown", f"must be a finite factor > 1.0, got {self.min_slowdown}")
        if not (math.isfinite(self.job_min_slowdown) and self.job_min_slowdown > 1.0):
            raise ConfigError(
                "straggler", "job_min_slowdown", f"must be a finite factor > 1.0, got {self.job_min_slowdown}"
            )
        if not (math.isfinite(self.noise_level) and self.noise_level >= 0):
            raise ConfigError("straggler", "noise_level", f"must be >= 0, got {self.noise_level}")
        for key in ("cusum_threshold", "cusum_clip", "noise_floor", "gather_timeout_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError("straggler", key, f"must be > 0, got {value}")
        if self.sections is not None and not self.sections:
            raise ConfigError("straggler", "sections", "must name at least one section (or be null: automatic), got []")
        if self.sections is not None and len(set(self.sections)) != len(self.sections):
            raise ConfigError("straggler", "sections", f"must not repeat a name, got {self.sections}")
        actions = [str(lvl.action) for lvl in self.levels]
        if len(set(actions)) != len(actions):
            raise ConfigError("straggler", "levels", f"must name each action at most once, got {actions}")

    @property
    def gather_timeout(self) -> timedelta:
        return timedelta(seconds=self.gather_timeout_s)
