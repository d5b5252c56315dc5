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

:func:`scope_rendezvous` is the fix for any strategy that creates its process group through ``env://`` (Lightning's
default DDP, FSDP, a script's own ``init_process_group()``): called before the process group exists (by
``TieredCheckpoint`` and ``FaultTolerance`` when built, and by the zero-code entry point), it has rank 0 host a new
store for this attempt on a port of its own, publishes its address in the agent's store under a key of this
attempt, and points ``MASTER_ADDR``/``MASTER_PORT`` at it with ``TORCHELASTIC_USE_AGENT_STORE=False`` - what
torchrun itself does for ``c10d`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which makes restarts come up.
:func:`attempt_store` gives a strategy that creates its own process group a store whose keys are this attempt's alone
(:class:`~lightning_resilience.lightning.strategies.ResilientDDPStrategy`). :func:`restart_hazard` names a launch
line that can still hang (the process group existed before any of these ran), so a job says so before it trains,
and :func:`guard_restart` ends such a restarted attempt in seconds, with the fix, instead of a hang.
``lightning-resilience launch`` avoids the hazard altogether: every attempt gets a new agent and a new store.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from lightning_resilience.ft.restart import ATTEMPT_ENV, current_attempt

__all__ = [
    "SCOPED_STORE_ENV",
    "RestartHazardError",
    "agent_store_shared",
    "attempt_store",
    "guard_restart",
    "prepare_restarts",
    "restart_hazard",
    "scope_rendezvous",
]

log = logging.getLogger(__name__)

SCOPED_STORE_ENV = "LIGHTNING_RESILIENCE_ATTEMPT_STORE"
"""Set (to the key prefix) in a process whose default process group was created on :func:`attempt_store`."""

_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
_MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"
SCOPE_TIMEOUT = timedelta(seconds=300)
"""How long a rank waits for rank 0 to publish this attempt's store (ranks build their callbacks at about the same
time; rank 0 publishes as soon as it builds its first one)."""
_held: list[dist.Store] = []  # rank 0's store of this attempt: it must live until init_process_group picks it up
_warned = False


class RestartHazardError(RuntimeError):
    """A restarted attempt whose process groups would meet in a store still holding the previous attempt's keys."""


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


def _restarts() -> int:
    try:
        return int(os.environ.get(_MAX_RESTARTS_ENV, "0") or 0)
    except ValueError:
        return 0


def scope_rendezvous(timeout: timedelta = SCOPE_TIMEOUT) -> str | None:
    """Give this attempt's default process group a store of its own, before it is created; returns the new
    ``host:port`` (None when nothing needed doing: no restarts, a store new each attempt anyway, our launcher, or
    done already in this process).

    Collective over the ranks of the job (each waits, bounded by ``timeout``, for rank 0's address). Must run before
    ``init_process_group``; a process whose group exists already is left as it is (:func:`restart_hazard` says so).

    Raises:
        RestartHazardError: rank 0's address did not come within ``timeout``.
    """
    if os.environ.get(SCOPED_STORE_ENV) or os.environ.get(ATTEMPT_ENV) or not agent_store_shared():
        return None
    if _restarts() < 1 or (dist.is_available() and dist.is_initialized()):
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    attempt = current_attempt()
    prefix = f"lightning_resilience/{attempt.job_id or 'job'}/attempt_{attempt.restart_count}"
    agent = dist.PrefixStore(prefix, dist.TCPStore(addr, int(port), is_master=False, timeout=timeout))
    if attempt.rank == 0:
        # multi_tenant: init_process_group's env:// handler, asked for a server on this port, finds this one
        server = dist.TCPStore(
            addr, 0, is_master=True, wait_for_workers=False, multi_tenant=True, timeout=default_pg_timeout
        )
        _held.append(server)
        host = addr if _is_local(addr) else socket.getfqdn()
        where = f"{host}:{server.port}"
        agent.set("store", where)
    else:
        try:
            where = agent.get("store").decode()
        except RuntimeError as err:  # DistStoreError (a timeout) is a RuntimeError
            raise RestartHazardError(
                f"rank {attempt.rank}: rank 0 did not publish this attempt's store within {timeout} ({err}); "
                "build the callbacks on every rank, or launch with `lightning-resilience launch`"
            ) from err
    host, _, new_port = where.rpartition(":")
    os.environ.update(
        {"MASTER_ADDR": host, "MASTER_PORT": new_port, _AGENT_STORE_ENV: str(False), SCOPED_STORE_ENV: prefix}
    )
    log.info("rank %d: this attempt's process groups meet in a store of their own at %s", attempt.rank, where)
    return where


def _is_local(addr: str) -> bool:
    """Whether ``addr`` is an address of this host (it can be bound here)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as probe:
            probe.bind((addr, 0))
        return True
    except OSError:
        return False


def restart_hazard() -> str | None:
    """Why a restart of this job may hang in process-group creation, and the fix; None when it cannot.

    True for torchrun restarts (``--max-restarts`` > 0) whose workers meet in the agent's store, which outlives every
    attempt: the static rendezvous (``--master-port``), whatever ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` says (it
    acts on ``c10d`` only), and ``c10d`` without that variable. Not when this process scoped its store
    (:func:`scope_rendezvous`, :func:`attempt_store`) or runs under ``lightning-resilience launch``.
    """
    if not agent_store_shared() or os.environ.get(SCOPED_STORE_ENV) or os.environ.get(ATTEMPT_ENV):
        return None
    max_restarts = _restarts()
    if max_restarts < 1:
        return None
    return (
        f"torchrun restarts this job (--max-restarts {max_restarts}) and every attempt's workers meet in the agent's "
        "store, which keeps the previous attempt's keys: a restarted worker can read its peer's old gloo address and "
        "hang or fail in init_process_group (torch >= 2.4). The process group was created before the suite could "
        "give this attempt a store of its own. Build TieredCheckpoint or FaultTolerance before creating the process "
        "group, or launch with `lightning-resilience launch ...` (a new store per attempt), or use "
        "strategy=ResilientDDPStrategy(), or torchrun --rdzv-backend c10d --rdzv-endpoint HOST:PORT with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (which does nothing for --master-port). See docs/launching.md."
    )


def guard_restart() -> None:
    """At a restarted attempt exposed to the hazard whose process group is still to be created, end now with the
    fix instead of hanging in ``init_process_group`` until its timeout (30 minutes by default).

    Raises:
        RestartHazardError: this is a restart, its process group does not exist yet, and :func:`restart_hazard`
            names a hazard.
    """
    hazard = restart_hazard()
    created = dist.is_available() and dist.is_initialized()
    if hazard is not None and current_attempt().restart_count > 0 and not created:
        raise RestartHazardError(f"this restart cannot be trusted to come up: {hazard}")


def prepare_restarts() -> None:
    """What every entry point of the suite calls when it is built, before the process group exists: scope this
    attempt's store (:func:`scope_rendezvous`); where that cannot be done, say the hazard at attempt 0 (once) and end
    a restarted attempt with the fix (:func:`guard_restart`)."""
    global _warned
    scope_rendezvous()
    hazard = restart_hazard()
    if hazard is None:
        return
    if current_attempt().restart_count == 0 and not _warned:
        _warned = True
        log.warning(hazard)
    guard_restart()
