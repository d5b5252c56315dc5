"""NeMo bridge: NeMo's own fault-tolerance and straggler keys through our callbacks, and our suite from a
``resilience:`` section of a NeMo (Hydra) config.

A stock NeMo script needs no change: ``+resilience=default`` on its command line switches the suite on (the
``callbacks_factory`` entry point, :mod:`lightning_resilience.lightning.suite`).

NeMo's ``exp_manager`` (NeMo 3.0, ``nemo/utils/exp_manager.py``) imports its fault-tolerance and straggler callbacks
from a top-level ``ptl_resiliency`` package that nvidia-resiliency-ext no longer ships, so
``create_fault_tolerance_callback=True`` raises ``ValueError: FaultToleranceCallback was enabled ... but
fault_tolerance package is not installed`` (and ``create_straggler_detection_callback=True`` the matching straggler
error). :func:`provide_exp_manager_callbacks`, run for every Trainer by the entry point (NeMo scripts build the
Trainer before they call ``exp_manager``), fills those two empty slots of the imported ``exp_manager`` module with
:func:`nemo_fault_tolerance_callback` and :func:`nemo_straggler_callback`: NeMo then adds our ``FaultTolerance``
and ``StragglerDetection`` built from its own keys. A slot NeMo filled itself is left alone.

For scripts that build the callbacks themselves, :func:`translate_exp_manager` turns those keys into our ``ft``
and ``straggler`` sections and removes them from the config NeMo sees::

    trainer = Trainer(**cfg.trainer, callbacks=resilience_callbacks(cfg))
    stripped, _ = translate_exp_manager(cfg.exp_manager, resilience=cfg.get("resilience"))
    exp_manager(trainer, stripped)
    trainer.fit(model)  # ends the process with the suite's exit code when it decided to stop

The module imports no NeMo: it works on OmegaConf configs only, so the translation runs (and is tested) without it.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError

__all__ = [
    "NEMO_FAULT_TOLERANCE_KEYS",
    "NEMO_STRAGGLER_KEYS",
    "attach",
    "nemo_fault_tolerance_callback",
    "nemo_straggler_callback",
    "provide_exp_manager_callbacks",
    "resilience_callbacks",
    "resilience_exit_code",
    "translate_exp_manager",
]

log = logging.getLogger(__name__)

NEMO_FAULT_TOLERANCE_KEYS = (
    "workload_check_interval",
    "initial_rank_heartbeat_timeout",
    "rank_heartbeat_timeout",
    "calculate_timeouts",
    "safety_factor",
    "rank_termination_signal",
    "log_level",
    "max_rank_restarts",
    "max_subsequent_job_failures",
    "additional_ft_launcher_args",
    "simulated_fault",
)
"""Keys of NeMo 3.0's ``exp_manager.fault_tolerance`` (``FaultToleranceParams``)."""

NEMO_STRAGGLER_KEYS = (
    "report_time_interval",
    "calc_relative_gpu_perf",
    "calc_individual_gpu_perf",
    "num_gpu_perf_scores_to_log",
    "gpu_relative_perf_threshold",
    "gpu_individual_perf_threshold",
    "stop_if_detected",
)
"""Keys of NeMo 3.0's ``exp_manager.straggler_detection_params`` (``StragglerDetectionParams``)."""

# read by NVRx's ft_launcher (from the YAML file it is given, ``--ft-cfg-path``), not by the training process
_FT_LAUNCHER_KEYS = (
    "workload_check_interval",
    "rank_termination_signal",
    "log_level",
    "max_rank_restarts",
    "max_subsequent_job_failures",
    "additional_ft_launcher_args",
)

# what a section the exp_manager keys turn on is built from when ``resilience`` does not configure it
_DEFAULT_NODES: dict[str, dict[str, Any]] = {
    "ft": {
        "_target_": "lightning_resilience.lightning.callbacks.fault_tolerance.FaultTolerance",
        "config": {"_target_": "lightning_resilience.ft.config.FaultToleranceConfig"},
    },
    "straggler": {
        "_target_": "lightning_resilience.lightning.callbacks.straggler.StragglerDetection",
        "config": {"_target_": "lightning_resilience.straggler.config.StragglerConfig"},
    },
}


