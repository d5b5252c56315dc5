"""Configuration of fault tolerance: hang detection, preemption, the NVRx rank-monitor bridge and the ETTR ledger."""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field

from lightning_resilience._configurable import ConfigError, StrEnum, as_enum

__all__ = ["SECTIONS", "FaultToleranceConfig", "NvrxMode"]


class NvrxMode(StrEnum):
    """Whether the NVRx rank monitor is used."""

    auto = "auto"
    off = "off"
    require = "require"


SECTIONS = ("setup", "step", "out_of_section", "validation", "checkpointing")
"""Sections the watchdog times: ``out_of_section`` is the time between steps (data loading, other callbacks)."""


def _default_initial_timeouts() -> dict[str, float]:
    return {"setup": 900.0, "step": 600.0, "out_of_section": 600.0, "validation": 1800.0, "checkpointing": 1200.0}


@dataclass(kw_only=True)
class FaultToleranceConfig:
    """Hang detection, preemption handling, restart bookkeeping and time accounting of one training run."""

    run_dir: str | None = None
    """Directory for the ledger, fault notes and stack dumps; survives restarts. None: <default_root_dir>/resilience."""
    initial_timeouts_s: dict[str, float] = field(default_factory=_default_initial_timeouts)
    """Timeout per section until it is calibrated (and for sections never calibrated). Missing sections keep their
    defaults: setup 900, step 600, out_of_section 600, validation 1800, checkpointing 1200."""
    calibrate: bool = True
    """Replace the initial timeouts by ``safety_factor`` x the longest observed duration once warmed up."""
    calibrated_sections: list[str] = field(default_factory=lambda: ["step", "out_of_section", "validation"])
    """Sections whose timeouts are calibrated. 'setup' and 'checkpointing' are not by default: their duration
    depends on what is restored or flushed, which differs between a fresh start and a restart."""
    safety_factor: float = 5.0
    """Calibrated timeout = safety_factor x longest observed duration, clamped to [min_timeout_s, max_timeout_s]."""
    warmup_steps: int = 5
    """Observations of 'step' and 'out_of_section' before their timeouts are calibrated (other sections: 1)."""
    provisional_factor: float = 2.0
    """Between a section's first observation and its warm-up, its timeout is provisional_factor x the calibrated
    rule (safety_factor x longest so far), clamped to [min_timeout_s, its initial timeout]: a hang at step 2 is
    found in about a minute instead of the initial 10. 0: the initial timeouts hold until warm-up."""
    min_timeout_s: float = 60.0
    """Lower bound of a calibrated timeout: a loaded machine can slow a step far beyond its warm-up duration."""
    max_timeout_s: float = 3600.0
    """Upper bound of a calibrated timeout."""
    dump_stacks: bool = True
    """On a hang, dump every thread's Python stack of the hung rank to <run_dir>/stacks/."""
    exit_on_hang: bool = True
    """End the hung rank with ExitCode.HANG so the launcher restarts the group (False: log only). The policy's
    ``hang`` setting must allow it too (``dump_and_exit``, the default)."""
    preemption_signals: list[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signals taken as a preemption notice: all ranks stop at an agreed step boundary, save and exit."""
    nvrx: NvrxMode = NvrxMode.auto
    """NVRx rank-monitor heartbeats and sections: 'auto' when launched by ft_launcher, 'off', or 'require'."""
    ledger_interval_s: float = 1.0
    """Shortest interval between two ledger heartbeats (0: every step). The restart gap is overestimated by at
    most this much."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.initial_timeouts_s) - set(SECTIONS))
        if unknown:
            raise ConfigError("ft", "initial_timeouts_s", f"has unknown sections {unknown}; known: {list(SECTIONS)}")
        for name, value in self.initial_timeouts_s.items():
            if not (math.isfinite(value) and value > 0):
                raise ConfigError("ft", f"initial_timeouts_s.{name}", f"must be a finite number > 0, got {value}")
        unknown = sorted(set(self.calibrated_sections) - set(SECTIONS))
        if unknown:
            raise ConfigError("ft", "calibrated_sections", f"has unknown sections {unknown}; known: {list(SECTIONS)}")
        self.initial_timeouts_s = {**_default_initial_timeouts(), **self.initial_timeouts_s}
        if not (math.isfinite(self.safety_factor) and self.safety_factor >= 1.0):
            raise ConfigError("ft", "safety_factor", f"must be a finite number >= 1, got {self.safety_factor}")
        if self.warmup_steps < 1:
            raise ConfigError("ft", "warmup_steps", f"must be >= 1, got {self.warmup_steps}")
        factor = self.provisional_factor
        if not (math.isfinite(factor) and (factor == 0 or factor >= 1)):
            raise ConfigError("ft", "provisional_factor", f"must be 0 (off) or a finite number >= 1, got {factor}")
        if not self.min_timeout_s > 0:
            raise ConfigError("ft", "min_timeout_s", f"must be > 0, got {self.min_timeout_s}")
        if not self.max_timeout_s >= self.min_timeout_s:
            raise ConfigError(
                "ft", "max_timeout_s", f"must be >= ft.min_timeout_s ({self.min_timeout_s}), got {self.max_timeout_s}"
            )
        for name in self.preemption_signals:
            if not hasattr(signal, name) or not name.startswith("SIG") or name.startswith("SIG_"):
                raise ConfigError(
                    "ft", "preemption_signals", f"names an unknown signal {name!r}, e.g. 'SIGTERM' or 'SIGUSR1'"
                )
            if name in ("SIGKILL", "SIGSTOP"):
                raise ConfigError("ft", "preemption_signals", f"names {name}, which cannot be caught")
        self.nvrx = as_enum(NvrxMode, self.nvrx, "ft", "nvrx")
        if self.ledger_interval_s < 0:
            raise ConfigError("ft", "ledger_interval_s", f"must be >= 0, got {self.ledger_interval_s}")

    @property
    def signals(self) -> list[signal.Signals]:
        return [signal.Signals[name] for name in self.preemption_signals]
