"""Example training recipes (models and synthetic data) used to exercise the resilience plugins."""
