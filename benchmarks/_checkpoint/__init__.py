"""Pieces of the checkpoint benchmark (``python -m benchmarks.checkpoint``): contenders, scenarios, rendering."""
