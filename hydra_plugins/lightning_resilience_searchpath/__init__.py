"""Hydra search-path plugin: the suite's config groups in every Hydra app (``+resilience=default``)."""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

PROVIDER = "lightning_resilience"
PATH = "pkg://lightning_resilience.configs"


class LightningResilienceSearchPathPlugin(SearchPathPlugin):
    """Appends ``pkg://lightning_resilience.configs`` to the app's search path and registers the config schemas.

    Hydra calls this while it sets up an app, before it composes the config: the groups under
    ``resilience/`` refer to the schemas (``resilience/schema/*``) registered here, so a plain Hydra app (a NeMo
    example script) composes ``+resilience=default`` without any code of ours.
    """

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from lightning_resilience.config.registry import register_configs

        register_configs()
        if not any(element.path == PATH for element in search_path.get_path()):
            search_path.append(provider=PROVIDER, path=PATH)
