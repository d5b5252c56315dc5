"""Split a nested training state into tensors and a JSON-safe skeleton, and join them back.

The skeleton is plain JSON (no pickle), so reading a checkpoint never executes stored code. Tensors are named by
their path in the tree (``optimizer_states/0/state/3/exp_avg``); the names double as DCP keys.
"""

from __future__ import annotations

import base64
import enum
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["DTensorRebuilder", "FlatState", "TensorSpec", "flatten_state", "storage_ptr", "unflatten_state"]

DTensorRebuilder = Callable[[torch.Tensor, Mapping[str, Any]], Any]
"""Turns a rank's local shard and its recorded layout (mesh dim names, placements, global shape and stride; newer
checkpoints also hold ``mesh_shape`` and this rank's ``coord`` on the mesh) back into a distributed tensor. Needed only
for states that hold DTensors (FSDP2, tensor parallel)."""

_SEP = "/"
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_PLAIN_SCALARS = (bool, str, int, float)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor of the flat state; enough to pre-allocate a buffer for it."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorSpec:
        return cls(tuple(int(d) for d in data["shape"]), dtype_from_name(str(data["dtype"])))


@dataclass
class FlatState:
    """A training state taken apart: ``skeleton`` is JSON-safe, ``tensors`` maps path names to tensors."""

    skeleton: Any
    tensors: dict[str, torch.Tensor]

    def specs(self) -> dict[str, TensorSpec]:
        return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in self.tensors.items()}


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in checkpoint")
    return dtype


def _key_text(key: Any) -> str:
    return str(key).replace(_SEP, "%2F")


