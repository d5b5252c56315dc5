"""Benchmarks of the resilience suite: each module measures one area against baselines taken in the same run.

Run one with ``python -m benchmarks.<module>`` or all of them (and regenerate ``docs/benchmarks.md``) with
``python -m benchmarks.run_all``. Results are JSON files under ``benchmarks/results/``.
"""