# ---------------------------------------------------------------------------------------------------- translation
def translate_exp_manager(
    exp_cfg: Mapping[str, Any] | DictConfig | None, *, resilience: Mapping[str, Any] | DictConfig | None = None
) -> tuple[DictConfig, dict[str, dict[str, Any]]]:
    """Take NeMo's fault-tolerance and straggler keys out of an ``exp_manager`` config and translate them into ours.

    Removed from the returned copy: ``create_fault_tolerance_callback``, ``fault_tolerance``,
    ``create_straggler_detection_callback`` and ``straggler_detection_params``. When fault tolerance is on (through
    ``exp_manager`` or ``resilience.ft``), ``create_preemption_callback`` is set to false: our ``FaultTolerance``
    handles SIGTERM and two handlers of one signal cannot both work. When ``resilience.checkpoint`` is on,
    ``resume_if_exists`` is set to false so NeMo does not point ``trainer.ckpt_path`` at its ``*last.ckpt`` (which
    would make ``TieredCheckpoint`` stand aside); the log directory NeMo would have used (``<exp_dir>/<name>``,
    no version folder) becomes ``explicit_log_dir`` so restarts keep logging, and ``FaultTolerance`` keeps its
    ledger, in one place.

    Args:
        exp_cfg: the ``exp_manager`` section (not modified).
        resilience: the ``resilience`` section of the same config, if any (only read to see what is on).

    Returns:
        The stripped ``exp_manager`` config to hand to NeMo, and the translated settings shaped like nodes of
        ``resilience:`` (``{"ft": {"config": {...}}, "straggler": {"config": {...}, "max_logged_ranks": 5},
        "policy": {"config": {"straggler": "alert"}}}``); a section is absent when its ``create_*_callback`` key is
        false. ``policy`` only applies where ``resilience.policy`` is on: ``stop_if_detected`` picks its straggler
        action.

    Raises:
        ValueError: a key NeMo does not know under ``fault_tolerance`` / ``straggler_detection_params``, a
            ``simulated_fault`` (use the drills instead), or straggler detection with both scores turned off.
    """
    exp = _plain(exp_cfg, "exp_manager")
    ours: dict[str, dict[str, Any]] = {}

    ft_on = bool(exp.pop("create_fault_tolerance_callback", False))
    ft_params = exp.pop("fault_tolerance", None) or {}
    _check_keys(ft_params, NEMO_FAULT_TOLERANCE_KEYS, "exp_manager.fault_tolerance")
    if ft_on:
        ours["ft"] = {"config": _translate_fault_tolerance(ft_params)}

    sd_on = bool(exp.pop("create_straggler_detection_callback", False))
    sd_params = exp.pop("straggler_detection_params", None) or {}
    _check_keys(sd_params, NEMO_STRAGGLER_KEYS, "exp_manager.straggler_detection_params")
    if sd_on:
        ours["straggler"] = _translate_straggler(sd_params)
        # with a ResiliencePolicy, the policy decides what a confirmed straggler leads to
        stop = bool(sd_params.get("stop_if_detected", False))
        ours["policy"] = {"config": {"straggler": "checkpoint_and_stop" if stop else "alert"}}

    if "ft" in ours or _section_on(resilience, "ft"):
        if exp.get("create_preemption_callback", True):
            log.info("exp_manager.create_preemption_callback set to false: FaultTolerance handles preemption signals")
        exp["create_preemption_callback"] = False
    if _section_on(resilience, "checkpoint") and exp.get("resume_if_exists", False):
        exp["resume_if_exists"] = False
        if not exp.get("explicit_log_dir") and not exp.get("version"):
            root = exp.pop("exp_dir", None) or str(Path.cwd() / "nemo_experiments")
            exp["explicit_log_dir"] = str(Path(root) / (exp.get("name") or "default"))
        log.info(
            "exp_manager.resume_if_exists set to false: TieredCheckpoint resumes the run (log dir %s)",
            exp.get("explicit_log_dir") or exp.get("version"),
        )
    return OmegaConf.create(exp), ours


