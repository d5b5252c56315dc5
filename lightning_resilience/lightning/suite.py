"""Build the resilience suite from one config, and switch it on without code.

One builder, :func:`build_suite`, turns a ``resilience`` config node (the layout of ``configs/resilience``: one
node per component with its ``_target_``, ``run_dir``) into callbacks; the recipes, the NeMo bridge and the
entry point below all use it.

Zero-code enablement: Lightning (2.4 to 2.6) calls :func:`callbacks_from_environment` for every ``Trainer``
through the ``lightning.pytorch.callbacks_factory`` entry point. It does nothing unless the suite is switched on:

* by the environment, ``LIGHTNING_RESILIENCE="<preset|path.yaml> [key=value ...]"``, keys relative to
  ``resilience`` (``default run_dir=/shared/run-17 checkpoint.tiers.1.every_n_steps=50``, a group option as
  ``checkpoint=tiered_s3``);
* or by the overrides of the running Hydra app, ``+resilience=<preset>`` and any ``resilience.*`` /
  ``resilience/*=`` overrides after it (a stock NeMo script takes ``+resilience=default`` and nothing else).

A bad preset, key or value stops the Trainer's construction with a message that names it. The callbacks come
wrapped in one :class:`ResilienceSuite`, which adds at ``setup`` only those the Trainer lacks (a callback the user
added is never added twice), removes Lightning's default ``ModelCheckpoint`` when it adds its checkpoint callback, and
says at fit start what it did.
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from lightning_resilience.config.registry import ResilienceConfigError, build_all, register_configs
from lightning_resilience.ft.rendezvous import prepare_restarts

__all__ = [
    "ENV_VAR",
    "GROUPS",
    "SUITE_KEYS",
    "ResilienceSuite",
    "build_suite",
    "callbacks_from_environment",
    "compose_resilience",
    "enablement",
]

log = logging.getLogger(__name__)

ENV_VAR = "LIGHTNING_RESILIENCE"
GROUPS = ("checkpoint", "straggler", "sdc", "ft", "policy")
"""The config groups under ``resilience/``: ``checkpoint=tiered_s3`` in the environment picks a group option."""
SUITE_KEYS = ("run_dir",)
"""Keys of a ``resilience`` node that configure the suite, not a component."""
_OFF = ("", "0", "off", "false")


def build_suite(node: Any, key: str = "resilience") -> list[Callback]:
    """The callbacks of a ``resilience`` node: one per component that is on (an empty node or null is off).

    Raises:
        ResilienceConfigError: a bad setting (the message names its full key) or a component that is not a
            Lightning callback.
    """
    built = build_all(node, key, skip=lambda name: name in SUITE_KEYS)
    callbacks: list[Callback] = []
    for name, obj in built.items():
        if not isinstance(obj, Callback):
            raise ResilienceConfigError(f"{key}.{name} must build a Lightning Callback, got {type(obj).__name__}")
        callbacks.append(obj)
    return callbacks


# ---------------------------------------------------------------------------------------------------- enablement
@dataclass(frozen=True)
class Enablement:
    """Where the suite was switched on, and the Hydra overrides that compose its config."""

    source: str
    """What a message names: ``LIGHTNING_RESILIENCE`` or ``the Hydra overrides``."""
    overrides: list[str]
    """Overrides of an empty primary config: ``+resilience=<preset>`` first."""
    prefix: str
    """How the source spells ``resilience.`` (empty for the environment, whose keys are relative)."""


def enablement(environ: Mapping[str, str] | None = None) -> Enablement | None:
    """The environment's switch, else the running Hydra app's, else None (the suite stays off)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR)
    if value is not None and value.strip().lower() not in _OFF:
        return Enablement(ENV_VAR, _overrides_from_env(value), "")
    hydra_overrides = _overrides_from_hydra()
    if hydra_overrides:
        return Enablement("the Hydra overrides", hydra_overrides, "resilience.")
    return None


