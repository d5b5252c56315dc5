"""Domain errors of the checkpoint engine; each message says what to do next."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every checkpoint-engine fault."""


class CheckpointCorruptError(CheckpointError):
    """A stored checkpoint failed validation (missing file, wrong size, checksum mismatch, bad manifest)."""


class CheckpointWorkerError(CheckpointError):
    """The background persist worker failed or died; raised on the training thread."""


class NoValidCheckpointError(CheckpointError):
    """No checkpoint that every rank can load was found and the configuration demands one."""
