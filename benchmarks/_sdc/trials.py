"""The trials of ``benchmarks.sdc_coverage``: the presets' configs, the window a fault is given, the kinds and shapes
of fault, the model, its data and its loss, and the Wilson interval the coverage is read with."""

from __future__ import annotations

import argparse
import math
import random
from typing import Any

import torch

from benchmarks._common import REPO_ROOT
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.inject import BIT_CLASSES

WORLD = 3
OWN_CORES = 2
"""Ranks of the second overhead launch: one per core of this machine, as a job runs one rank per device. With WORLD
ranks on 2 cores each rank's agreement thread, woken twice a round, can cost its training thread the core for a
scheduler slice (the driver's issue phase shows it), which no deployment with a core per rank pays."""
OVERHEAD_BATCH = 32
"""The batch of the third overhead launch: 2,048 tokens a step per rank (the trials' 4 sequences are 256)."""
PRESETS = {"default": "guards", "full": "dual_run"}
"""Preset name -> its file in configs/resilience/sdc/."""
PATTERNS: dict[str, dict[str, int]] = {
    "one_bit": {"bits": 1, "elements": 1, "stride": 1},
    "burst3": {"bits": 3, "elements": 1, "stride": 1},
    "strided4": {"bits": 1, "elements": 4, "stride": 7},
}
"""Flip shapes: one bit, a burst of 3 adjacent bits, one bit in 4 elements 7 apart."""
FAULTY: dict[str, dict[str, Any]] = {
    "exponent_every_step": {"bit_class": "exponent", "rate": 1.0},
    "exponent_flaky_1in4": {"bit_class": "exponent", "rate": 0.25},
    "mantissa_low_every_step": {"bit_class": "mantissa_low", "rate": 1.0},
}
KINDS = ("persistent", "transient", "faulty_device", "flaky_device")
"""Kinds of fault, reported apart; a device that corrupts every step is ``faulty_device``, one at a lower rate
``flaky_device`` (no goal: a replay on it sees the fault only at that rate)."""
DEVICE_KINDS = ("faulty_device", "flaky_device")
SLACK_STEPS = 5
"""Steps after a replay round that a verdict may take (its vote, the agreement that carries it)."""
BATCH_POOL = 200
"""Distinct batches a rank trains on, cycled (the overhead's 1,600 steps an arm go through them 8 times), whatever the
trials' window: the data, and so the guards' false alarms, do not change with a preset's cadences."""
OVERHEAD_WARM_STEPS = 100
"""Steps of each arm before the overhead's windows (at least the trials' window): the guard baselines are warm."""
LOCATION_KIND = {"param": "persistent", "optim": "persistent", "grad": "transient", "activation": "transient"}
FAULTY_WEIGHT = "blocks.0.mlp.fc.weight"


def preset_config(name: str, scale: int | None = None) -> SDCConfig:
    """The SDC config a preset builds (its YAML's ``config:``); ``scale`` shortens every cadence to that many steps
    (quick runs only)."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(REPO_ROOT / "configs" / "resilience" / "sdc" / f"{PRESETS[name]}.yaml")
    values = {k: v for k, v in OmegaConf.to_container(node.config).items() if k != "run_dir"}  # type: ignore[union-attr]
    if scale is not None:
        for key in ("replay_every_n_steps", "reconcile_every_n_steps"):
            if values.get(key):
                values[key] = scale
    return SDCConfig(**values)


def window(cfg: SDCConfig) -> int:
    """W, the trials' window: the longest cadence of the checks that a flip which stays waits for (the
    reconciliation, the parameter-norm guard), and the replay's when it is at most twice that (a window then holds
    whole replay periods, so a transient flip lands on a scheduled replay as often as in training) or when neither
    other check runs. A longer replay cadence is left out: a faulty device is given the stated bound instead
    (:func:`faulty_bound`), and the transient trials do not sample the ``1 / replay_every_n_steps`` of flips that a
    scheduled replay would see (the notes say so)."""
    stays = max(cfg.reconcile_every_n_steps, cfg.param_norm_every_n_steps)
    return stays if cfg.replay_every_n_steps > 2 * stays > 0 else max(stays, cfg.replay_every_n_steps)


def faulty_bound(cfg: SDCConfig, world: int = WORLD) -> int | None:
    """Steps within which a scheduled replay meets a device that corrupts every step (the stated latency bound).

    A scheduled round every ``replay_every_n_steps``: with ``all`` or ``devices`` every device replays at every
    round; with ``rotate`` one rank's batch by turns, replayed by that rank and (partner replay) its neighbour: a
    rank takes part in 2 turns of every ``world`` (1 without a partner), so at most ``world - 1`` rounds (``world``)
    pass between two of its turns; plus the round's vote and the agreement that carries it. None: no scheduled
    replay (only a guard can ask for one)."""
    if not cfg.replay_every_n_steps:
        return None
    rounds = 1 if cfg.replay_scope != "rotate" or world == 1 else (world - 1 if cfg.partner_replay else world)
    return rounds * cfg.replay_every_n_steps + SLACK_STEPS


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """The 95% Wilson score interval of a proportion (None without trials)."""
    if n <= 0:
        return None
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def model_kwargs() -> dict[str, Any]:
    from recipes._gpt import gpt_preset

    kw = gpt_preset("tiny")
    kw["max_steps"] = 1000
    return kw


def make_batches(kw: dict[str, Any], rank: int, n: int, batch_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(kw["vocab_size"], (batch_size, kw["seq_len"] + 1), generator=gen) for _ in range(n)]


def loss_of(module: Any, batch: torch.Tensor) -> torch.Tensor:
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = module(inputs)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_trials(args: argparse.Namespace, w: int) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    out = []
    for location in args.locations:
        for pattern in PATTERNS:
            for _ in range(args.trials):
                out.append(dict(kind=LOCATION_KIND[location], cell=f"{location}/{pattern}", location=location,
                                pattern=pattern, bit_class=rng.choice(BIT_CLASSES), rank=rng.randrange(WORLD),
                                step=w + rng.randrange(w), seed=rng.randrange(2**31)))  # fmt: skip
    for name in args.faulty:
        kind = "faulty_device" if FAULTY[name]["rate"] >= 1.0 else "flaky_device"
        for _ in range(args.trials):
            out.append(dict(kind=kind, cell=f"faulty/{name}", location="grad", pattern=name,
                            rank=rng.randrange(WORLD), step=w + rng.randrange(w), seed=rng.randrange(2**31),
                            **FAULTY[name]))  # fmt: skip
    return out
