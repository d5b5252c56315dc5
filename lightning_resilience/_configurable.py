"""What every component's config dataclass shares: the error that names a key, string enums, positional settings.

Each component owns a nested ``Config`` dataclass (``LocalTier.Config``, ``StragglerDetector``'s
``StragglerConfig``...) validated in ``__post_init__`` without building the component; a bad value raises
:class:`ConfigError`, which carries the setting's owner and field separately so that the Hydra registry can name the
full key (``resilience.checkpoint.tiers[1].every_n_steps``) without parsing the message.
"""

from __future__ import annotations

import dataclasses
import math
from enum import Enum
from typing import Any, TypeVar

__all__ = ["ConfigError", "StrEnum", "as_enum", "check_finite", "config_from_args"]

C = TypeVar("C")
E = TypeVar("E", bound=Enum)


class ConfigError(ValueError):
    """A setting is invalid. ``str()`` is ``"<owner>.<field> <problem>"`` (``"tiers.local.keep must be >= 1, got 0"``).

    Attributes:
        owner: the component's key as its user knows it (``tiers.local``, ``straggler``, ``straggler.levels``).
        field: the field below ``owner`` (may be dotted, ``initial_timeouts_s.step``; empty for the whole node).
        problem: what is wrong and, where it helps, what to write instead.
    """

    def __init__(self, owner: str, field: str, problem: str) -> None:
        self.owner, self.field, self.problem = owner, field, problem
        super().__init__(self.under(owner))

    def under(self, key: str) -> str:
        """The message with ``key`` (a full key such as ``resilience.straggler.config``) as the owner."""
        return f"{key}.{self.field} {self.problem}" if self.field else f"{key}: {self.problem}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ConfigError, (self.owner, self.field, self.problem))


class StrEnum(str, Enum):
    """A string-valued choice: compares equal to its value, formats as its value, and is what OmegaConf type-checks.

    Members are named by their value (``median = "median"``): OmegaConf looks a string up by member name, so a YAML
    value or a command-line override such as ``reference=fastest`` works as written.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def values(cls) -> list[str]:
        return [str(m.value) for m in cls]


def as_enum(enum: type[E], value: Any, owner: str, field: str) -> E:
    """``value`` (a member or its string) as a member of ``enum``, or a :class:`ConfigError` naming the choices."""
    if isinstance(value, enum):
        return value
    try:
        return enum(value)
    except ValueError:
        values = [str(m.value) for m in enum]
        choices = f"{values[0]!r} or {values[1]!r}" if len(values) == 2 else f"one of {values}"
        raise ConfigError(owner, field, f"must be {choices}, got {value!r}") from None


def check_finite(owner: str, field: str, value: float, *, minimum: float = 0.0, strict: bool = True) -> None:
    """``value`` must be a finite number above ``minimum`` (or at least it, with ``strict=False``)."""
    ok = isinstance(value, int | float) and math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        raise ConfigError(owner, field, f"must be a finite number {'>' if strict else '>='} {minimum:g}, got {value!r}")


def config_from_args(config_cls: type[C], args: tuple[Any, ...], options: dict[str, Any], owner: str) -> C:
    """The config a component constructor was given: either one ``config_cls`` instance, or its fields as
    arguments (positional in field order, e.g. ``LocalTier("/nvme/ckpt", every_n_steps=20)``)."""
    if args and isinstance(args[0], config_cls):
        if len(args) > 1 or options:
            raise TypeError(f"{owner}() takes either a {owner}.Config or its settings as arguments, not both")
        return args[0]
    names = [f.name for f in dataclasses.fields(config_cls) if f.init]  # type: ignore[arg-type]
    if len(args) > len(names):
        raise TypeError(f"{owner}() takes at most {len(names)} positional settings ({names}), got {len(args)}")
    for name, value in zip(names, args):
        if name in options:
            raise TypeError(f"{owner}() got multiple values for {name!r}")
        options[name] = value
    return config_cls(**options)