def flatten_state(state: Any, *, warn: Callable[[str], None] | None = None) -> FlatState:
    """Take a nested state apart.

    Containers are rebuilt (a deep copy of the structure), so later mutation of the live state cannot change a
    snapshot's skeleton. Tensors are referenced, not copied: the caller copies them into its own buffers.

    Args:
        state: dicts, lists, tuples, tensors, numpy arrays and scalars, strings, bytes, ``None``, dtypes.
        warn: called once per kind of value that cannot be stored faithfully (it is stored as its ``repr``).
    """
    tensors: dict[str, torch.Tensor] = {}
    warned: set[str] = set()

    def note(kind: str) -> None:
        if kind not in warned:
            warned.add(kind)
            (warn or (lambda m: warnings.warn(m, stacklevel=3)))(
                f"checkpoint state holds a {kind} that is stored as its repr and is not restorable"
            )

    seen: dict[tuple[Any, ...], str] = {}

    def add_tensor(path: str, tensor: torch.Tensor) -> dict[str, Any]:
        # tied weights (one storage under two names) are stored once and come back as one shared tensor
        ptr = storage_ptr(tensor)
        alias = (ptr, tensor.device, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if ptr and alias in seen:
            return {"T": seen[alias]}
        name = path or "_root"
        if name in tensors:  # two containers can render to the same path only through the %2F escape
            name = f"{name}#{len(tensors)}"
        tensors[name] = tensor.detach() if tensor.requires_grad else tensor  # state dicts are detached already
        if ptr:
            seen[alias] = name
        return {"T": name}

    def enc(obj: Any, path: str) -> Any:
        # exact-type fast paths first: this runs for every node of the state on every step
        kind = type(obj)
        if kind in _PLAIN_TENSORS:
            return add_tensor(path, obj)
        if kind is dict and all(type(k) is str for k in obj):
            sub = path + _SEP if path else ""
            return {"d": {k: enc(v, sub + _key_text(k)) for k, v in obj.items()}}
        if obj is None or kind in _PLAIN_SCALARS:
            return obj if kind is not float or math.isfinite(obj) else {"f": repr(obj)}
        if obj is None or isinstance(obj, bool | str):
            return obj
        if isinstance(obj, int) and not isinstance(obj, enum.Enum):  # enums fall through to the warned repr
            return int(obj)
        if isinstance(obj, float) and not isinstance(obj, enum.Enum):
            # float(): np.float64 is a float subclass whose repr is "np.float64(inf)" under NumPy 2
            return float(obj) if math.isfinite(obj) else {"f": repr(float(obj))}
        if isinstance(obj, DTensor):
            # a sharded parameter: this rank keeps its own shard and the layout needed to rebuild it
            return {
                "DT": {
                    "local": add_tensor(path, obj.to_local())["T"],
                    "mesh": list(obj.device_mesh.mesh_dim_names or ()),
                    "placements": [_placement_text(p) for p in obj.placements],
                    "shape": list(obj.shape),
                    "stride": list(obj.stride()),
                    # where the shard sits on its mesh: what a reader on another world size needs to reslice it
                    "mesh_shape": list(obj.device_mesh.shape),
                    "coord": list(obj.device_mesh.get_coordinate() or ()),
                }
            }
        if isinstance(obj, torch.Tensor):
            return add_tensor(path, obj)
        if isinstance(obj, np.ndarray):
            try:
                # reshape: ascontiguousarray turns a 0-dim array into shape (1,)
                array = torch.from_numpy(np.ascontiguousarray(obj).reshape(obj.shape))
            except (TypeError, ValueError):  # str/object/datetime dtypes, non-native byte order
                note(f"numpy array of dtype {obj.dtype}")
                return {"repr": repr(obj)}
            return {"np": add_tensor(path, array)["T"]}
        if isinstance(obj, np.generic):
            return enc(obj.item(), path)
        if isinstance(obj, Mapping):
            sub = path + _SEP if path else ""
            if all(isinstance(k, str) for k in obj):
                return {"d": {k: enc(v, sub + _key_text(k)) for k, v in obj.items()}}
            return {"m": [[enc(k, ""), enc(v, sub + _key_text(k))] for k, v in obj.items()]}
        if isinstance(obj, list | tuple):
            sub = path + _SEP if path else ""
            items = [enc(v, f"{sub}{i}") for i, v in enumerate(obj)]
            return {"l": items} if isinstance(obj, list) else {"t": items}
        if isinstance(obj, bytes | bytearray):
            return {"b": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, torch.dtype):
            return {"dt": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"dev": str(obj)}
        note(type(obj).__name__)
        return {"repr": repr(obj)}

    skeleton = enc(state, "")
    return FlatState(skeleton=skeleton, tensors=tensors)


def storage_ptr(tensor: torch.Tensor) -> int:
    """Address of the storage behind ``tensor`` (a DTensor's local shard); 0 when it has none."""
    if type(tensor) not in _PLAIN_TENSORS and isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # wrapper subclasses without a real storage
        return 0


def unflatten_state(
    skeleton: Any, tensors: Mapping[str, torch.Tensor], *, rebuild_dtensor: DTensorRebuilder | None = None
) -> Any:
    """Rebuild the nested state from a skeleton and the tensors it names.

    ``rebuild_dtensor`` is required when the state held DTensors (see :data:`DTensorRebuilder`).

    Raises:
        KeyError: the skeleton names a tensor that ``tensors`` lacks.
        ValueError: the skeleton holds a node this version cannot read.
    """

    def dec(node: Any) -> Any:
        if node is None or isinstance(node, bool | int | float | str):
            return node
        if isinstance(node, list):  # JSON keys of a "m" mapping are lists of [key, value]
            return [dec(v) for v in node]
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError(f"malformed checkpoint skeleton node: {str(node)[:80]}")
        ((tag, val),) = node.items()
        if tag == "d":
            return {k: dec(v) for k, v in val.items()}
        if tag == "m":
            return {_hashable(dec(k)): dec(v) for k, v in val}
        if tag == "l":
            return [dec(v) for v in val]
        if tag == "t":
            return tuple(dec(v) for v in val)
        if tag == "T":
            return tensors[val]
        if tag == "DT":
            if rebuild_dtensor is None:
                raise ValueError("checkpoint holds sharded (DTensor) state: restore it through a sharding strategy")
            return rebuild_dtensor(tensors[val["local"]], val)
        if tag == "np":
            return tensors[val].numpy()
        if tag == "f":
            return float(val)
        if tag == "b":
            return base64.b64decode(val)
        if tag == "dt":
            return dtype_from_name(val)
        if tag == "dev":
            return torch.device(val)
        if tag == "repr":
            return val
        raise ValueError(f"unknown checkpoint skeleton tag {tag!r}; written by a newer lightning_resilience?")

    return dec(skeleton)


def _placement_text(placement: Any) -> str:
    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    if isinstance(placement, Replicate):
        return "R"
    raise ValueError(f"cannot checkpoint a DTensor with placement {placement!r} (pending reduction?)")


def placement_from_text(text: str) -> Shard | Replicate:
    """Inverse of the placement encoding used in skeletons (``S0``, ``R``)."""
    if text == "R":
        return Replicate()
    if text.startswith("S") and text[1:].isdigit():
        return Shard(int(text[1:]))
    raise ValueError(f"unknown DTensor placement {text!r} in checkpoint")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list | tuple) else key
