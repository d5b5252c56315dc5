"""Packages of the wheel (metadata and dependencies: setup.cfg).

``configs/`` and ``recipes/`` stay at the top of the repository and install as ``lightning_resilience.configs``
and ``lightning_resilience.recipes`` (``package_dir`` in setup.cfg); ``hydra_plugins`` is Hydra's namespace for
plugins. No other top-level package goes into the wheel.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["lightning_resilience", "lightning_resilience.*"]),
        "lightning_resilience.configs",
        "lightning_resilience.recipes",
        "hydra_plugins.lightning_resilience_searchpath",
    ]
)