def _translate_fault_tolerance(params: Mapping[str, Any]) -> dict[str, Any]:
    if params.get("simulated_fault") is not None:
        raise ValueError(
            "exp_manager.fault_tolerance.simulated_fault is not supported: rehearse faults with the recipes' "
            "drills instead (drill=crash, kill_rank, hang or preempt; see docs/nemo.md)"
        )
    out: dict[str, Any] = {}
    timeouts: dict[str, float] = {}
    # NVRx's first heartbeat comes after setup: the initial heartbeat timeout bounds our 'setup' section
    if params.get("initial_rank_heartbeat_timeout") is not None:
        timeouts["setup"] = float(params["initial_rank_heartbeat_timeout"])
    # NVRx beats once per batch end: the gap between two beats is one step plus the time between steps
    if params.get("rank_heartbeat_timeout") is not None:
        timeouts["step"] = timeouts["out_of_section"] = float(params["rank_heartbeat_timeout"])
    if timeouts:
        out["initial_timeouts_s"] = timeouts
    if "calculate_timeouts" in params:
        out["calibrate"] = bool(params["calculate_timeouts"])
    if "safety_factor" in params:
        out["safety_factor"] = float(params["safety_factor"])
    launcher = sorted(k for k in _FT_LAUNCHER_KEYS if k in params)
    if launcher:
        log.info(
            "exp_manager.fault_tolerance.%s: read by NVRx's ft_launcher from the config file, not by the trainer",
            ",".join(launcher),
        )
    return out


def _translate_straggler(params: Mapping[str, Any]) -> dict[str, Any]:
    relative = bool(params.get("calc_relative_gpu_perf", True))
    individual = bool(params.get("calc_individual_gpu_perf", True))
    if not (relative or individual):
        raise ValueError(
            "exp_manager.straggler_detection_params: calc_relative_gpu_perf and calc_individual_gpu_perf are both "
            "false, nothing would be detected; turn one on or set create_straggler_detection_callback=false"
        )
    mode = "relative" if relative else "individual"
    threshold = float(params.get(f"gpu_{mode}_perf_threshold", 0.7))
    if not (0.0 < threshold < 1.0):
        raise ValueError(
            f"exp_manager.straggler_detection_params.gpu_{mode}_perf_threshold must be in (0, 1), got {threshold}"
        )
    # NVRx scores performance as reference time / rank time and flags a rank below the threshold; we test the
    # slowdown, rank time / reference time, so the same rank is flagged at slowdown 1 / threshold
    slowdown = 1.0 / threshold
    levels = [{"action": "alert", "slowdown": slowdown, "persist_steps": 1}]
    if params.get("stop_if_detected", False):
        levels.append({"action": "stop", "slowdown": slowdown, "persist_steps": 1})
    out: dict[str, Any] = {"config": {"detect_on": mode, "min_slowdown": slowdown, "levels": levels}}
    if "num_gpu_perf_scores_to_log" in params:
        out["max_logged_ranks"] = int(params["num_gpu_perf_scores_to_log"])
    if "report_time_interval" in params:
        log.info(
            "exp_manager.straggler_detection_params.report_time_interval is not used: ranks compare timings every "
            "resilience.straggler.config.gather_every_n_steps steps"
        )
    return out


