"""Hydra integration of the configs: schemas registered explicitly, objects built from ``_target_`` nodes.

:func:`register_configs` stores every component's config dataclass, as it is, in Hydra's ConfigStore (group
``resilience/schema``), so a user's own YAML can extend a schema and be type-checked at composition (choices are
string enums, which OmegaConf checks; no shadow schema is needed). Nothing is registered at import. The
dataclasses live with their components (``LocalTier.Config``, :mod:`lightning_resilience.straggler.config`...);
this package only imports them.

:func:`build` turns a composed node (``cfg.resilience``) into objects with :func:`hydra.utils.instantiate`, node by
node, so that a bad value fails with a message that names the full key::

    resilience.checkpoint.tiers[1].keep must be >= 1, got 0

A node whose ``_target_`` names one of our config dataclasses (every schema carries one) or that is typed by one
is type-checked against it (type errors name the key too) and then constructed, which runs its own validation; a
:class:`~lightning_resilience._configurable.ConfigError` it raises carries the field, which is put under the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_resilience._configurable import ConfigError
from lightning_resilience.checkpoint.config import CheckpointConfig
from lightning_resilience.checkpoint.delta_tier import DeltaLocalTier
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.remote import RemoteTier
from lightning_resilience.checkpoint.replication import PeerTier
from lightning_resilience.ft.config import FaultToleranceConfig
from lightning_resilience.policy import PolicyConfig
from lightning_resilience.rollback.config import RollbackConfig
from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.straggler.config import StragglerConfig

__all__ = [
    "ResilienceConfigError",
    "build",
    "build_all",
    "register_configs",
    "schema_node",
    "schemas",
]


class ResilienceConfigError(ValueError):
    """A resilience setting is invalid; the message names its full key."""


def schemas() -> dict[str, type]:
    """Every registered schema: name -> config dataclass."""
    return {
        "checkpoint": CheckpointConfig,
        "memory_tier": MemoryTier.Config,
        "local_tier": LocalTier.Config,
        "delta_local_tier": DeltaLocalTier.Config,
        "peer_tier": PeerTier.Config,
        "remote_tier": RemoteTier.Config,
        "ft": FaultToleranceConfig,
        "straggler": StragglerConfig,
        "sdc": SDCConfig,
        "policy": PolicyConfig,
        "rollback": RollbackConfig,
    }


def register_configs(store: Any = None) -> None:
    """Store each config dataclass as a structured config in group ``resilience/schema`` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = store or ConfigStore.instance()
    for name, schema in schemas().items():
        cs.store(group="resilience/schema", name=name, node=schema_node(schema))


def schema_node(cls: type) -> DictConfig:
    """``cls`` as a structured config (OmegaConf type-checks every field, enums included) with a ``_target_`` naming
    it: a YAML node that extends the schema builds the real class with no more said, even after a tool has merged
    it into an untyped config."""
    node = OmegaConf.structured(cls)
    OmegaConf.set_struct(node, False)
    node["_target_"] = f"{cls.__module__}.{cls.__qualname__}"
    OmegaConf.set_struct(node, True)
    return node


def build(node: Any, key: str = "resilience") -> Any:
    """Instantiate every ``_target_`` in ``node`` bottom-up; errors name the full key of the bad setting.

    Nodes without ``_target_`` become plain dicts/lists of their built children; an empty node (a group option
    that switches a component off) becomes an empty dict.
    """
    if isinstance(node, ListConfig | list):
        return [build(item, f"{key}[{i}]") for i, item in enumerate(node)]
    if not isinstance(node, DictConfig | dict):
        return node
    items = node.items_ex(resolve=True) if isinstance(node, DictConfig) else node.items()
    children = {str(k): build(v, f"{key}.{k!s}") for k, v in items if k != "_target_"}
    target = node.get("_target_")
    if target is not None:
        return _construct(str(target), children, key)
    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if isinstance(schema, type) and dataclasses.is_dataclass(schema):
        return _construct_dataclass(schema, children, key)  # a schema extended by YAML: its own class
    return children


def _construct(target: str, kwargs: dict[str, Any], key: str) -> Any:
    from hydra.utils import get_object, instantiate

    try:
        obj: Any = get_object(target)
    except Exception as err:
        raise ResilienceConfigError(f"{key}._target_: cannot import {target!r} ({err})") from err
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        return _construct_dataclass(obj, kwargs, key)
    try:
        # a partial, then called: the built children are objects (and one may be named ``config``)
        return instantiate({"_target_": target, "_partial_": True})(**kwargs)
    except Exception as err:
        raise _named(err, key) from err


def _construct_dataclass(cls: type, kwargs: dict[str, Any], key: str) -> Any:
    nested = {k: v for k, v in kwargs.items() if dataclasses.is_dataclass(v) or isinstance(v, list | tuple)}
    plain = {k: v for k, v in kwargs.items() if k not in nested}
    try:
        # type-check against the schema (a string where an int belongs fails here, naming the key)
        OmegaConf.merge(OmegaConf.structured(cls), plain)
    except OmegaConfBaseException as err:
        sub = getattr(err, "full_key", "") or ""
        first = str(err).splitlines()[0]
        raise ResilienceConfigError(f"{key}.{sub}: {first}" if sub else f"{key}: {first}") from err
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise _named(err, key) from err


def _named(err: BaseException, key: str) -> ResilienceConfigError:
    """A component's own error under the full key: a :class:`ConfigError` names its field, anything else is quoted."""
    chain: list[BaseException] = []
    cause: BaseException | None = err
    while cause is not None and len(chain) < 8:  # hydra wraps what the constructor raised
        chain.append(cause)
        cause = cause.__cause__
    named = next((c for c in chain if isinstance(c, ConfigError)), None)
    if named is not None:
        return ResilienceConfigError(named.under(key))
    plain = next((c for c in chain if isinstance(c, ValueError | TypeError)), err)
    return ResilienceConfigError(f"{key}: {plain}")


def build_all(node: Any, key: str = "resilience", *, skip: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Build each child of ``node`` (one per component) and drop the ones switched off (empty)."""
    out = {}
    items = node.items_ex(resolve=True) if isinstance(node, DictConfig) else dict(node).items()
    for name, child in items:
        if skip is not None and skip(str(name)):
            continue
        built = build(child, f"{key}.{name!s}")
        if built not in ({}, None):
            out[str(name)] = built
    return out
