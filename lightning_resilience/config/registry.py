"""Hydra integration of the configs: schemas registered explicitly, objects built from ``_target_`` nodes.

:func:`register_configs` stores every component's config dataclass in Hydra's ConfigStore (group
``resilience/schema``), so a user's own YAML can extend a schema and be type-checked at composition. Nothing is
registered at import.

:func:`build` turns a composed node (``cfg.resilience``) into objects with :func:`hydra.utils.instantiate`, node by
node, so that a bad value fails with a message that names the full key::

    resilience.checkpoint.tiers[1].every_n_steps must be >= 1, got 0

A node whose ``_target_`` is one of our config dataclasses is first merged into its structured schema (type errors
name the key too) and then constructed, which runs its own validation.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ["ResilienceConfigError", "build", "build_all", "register_configs", "schemas", "structured_schema"]

_MUST = re.compile(r"^(?P<key>[\w.\[\]]+) (?P<rest>(must|has|:) .*)$", re.DOTALL)


class ResilienceConfigError(ValueError):
    """A resilience setting is invalid; the message names its full key."""


def schemas() -> dict[str, type]:
    """Every registered schema: name -> config dataclass."""
    from lightning_resilience.config.checkpoint import (
        CheckpointConfig,
        DeltaLocalTierConfig,
        LocalTierConfig,
        MemoryTierConfig,
        PeerTierConfig,
        RemoteTierConfig,
    )
    from lightning_resilience.config.ft import FaultToleranceConfig
    from lightning_resilience.config.policy import PolicyConfig
    from lightning_resilience.config.sdc import SDCConfig
    from lightning_resilience.config.straggler import StragglerConfig

    return {
        "checkpoint": CheckpointConfig,
        "memory_tier": MemoryTierConfig,
        "local_tier": LocalTierConfig,
        "delta_local_tier": DeltaLocalTierConfig,
        "peer_tier": PeerTierConfig,
        "remote_tier": RemoteTierConfig,
        "ft": FaultToleranceConfig,
        "straggler": StragglerConfig,
        "sdc": SDCConfig,
        "policy": PolicyConfig,
    }


def register_configs(store: Any = None) -> None:
    """Store each config dataclass as a structured config in group ``resilience/schema`` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = store or ConfigStore.instance()
    for name, schema in schemas().items():
        cs.store(group="resilience/schema", name=name, node=structured_schema(schema))


@functools.cache
def structured_schema(cls: type) -> type:
    """``cls`` as OmegaConf can type-check it: same fields and defaults, ``Literal[...]`` as its value type, and a
    ``_target_`` naming ``cls``.

    OmegaConf has no ``Literal``; the allowed values are still enforced by ``cls`` itself when it is built.
    """
    hints = typing.get_type_hints(cls)
    # ``_target_`` first: a YAML node that extends the schema builds the real class with no more said
    fields: list[Any] = [("_target_", str, dataclasses.field(default=f"{cls.__module__}.{cls.__qualname__}"))]
    for f in dataclasses.fields(cls):
        spec: dict[str, Any] = {}
        if f.default is not dataclasses.MISSING:
            spec["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            spec["default_factory"] = functools.partial(_as_plain, f.default_factory)
        fields.append((f.name, _plain_type(hints[f.name]), dataclasses.field(**spec)))
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", fields, kw_only=True)


def _as_plain(factory: Callable[[], Any]) -> Any:
    """A default built by ``factory``, its config dataclasses turned into their schema counterparts."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            schema = structured_schema(type(value))
            return schema(**{f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)})
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(factory())


def _plain_type(tp: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return type(args[0])
    if origin in (Union, types.UnionType):
        rest = [_plain_type(a) for a in args if a is not type(None)]
        inner = rest[0] if len(rest) == 1 else Any
        return typing.Optional[inner] if len(rest) < len(args) else inner  # noqa: UP045 (built at run time)
    if origin is list:
        return list.__class_getitem__(_plain_type(args[0])) if args else list
    if origin is dict:
        return dict.__class_getitem__((args[0], _plain_type(args[1]))) if args else dict
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return structured_schema(tp)
    return tp


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
    if target is None:
        return children
    return _construct(str(target), children, key)


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
        OmegaConf.merge(OmegaConf.structured(structured_schema(cls)), plain)
    except OmegaConfBaseException as err:
        sub = getattr(err, "full_key", "") or ""
        first = str(err).splitlines()[0]
        raise ResilienceConfigError(f"{key}.{sub}: {first}" if sub else f"{key}: {first}") from err
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise _named(err, key) from err


def _named(err: BaseException, key: str) -> ResilienceConfigError:
    """Rewrite a component's own message (``tiers.local.every_n_steps must be ...``) with the full key."""
    cause: BaseException = err
    while cause.__cause__ is not None and not isinstance(cause, ValueError | TypeError):
        cause = cause.__cause__
    msg = str(cause)
    match = _MUST.match(msg)
    if match:
        field = match.group("key").split(".")[-1]
        return ResilienceConfigError(f"{key}.{field} {match.group('rest')}")
    return ResilienceConfigError(f"{key}: {msg}")


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