# ---------------------------------------------------------------------------------------------------- callbacks
def resilience_callbacks(cfg: Mapping[str, Any] | DictConfig) -> list[Callback]:
    """Our callbacks for a NeMo config: its ``resilience`` section, with the translated ``exp_manager`` keys on top.

    ``resilience`` has the layout of ``configs/resilience`` (``+resilience=default`` composes it): one node per
    component with the ``_target_`` of its callback and a ``config`` node; an empty node (group option ``off``) or
    null switches a component off. A section the ``exp_manager`` keys turn on is built even when ``resilience``
    switches it off or lacks it (from its defaults), and those keys override the same settings in ``resilience``.
    ``TieredCheckpoint`` comes last, after the detectors, as in the recipes.

    Args:
        cfg: the root config (with ``resilience`` and/or ``exp_manager``).

    Raises:
        ValueError: a bad setting (the message names its full key), or ``${run_dir}`` used but not set.
    """
    from lightning_resilience.lightning.suite import build_suite

    root = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    try:
        res = _plain(root.get("resilience"), "resilience")
    except InterpolationKeyError as err:
        raise ValueError(
            f"resilience: {err.msg}; the resilience config groups keep their files under ${{run_dir}}: "
            "add +run_dir=<directory> to the command line"
        ) from err
    _, translated = translate_exp_manager(root.get("exp_manager"), resilience=res)
    for name, fragment in translated.items():
        if name not in _DEFAULT_NODES and not res.get(name):
            continue  # settings for a component only when it is on (the policy)
        base = res.get(name) or copy.deepcopy(_DEFAULT_NODES[name])
        res[name] = _deep_merge(base, fragment, f"resilience.{name}")
    return build_suite(res)


def attach(target: Trainer | MutableMapping[str, Any], cfg: Mapping[str, Any] | DictConfig) -> list[Callback]:
    """Add :func:`resilience_callbacks` to a built Trainer (e.g. from NeMo's ``MegatronTrainerBuilder``) or to the
    keyword arguments of one; call it before ``exp_manager``. Returns the callbacks added.

    Raises:
        ValueError: the trainer (or ``callbacks`` argument) already holds one of our callbacks of the same kind.
    """
    ours = resilience_callbacks(cfg)
    if isinstance(target, Trainer):
        callbacks: list[Callback] = target.callbacks  # type: ignore[attr-defined]
        _check_no_clash(callbacks, ours)
        callbacks.extend(ours)
    else:
        existing = list(target.get("callbacks") or [])
        _check_no_clash(existing, ours)
        target["callbacks"] = existing + ours
    return ours


def resilience_exit_code(trainer: Trainer) -> int:
    """The code the suite decided (a preemption, a straggler stop, a corrupt state), else 0 — for a script that set
    ``PolicyConfig.exit_after_fit`` to false and ends the process itself."""
    from lightning_resilience.lightning.coordination import Suite

    return int(Suite.of(trainer).exit_code)


# ---------------------------------------------------------------------------------------------------- exp_manager
def nemo_fault_tolerance_callback(
    *,
    exp_dir: str | Path | None = None,
    autoresume: bool = False,
    calculate_timeouts: bool = True,
    simulated_fault_params: Any = None,
    **unknown: Any,
) -> Callback:
    """Our ``FaultTolerance`` for NeMo's ``exp_manager.create_fault_tolerance_callback`` (its NVRx arguments).

    The ledger, notes and stack dumps go to ``<exp_dir>/resilience``; ``calculate_timeouts`` is our ``calibrate``.
    ``autoresume`` (NVRx's "finished" flag file for its launcher) has no counterpart: restarts read exit codes.
    """
    from lightning_resilience.ft.config import FaultToleranceConfig
    from lightning_resilience.lightning.callbacks.fault_tolerance import FaultTolerance

    if unknown:
        raise ValueError(f"exp_manager.fault_tolerance: arguments NeMo 3.0 does not pass: {sorted(unknown)}")
    config = _translate_fault_tolerance(
        {"calculate_timeouts": calculate_timeouts, "simulated_fault": simulated_fault_params}
    )
    run_dir = str(Path(exp_dir) / "resilience") if exp_dir is not None else None
    if autoresume:
        log.info("exp_manager.fault_tolerance: autoresume is NVRx launcher bookkeeping; restarts use exit codes")
    return FaultTolerance(FaultToleranceConfig(run_dir=run_dir, **config))


