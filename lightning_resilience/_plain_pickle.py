"""Unpickling what a peer rank sent through a side-group agreement: plain values only."""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from typing import Any

__all__ = ["loads_plain"]


class _PlainUnpickler(pickle.Unpickler):
    """What a peer sends is unpickled as plain values only: built-in scalars and containers, and the dataclasses and
    enums of this package; any other global (a function, a class of another package) is refused."""

    _BUILTINS = frozenset({"set", "frozenset", "complex", "range", "slice", "bytearray"})

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in self._BUILTINS:
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict":
            return super().find_class(module, name)
        if module.split(".")[0] == "lightning_resilience" and "." not in name:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"a side-group agreement may not carry {module}.{name}")


def loads_plain(data: bytes) -> Any:
    """Unpickle what another rank of the job sent, refusing anything but plain values (see the class above)."""
    return _PlainUnpickler(io.BytesIO(data)).load()
