"""Content integrity: is the step a tier committed, or a restore loaded, the step that was snapshotted?

Checksums cover the bytes a tier wrote, not whether those bytes are the step's state: an asynchronous save whose
staging buffers were not refreshed writes an older step's tensors under the new name, and every save and load
"succeeds" (NeMo-RL #3312). A :class:`ContentPrint` is taken from the live tensors as a step is captured for a
persistent tier: per tensor, one wrapping int64 sum of its raw bits read as integers (one reduction per tensor,
where the tensor lives; on a GPU the sums travel to the host by a non-blocking copy and are read late, by the persist
worker). Flipping any bit changes a tensor's sum; another step's tensors almost surely have other sums.

The print goes into the step's metadata (``meta["content"]``, in every persistent tier's manifest). It is checked
twice: when a tier is about to commit the step (the staged host tensors against the print: a stale staging buffer is
refused, naming its tensors) and when the step is read back for a restore (the loaded tensors against the manifest's
print: a tier that wrote another step's tensors is skipped, naming it, and the restore takes an older step). A step
without a print (written before, or by an emergency save of a RAM snapshot) is not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from lightning_resilience._staging import HostStage
from lightning_resilience.checkpoint.errors import CheckpointCorruptError

__all__ = ["CONTENT", "ContentPrint", "check_content", "content_mismatch", "tensor_sums", "without_print"]

CONTENT = "content"
"""The metadata key of a step's print: ``{"algo": "isum64", "tensors": {name: sum}}``."""
ALGO = "isum64"
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _int_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The wrapping int64 sum of ``tensor``'s raw bits read as signed integers of its element width (0-d, where the
    tensor lives)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    ints = flat.to(torch.int8) if flat.dtype == torch.bool else flat.view(_INT_OF_WIDTH[flat.element_size()])
    return ints.sum(dtype=torch.int64)


def tensor_sums(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Every tensor's sum, read now (host tensors: a restore, a commit check, the CLI)."""
    if not tensors:
        return {}
    values = torch.stack([_int_sum(t).cpu() for t in tensors.values()]).tolist()
    return dict(zip(tensors, (int(v) for v in values)))


class ContentPrint:
    """The per-tensor sums of one step's tensors, computed where they live, read when first asked for.

    Args:
        step: the step the tensors are the state of.
        tensors: name -> tensor (the flattened state, before the snapshot copy).
    """

    def __init__(self, step: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.step = step
        self.names = list(tensors)
        by_device: dict[torch.device, list[int]] = {}
        values = list(tensors.values())
        for i, tensor in enumerate(values):
            by_device.setdefault(tensor.device, []).append(i)
        # on a GPU a non-blocking copy into pinned memory: read late, by the persist worker, never by the step
        self._stage = HostStage(max_pending=len(by_device) + 1)
        for index in by_device.values():
            self._stage.put(tuple(index), [_int_sum(values[i]) for i in index], dtype=torch.int64)
        self._value: dict[str, int] | None = None

    def value(self) -> dict[str, int]:
        """name -> sum (waits for a device copy still in flight: call it off the training thread)."""
        if self._value is None:
            out: dict[int, int] = {}
            for index, sums in self._stage.drain():
                out.update(zip(cast(tuple[int, ...], index), (int(v) for v in sums)))
            self._value = {self.names[i]: out[i] for i in range(len(self.names))}
        return self._value

    def meta(self) -> dict[str, Any]:
        """The print as it goes into the step's metadata."""
        return {CONTENT: {"algo": ALGO, "tensors": self.value()}}

    def refuse(self, snap: Any) -> CheckpointCorruptError | None:
        """Put the print in ``snap``'s metadata (read late: the copy has long landed) and check the staged tensors
        against it: the error that refuses them (they are not the step's state), or None."""
        snap.meta.update(self.meta())
        try:
            check_content(snap.tensors, snap.meta, step=snap.step, where=f"staged snapshot of step {snap.step}")
        except CheckpointCorruptError as err:
            return err
        return None


def without_print(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A step's metadata as a restore hands it back: the print is the engine's own (it stays in the manifest)."""
    return {k: v for k, v in meta.items() if k != CONTENT}


def content_mismatch(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> list[str] | None:
    """The names of the tensors that are not what the step's print says (missing, extra or different), [] when all
    are, None when the step carries no print."""
    recorded = meta.get(CONTENT)
    if not isinstance(recorded, Mapping) or recorded.get("algo") != ALGO:
        return None
    expected = {str(k): int(v) for k, v in dict(recorded.get("tensors", {})).items()}
    got = tensor_sums(tensors)
    return sorted(n for n in expected.keys() | got.keys() if expected.get(n) != got.get(n))


def check_content(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], *, step: int, where: str) -> None:
    """Raise :class:`CheckpointCorruptError` naming ``where`` and the tensors when ``tensors`` are not the state
    step ``step``'s print describes."""
    bad = content_mismatch(tensors, meta)
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise CheckpointCorruptError(
            f"{where}: the tensors of step {step} are not the state that was snapshotted at that step ({shown} "
            "differ from its content print): another step's tensors, or stale staging buffers"
        )