def nemo_straggler_callback(**params: Any) -> Callback:
    """Our ``StragglerDetection`` for NeMo's ``exp_manager.create_straggler_detection_callback`` (its
    ``straggler_detection_params``)."""
    from lightning_resilience.lightning.callbacks.straggler import StragglerDetection
    from lightning_resilience.straggler.config import StragglerConfig, StragglerLevelConfig

    _check_keys(params, NEMO_STRAGGLER_KEYS, "exp_manager.straggler_detection_params")
    out = _translate_straggler(params)
    config = dict(out["config"])
    config["levels"] = [StragglerLevelConfig(**level) for level in config["levels"]]
    return StragglerDetection(StragglerConfig(**config), max_logged_ranks=int(out.get("max_logged_ranks", 64)))


def provide_exp_manager_callbacks() -> bool:
    """Fill the empty fault-tolerance and straggler slots of NeMo's imported ``exp_manager`` module with ours.

    Only slots NeMo left empty (its ``ptl_resiliency`` import failed) are filled, and only when NeMo's
    ``exp_manager`` module is imported; NeMo uses them only when its ``create_*_callback`` key is true. Returns
    whether a slot was filled.
    """
    module = sys.modules.get("nemo.utils.exp_manager")
    if module is None:
        return False
    filled = False
    slots = (
        ("HAVE_FT", "FaultToleranceCallback", nemo_fault_tolerance_callback),
        ("HAVE_STRAGGLER_DET", "StragglerDetectionCallback", nemo_straggler_callback),
    )
    for flag, name, factory in slots:
        if vars(module).get(flag) is False:
            setattr(module, name, factory)
            setattr(module, flag, True)
            filled = True
    if filled:
        log.info("NeMo exp_manager: fault tolerance and straggler detection provided by lightning_resilience")
    return filled


# ---------------------------------------------------------------------------------------------------- helpers
def _check_no_clash(existing: Sequence[Callback], ours: Sequence[Callback]) -> None:
    kinds = {type(cb) for cb in ours}
    clash = sorted({type(cb).__name__ for cb in existing if type(cb) in kinds})
    if clash:
        raise ValueError(f"the trainer already has {clash}: configure them in resilience: or pass them, not both")


def _plain(cfg: Mapping[str, Any] | DictConfig | None, key: str) -> dict[str, Any]:
    """A resolved, mutable copy as plain dicts and lists."""
    if cfg is None:
        return {}
    if isinstance(cfg, DictConfig):
        out = OmegaConf.to_container(cfg, resolve=True)
    elif isinstance(cfg, Mapping):
        out = copy.deepcopy({k: _container(v) for k, v in cfg.items()})
    else:
        raise ValueError(f"{key} must be a mapping, got {type(cfg).__name__}")
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


def _container(value: Any) -> Any:
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _section_on(resilience: Mapping[str, Any] | DictConfig | None, name: str) -> bool:
    """Whether ``resilience.<name>`` builds a component (an empty node or null does not); nothing is resolved."""
    if resilience is None or name not in resilience:
        return False
    node = resilience[name]
    return isinstance(node, Mapping | DictConfig) and len(node) > 0


def _check_keys(params: Any, known: Sequence[str], key: str) -> None:
    if not isinstance(params, Mapping):
        raise ValueError(f"{key} must be a mapping, got {params!r}")
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"{key} has keys NeMo does not define: {unknown}; known: {list(known)}")


def _deep_merge(base: Mapping[str, Any], override: Mapping[str, Any], key: str) -> dict[str, Any]:
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(out[k], v, f"{key}.{k}")
            continue
        if k in out and out[k] != v:
            log.info("%s.%s: %r from the exp_manager keys replaces %r", key, k, v, out[k])
        out[k] = v
    return out
