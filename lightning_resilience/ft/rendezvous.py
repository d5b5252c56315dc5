"""Restarts that come up: a store of this attempt for the process groups, and the launch lines known to hang.

Why restarts hang (torch 2.4 and later, checked on 2.13): under torchrun's static rendezvous (``--master-port``,
what users type) and under the ``c10d`` rendezvous with its store shared (the default), the workers' default process
group uses the *agent's* TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``), and that store lives as long as the
agent, across every restart. ``torch.distributed.rendezvous._create_c10d_store`` adds no per-attempt key prefix (its
comment assumes a new store for every retry; torch 2.3 and earlier prefixed ``/worker/attempt_<n>``), so gloo's
``connectFullMesh`` of a restarted worker can read the listening address its peer wrote in the *previous* attempt
(``default_pg/0//cpu//0/<rank>``). It then either connects to a dead port (``Connection refused`` after three
retries) or, when both ranks read a stale address, both wait to be connected to (``Pair::waitUntilConnected``)
until the process-group timeout (30 minutes by default). See docs/launching.md for the reproduction.

:func:`attempt_store` gives the default process group a store whose keys are this attempt's alone (the fix
:class:`~lightning_resilience.lightning.strategies.ResilientDDPStrategy` applies); :func:`restart_hazard` names a
launch line that can hang, so a job says so before it trains. ``lightning-resilience launch`` avoids the hazard
altogether: every attempt gets a new agent and a new store.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from lightning_resilience.ft.restart import ATTEMPT_ENV, current_attempt

__all__ = ["SCOPED_STORE_ENV", "agent_store_shared", "attempt_store", "restart_hazard"]

log = logging.getLogger(__name__)

SCOPED_STORE_ENV = "LIGHTNING_RESILIENCE_ATTEMPT_STORE"
"""Set (to the key prefix) in a process whose default process group was created on :func:`attempt_store`."""

_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
_MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"


def agent_store_shared() -> bool:
    """True when torchrun's workers connect to the agent's store, which outlives an attempt (static rendezvous, or
    ``c10d`` without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``)."""
    return os.environ.get(_AGENT_STORE_ENV) == str(True)


def attempt_store(timeout: timedelta | None = None) -> dist.Store | None:
    """A client of the agent's store whose keys are prefixed with this attempt, for ``init_process_group(store=)``;
    None when the workers' store is new each attempt anyway (nothing to fix).

    Every group created from the default one (``new_group``, our side groups) inherits the prefix. The attempt is
    torchrun's restart count (counted by each node's agent: the nodes agree as long as every attempt ends on every
    node, the way a static rendezvous restarts) or the attempt index of ``lightning-resilience launch``.
    """
    if not agent_store_shared():
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    attempt = current_attempt()
    prefix = f"lightning_resilience/{attempt.job_id or 'job'}/attempt_{attempt.restart_count}"
    client = dist.TCPStore(addr, int(port), is_master=False, timeout=timeout or default_pg_timeout)
    os.environ[SCOPED_STORE_ENV] = prefix
    log.info(
        "rank %d: process groups on the agent's store under %r (keys of earlier attempts unseen)", attempt.rank, prefix
    )
    return dist.PrefixStore(prefix, client)


def restart_hazard() -> str | None:
    """Why a restart of this job may hang in process-group creation, and the fix; None when it cannot.

    True for torchrun restarts (``--max-restarts`` > 0) with a store shared across attempts, unless this process
    created its process group on :func:`attempt_store` or runs under ``lightning-resilience launch``.
    """
    if not agent_store_shared() or os.environ.get(SCOPED_STORE_ENV) or os.environ.get(ATTEMPT_ENV):
        return None
    try:
        max_restarts = int(os.environ.get(_MAX_RESTARTS_ENV, "0") or 0)
    except ValueError:
        return None
    if max_restarts < 1:
        return None
    return (
        f"torchrun restarts this job (--max-restarts {max_restarts}) with a store shared by every attempt: a restarted "
        "worker can read its peer's gloo address from the attempt before and hang or fail in init_process_group "
        "(torch >= 2.4). Launch with `lightning-resilience launch --run-dir DIR ...` (a new store per attempt), or use "
        "strategy=ResilientDDPStrategy() (an attempt-scoped store), or torchrun --rdzv-backend c10d "
        "--rdzv-endpoint HOST:PORT with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. See docs/launching.md."
    )
