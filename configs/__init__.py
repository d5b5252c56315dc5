"""The YAML config groups of the suite (``resilience/{checkpoint,straggler,sdc,ft,policy}``, presets, drills and the
recipes' primary configs), installed as ``lightning_resilience.configs`` and found by every Hydra app through the
``hydra_plugins`` search-path plugin as ``pkg://lightning_resilience.configs``."""
