"""Pieces of the straggler benchmark (``python -m benchmarks.straggler_detection``): the scoring of real trials,
the synthetic cross-check, the rendering."""
