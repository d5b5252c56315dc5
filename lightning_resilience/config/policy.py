"""Re-exports: the policy's config lives in :mod:`lightning_resilience.policy`."""

from lightning_resilience.policy import ACTIONS, ALLOWED, PolicyConfig

__all__ = ["ACTIONS", "ALLOWED", "PolicyConfig"]