def _overrides_from_env(value: str) -> list[str]:
    tokens = shlex.split(value)
    head, rest = tokens[0], tokens[1:]
    if "=" in head:
        raise ResilienceConfigError(
            f"{ENV_VAR} must start with a preset (default, full, minimal) or a YAML file, got {head!r}"
        )
    overrides = [f"+resilience={_preset(head)}"]
    for token in rest:
        if "=" not in token and not token.startswith("~"):
            raise ResilienceConfigError(f"{ENV_VAR}: expected key=value after the preset, got {token!r}")
        prefix = token[: len(token) - len(token.lstrip("+~"))]
        key = token[len(prefix) :].split("=", 1)[0]
        sep = "/" if key in GROUPS else "."
        overrides.append(f"{prefix}resilience{sep}{token[len(prefix) :]}")
    return overrides


def _preset(name: str) -> str:
    """A preset name as is; a YAML file becomes a preset of its own (stored in Hydra's ConfigStore)."""
    if not name.endswith((".yaml", ".yml")):
        return name
    path = Path(name)
    if not path.is_file():
        raise ResilienceConfigError(f"{ENV_VAR}: no such file {name!r}")
    from hydra.core.config_store import ConfigStore

    stored = f"_file_{abs(hash(str(path.resolve())))}"
    ConfigStore.instance().store(group="resilience", name=stored, node=OmegaConf.load(path))
    return stored


def _overrides_from_hydra() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    ours: list[str] = []
    switched_on = False
    for item in HydraConfig.get().overrides.task:
        text = str(item)
        key = text.lstrip("+~").split("=", 1)[0]
        if key == "resilience" and text.startswith("+"):
            switched_on = True
        if key in ("resilience", "run_dir") or key.startswith(("resilience.", "resilience/")):
            ours.append(text)
    return ours if switched_on else []


# ---------------------------------------------------------------------------------------------------- compose
@contextmanager
def _own_hydra() -> Iterator[None]:
    """A Hydra of our own for one composition, also inside a running Hydra app (whose state is put back)."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("lightning_resilience.configs", version_base="1.3"):
            yield
    finally:
        restore_gh_from_backup(backup)


def compose_resilience(overrides: Sequence[str], *, source: str = ENV_VAR, prefix: str = "") -> DictConfig:
    """Compose ``resilience`` from our config groups and ``overrides``; errors name the preset or key as the
    source spelled it.

    Raises:
        ResilienceConfigError: an unknown preset or group option, an unknown key, or a value of the wrong type.
    """
    from hydra import compose
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    try:
        with _own_hydra():
            cfg = compose(overrides=list(overrides))
    except MissingConfigException as err:
        group, _, option = str(err.missing_cfg_file or "").rpartition("/")
        what = "preset" if group == "resilience" else f"{prefix}{group.removeprefix('resilience/')} option"
        known = sorted(o for o in err.options or [] if not o.startswith("_"))
        raise ResilienceConfigError(f"{source}: unknown {what} {option!r}; available: {', '.join(known)}") from err
    except (ConfigCompositionException, OmegaConfBaseException) as err:
        cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
        full_key = str(getattr(cause, "full_key", "") or "")
        first = str(cause).splitlines()[0]
        if full_key.startswith("resilience."):
            name = prefix + full_key.removeprefix("resilience.")
            problem = "unknown key" if "not in struct" in str(cause) else "bad value for"
            raise ResilienceConfigError(f"{source}: {problem} {name!r}: {first}") from err
        raise ResilienceConfigError(f"{source}: {first}") from err
    return cfg.resilience


# ---------------------------------------------------------------------------------------------------- the switch
class ResilienceSuite(Callback):
    """The suite switched on without code: at ``setup`` it adds to the Trainer the callbacks it lacks.

    A callback of the same kind that the Trainer already has (from the user, a model's ``configure_callbacks`` or
    NeMo's ``exp_manager``) is kept and ours is dropped. Added callbacks go where Lightning would put them
    (checkpoints last) and are set up here, in the Trainer's own ``setup`` pass. When it adds a checkpoint callback,
    Lightning's default ``ModelCheckpoint`` (which Lightning adds unless told not to, and which writes a full
    ``.ckpt`` at every epoch's end) is removed; a ``ModelCheckpoint`` the user configured stays, and the message at
    fit start names it.

    Args:
        callbacks: the suite's callbacks (from :func:`build_suite`).
        source: what switched it on, for the message at fit start.
        run_dir: where the suite keeps its files, for the same message.
    """

    def __init__(self, callbacks: Sequence[Callback], source: str, run_dir: str | None = None) -> None:
        self.callbacks = list(callbacks)
        self.source, self.run_dir = source, run_dir
        self.added: list[Callback] = []
        self.kept: list[Callback] = []
        self.removed: list[ModelCheckpoint] = []
        """Lightning's default ``ModelCheckpoint``, when a checkpoint callback of ours replaced it."""
        self._done = False

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._done or stage != "fit":  # the suite protects training: validate/test/predict run without it
            return
        self._done = True
        present: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        for cb in self.callbacks:
            same = next((other for other in present if isinstance(other, type(cb))), None)
            (self.kept if same is not None else self.added).append(same or cb)
        first = [cb for cb in self.added if not isinstance(cb, Checkpoint)]
        last = [cb for cb in self.added if isinstance(cb, Checkpoint)]
        if last:
            self.removed = [cb for cb in present if _is_lightning_default(cb)]
            present = [cb for cb in present if cb not in self.removed]
        me = present.index(self)
        # a new list: Lightning's setup pass goes on over the old one, and we set up the added callbacks here
        trainer.callbacks = [*present[: me + 1], *first, *present[me + 1 :], *last]  # type: ignore[attr-defined]
        for cb in [*first, *last]:
            cb.setup(trainer, pl_module, stage)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._done:
            return
        added = ", ".join(describe(cb) for cb in self.added) or "nothing"
        kept = ", ".join(type(cb).__name__ for cb in self.kept)
        own = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]  # type: ignore[attr-defined]
        rank_zero_info(
            f"lightning_resilience: enabled by {self.source}: {added}"
            + (f"; the Trainer's own {kept} kept" if kept else "")
            + "".join(f"; Lightning's default ModelCheckpoint removed (no .ckpt files in {cb.dirpath})"
                      for cb in self.removed)
            + "".join(f"; the Trainer's own {type(cb).__name__} kept: it writes full .ckpt files in {cb.dirpath}"
                      for cb in own)
            + (f"; run_dir {self.run_dir}" if self.run_dir else "")
        )  # fmt: skip


