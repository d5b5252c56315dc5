"""Who is told when a tier commits a step: the launcher's progress record, for one (``checkpoint/progress.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["CommitListeners"]

log = logging.getLogger(__name__)


class CommitListeners:
    """``listener(tier_name, step)`` for every write a persistent tier committed, as soon as it is committed: on the
    persist worker's thread (a hung training thread must not hide a commit), or on the caller's thread for an emergency
    save. A listener must be quick and thread-safe; an error it raises is logged, never raised."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[str, int], None]] = []

    def add(self, listener: Callable[[str, int], None]) -> None:
        self._listeners.append(listener)

    def tell(self, tier: str, step: int) -> None:
        for listener in self._listeners:
            try:
                listener(tier, step)
            except Exception as err:  # what the listeners do must not fail a checkpoint
                log.warning("commit listener %r failed on step %d of tier %r: %s", listener, step, tier, err)
