"""Discrete-event reliability simulator: failures, checkpoint tiers and restart paths -> ETTR and its breakdown.

Framework-free (NumPy only). ``simulate(SimConfig(...))`` runs one job; ``simulate_many`` replicates it;
``sweep`` and ``optimal_interval`` explore cadence and scale; ``young_interval``/``daly_interval``/``daly_ettr`` are
the closed forms it is checked against; ``simulate_main`` is the ``lightning-resilience simulate`` command.
"""

from lightning_resilience.sim.analytic import daly_ettr, daly_interval, first_order_waste, young_interval
from lightning_resilience.sim.cli import simulate_main
from lightning_resilience.sim.config import (
    ClusterConfig,
    FailureConfig,
    FailureKindConfig,
    JobConfig,
    RestartConfig,
    SimConfig,
    SimTierConfig,
)
from lightning_resilience.sim.engine import (
    CATEGORIES,
    Breakdown,
    FailureTrace,
    MonteCarloResult,
    SimResult,
    draw_failures,
    simulate,
    simulate_many,
)
from lightning_resilience.sim.from_run import RunCosts, apply_run_costs, load_run_costs
from lightning_resilience.sim.report import breakdown_table, plot_sweep, sweep_table
from lightning_resilience.sim.sweep import optimal_interval, sweep, with_gpus, with_interval

__all__ = [
    "CATEGORIES",
    "Breakdown",
    "ClusterConfig",
    "FailureConfig",
    "FailureKindConfig",
    "FailureTrace",
    "JobConfig",
    "MonteCarloResult",
    "RestartConfig",
    "RunCosts",
    "SimConfig",
    "SimResult",
    "SimTierConfig",
    "apply_run_costs",
    "breakdown_table",
    "daly_ettr",
    "daly_interval",
    "draw_failures",
    "first_order_waste",
    "load_run_costs",
    "optimal_interval",
    "plot_sweep",
    "simulate",
    "simulate_main",
    "simulate_many",
    "sweep",
    "sweep_table",
    "with_gpus",
    "with_interval",
    "young_interval",
]
