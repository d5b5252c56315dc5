"""Bridges to training frameworks built on Lightning; import the one you use, e.g.
``from lightning_resilience.integrations.nemo import resilience_callbacks`` (nothing is imported here)."""