def _is_lightning_default(cb: Callback) -> TypeGuard[ModelCheckpoint]:
    """The ``ModelCheckpoint`` Lightning adds when the Trainer has no checkpoint callback: one with every setting at
    its default (a ``ModelCheckpoint()`` the user passed without arguments is the same thing)."""

    def settings(c: ModelCheckpoint) -> tuple[Any, ...]:
        # state_key holds monitor, mode and the every_n_train_steps / every_n_epochs / train_time_interval cadences
        return c.state_key, c.dirpath, c.filename, c.save_last, c.save_top_k, c.save_weights_only

    return type(cb) is ModelCheckpoint and settings(cb) == settings(ModelCheckpoint())


def describe(cb: Callback) -> str:
    """A callback in a few words (a checkpoint with its tiers' names, cadences and paths)."""
    from lightning_resilience.lightning.callbacks.tiered_checkpoint import TieredCheckpoint

    if isinstance(cb, TieredCheckpoint):
        tiers = ", ".join(f"{t.name} every {t.every_n_steps or 'budget'}" for t in cb.tiers)
        return f"TieredCheckpoint({tiers}; resume {cb.config.resume})"
    return type(cb).__name__


def callbacks_from_environment() -> list[Callback]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: the suite when switched on, else nothing.

    Also gives NeMo's ``exp_manager`` the fault-tolerance and straggler callbacks it looks for (see
    :mod:`lightning_resilience.integrations.nemo`), so its own keys work.

    Raises:
        ResilienceConfigError: the switch names an unknown preset, key or value (before any training).
    """
    from lightning_resilience.integrations.nemo import provide_exp_manager_callbacks

    provide_exp_manager_callbacks()
    switch = enablement()
    if switch is None:
        return []
    prepare_restarts()  # before the Trainer creates the process group: a torchrun restart must come up
    node = compose_resilience(switch.overrides, source=switch.source, prefix=switch.prefix)
    try:
        callbacks = build_suite(node)
    except ResilienceConfigError as err:
        raise ResilienceConfigError(f"{switch.source}: {err}") from err
    run_dir = node.get("run_dir")
    return [ResilienceSuite(callbacks, switch.source, None if run_dir is None else str(run_dir))]
