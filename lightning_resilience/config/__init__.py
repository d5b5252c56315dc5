"""Typed, self-validating configuration dataclasses, one per component."""

from lightning_resilience.config.checkpoint import CheckpointConfig, LocalTierConfig, MemoryTierConfig

__all__ = ["CheckpointConfig", "LocalTierConfig", "MemoryTierConfig"]
