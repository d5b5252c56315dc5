"""Typed, self-validating configuration dataclasses, one per component."""

from lightning_resilience.config.checkpoint import CheckpointConfig, LocalTierConfig, MemoryTierConfig, RemoteTierConfig

__all__ = ["CheckpointConfig", "LocalTierConfig", "MemoryTierConfig", "RemoteTierConfig"]
