"""Test and drill support that ships with the package (a drill's subprocess imports it): fault injection."""

from lightning_resilience.testing.faults import ENV, Fault, FaultPlan, InjectedError, InjectedFault, arm_from_env

__all__ = ["ENV", "Fault", "FaultPlan", "InjectedError", "InjectedFault", "arm_from_env"]
