"""``python -m lightning_resilience.cli``: the same as the ``lightning-resilience`` console script."""

import sys

from lightning_resilience.cli import main

sys.exit(main())
