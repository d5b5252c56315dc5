"""The suite's side groups: as few as the threads that talk to other ranks, each connected lazily.

A gloo group is a set of connections between ranks; two threads must not share one (their collectives would
interleave differently on different ranks). The suite has one group per thread that agrees with other ranks:

* ``suite`` — the training thread's agreements off the ordinary step: restore, the restore bound, a persist now, an
  emergency save, an in-process rollback, SDC's checks at their cadence. Every component gets a *view* of it
  (:meth:`SideGroup.view`) with its own name and timeout. Its reductions of a few integers go along the step
  agreement's tree, on that thread and its links (:meth:`TreeAgreement.reduce_now`): ``2 * log4(N)`` hops, where
  gloo's ring all-reduce takes ``2 * (N - 1)``, and no socket of their own; its gathers and point-to-point
  exchanges are gloo's.
* ``step`` — the agreement thread (:class:`~lightning_resilience.step.agreement.TreeAgreement`): the one round of
  every step and the straggler exchange at its cadence, along a tree of the ranks. Its messages go over direct TCP
  links (``transport="tcp"``, :mod:`lightning_resilience.links`), not gloo: a round costs a rank about half the CPU
  it costs through gloo's point-to-point (``docs/design.md``, "What a round costs"), and no gloo group is made for
  it.

The checkpoint engine's persist thread has a third when a tier exchanges with peers (a peer tier's transfer group,
made by that tier). Every group connects lazily: a rank opens a socket only to the peers it talks to (the ring
neighbours of the ``suite`` group's gathers, the tree's parent and children), so sockets per rank and set-up
time do not grow with the number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from lightning_resilience.collective import SideGroup
from lightning_resilience.step.agreement import TreeAgreement

__all__ = ["Channels"]


class Channels:
    """The side groups of one training job on one rank. Collective: every rank creates it at the same point.

    Args:
        timeouts: the timeouts of the components that will use the ``suite`` group: the gloo group (and the step
            agreement's links, which carry its reductions) are made with the longest, so that each view can wait as
            long as its own timeout says (and no longer: an operation left behind by a failed agreement ends with
            the group's timeout).
        step_timeout: bound on one round of the step agreement (the policy's timeout).
        fanout: children per rank in the agreement tree.
        local: this process alone (no peers, whatever the process group).
    """

    def __init__(
        self, timeouts: Iterable[timedelta], step_timeout: timedelta, *, fanout: int = 4, local: bool = False
    ) -> None:
        longest = max([step_timeout, *timeouts])
        self._side = SideGroup("suite", longest, local=local)
        # the links wait as long as the longest view's reduction they carry may; a step's round, the policy's bound
        self._step = SideGroup("step", longest, local=local, transport="tcp")
        self.agreement = TreeAgreement(self._step, fanout=fanout, timeout=step_timeout)
        self._side.reduce_through(self.agreement.reduce_now)

    @property
    def rank(self) -> int:
        return self._side.rank

    @property
    def world_size(self) -> int:
        return self._side.world_size

    def side(self, name: str, timeout: timedelta) -> SideGroup:
        """A view of the ``suite`` group for one component (its name in errors, its own timeout)."""
        return self._side.view(name, min(timeout, self._side.timeout))

    def close(self) -> None:
        """Stop the agreement thread (bounded, after its last answers are sent) and close its links; the gloo group
        goes with the default process group."""
        self._side.reduce_through(None)  # from now on gloo's all-reduce (the agreement's thread is going)
        self.agreement.close()
        self._step.close()
