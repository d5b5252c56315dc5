"""The five stall paths of ``tests/checkpoint/test_stalls.py``, replayed on commit 093449b, where they hang or fail.

Run from a checkout of that commit: ``cd <checkout> && PYTHONPATH=<checkout> python <this file> [scenario ...]``
(``make stalls-before-after`` does so in a temporary worktree, then runs the tests on the current tree). It is
written against 093449b's API: the fault kit did not exist there, so each fault is injected by wrapping one method
of a tier instance or the module-level shard writer, as ``FaultPlan`` does now. Each scenario mirrors one test of
``test_stalls.py`` (same tiers, steps, faults, timeouts and assertions) and runs in fresh processes (spawn; 2 gloo
ranks, or 1 process for the store paths 4 and 5, as in the tests) under a hard deadline. A rank that has returned
stays alive until every rank has (as in a job, whose processes the launcher tears down together), so a rank waiting
on a peer is not set free by that peer's exit; past the deadline the waiting ranks' stacks are dumped and they are
killed. The store scenarios let the blocked call run to its end (up to ``MEASURE_S``) to time it.

Each scenario ends as ``HANG (killed after N s)``, ``FAIL: <what went wrong>`` (the test's assertions do not hold),
``ok`` (the path did not misbehave) or ``ERROR`` (the replay itself broke). Exit status 0 when every scenario hung
or failed, i.e. every stall path reproduces; 1 otherwise. Not collected by pytest (no ``test_`` prefix), and not
type-checked against the current package (it imports 093449b's).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lightning_resilience
import lightning_resilience.checkpoint.local as local_module
from lightning_resilience import CheckpointConfig
from lightning_resilience.checkpoint.errors import CheckpointWorkerError, NoValidCheckpointError
from lightning_resilience.checkpoint.local import LocalTier
from lightning_resilience.checkpoint.manager import CheckpointManager
from lightning_resilience.checkpoint.memory import MemoryTier
from lightning_resilience.checkpoint.remote import RemoteTier
from lightning_resilience.checkpoint.replication import PeerTier

DRAIN = timedelta(seconds=30)
DEADLINE_S = 90.0  # the whole scenario, as in test_stalls.py
PEER_TIMEOUT_S = 240.0  # longer than the deadline: a rank exchanging alone blocks past it
HANG_LIMIT_S = 300.0  # an injected hang ends by itself after this, so nothing outlives a forgotten release
MEASURE_S = 75.0  # how long a store scenario lets the blocked call run, to time it (the tests give up at 20 s)

Ranks = Callable[[int, int, Path], dict[str, Any]]
Judge = Callable[[list[dict[str, Any]]], "str | None"]


@dataclass(frozen=True)
class Scenario:
    """One test replayed: its path, its name on main, what each rank runs, and the test's assertions (``judge``:
    None when they hold, else what went wrong)."""

    path: str
    test: str
    ranks: Ranks
    judge: Judge
    world: int


SCENARIOS: dict[str, Scenario] = {}


def _scenario(path: str, judge: Judge, world: int = 2, test: str = "") -> Callable[[Ranks], Ranks]:
    """Register a scenario under the first word of ``path``; the test it mirrors is named in its docstring."""

    def register(ranks: Ranks) -> Ranks:
        name = test or re.findall(r"test_\w+", ranks.__doc__ or "")[0]
        SCENARIOS[path.split()[0]] = Scenario(path, name, ranks, judge, world)
        return ranks

    return register


# ---------------------------------------------------------------- fault injection on the old API
class InjectedFault(OSError):
    """An injected I/O fault (as the fault kit's)."""


class InjectedError(RuntimeError):
    """An injected bug (as the fault kit's)."""


def _fail_write_shard(rank: int, step: int, error: type[Exception]) -> Callable[[], None]:
    """On ``rank``, the shard writer inside a directory tier's commit raises ``error`` at ``step``, once (the fault
    kit's ``local.write_shard``). Returns the undo."""
    original, left = local_module.write_shard, [1]

    def write_shard(directory: Any, snap: Any, *args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == rank and snap.step == step and left[0]:
            left[0] -= 1
            raise error(f"injected {error.__name__} at local.write_shard (rank {rank}, step {step})")
        return original(directory, snap, *args, **kwargs)

    local_module.write_shard = write_shard  # type: ignore[assignment]
    return lambda: setattr(local_module, "write_shard", original)


def _hang_write(tier: Any, step: int, release: threading.Event) -> None:
    """The tier's ``write`` of ``step`` blocks until ``release`` (``tier.<name>.write`` with a ``hang``)."""
    original = tier.write

    def write(snap: Any) -> None:
        if snap.step == step:
            release.wait(HANG_LIMIT_S)
        original(snap)

    tier.write = write


def _refuse_take_once(tier: MemoryTier, step: int) -> None:
    """The RAM tier cannot hand over ``step``, once (``tier.memory.take`` with a ``raise``)."""
    original, left = tier.take, [1]

    def take(wanted: int) -> Any:
        if wanted == step and left[0]:
            left[0] -= 1
            raise InjectedFault(f"injected raise at tier.memory.take (step {step})")
        return original(wanted)

    tier.take = take  # type: ignore[method-assign]


class _BlackHole:
    """The store stops answering: the server is killed and its port listens without ever accepting, so every
    request connects and then waits for an answer that never comes (``black_hole`` of the current tree)."""

    def __init__(self, endpoint: Any) -> None:
        self.endpoint, self.sock = endpoint, None

    def open(self) -> None:
        if self.sock is None:
            self.endpoint.server.kill()
            self.sock = socket.create_server(("127.0.0.1", self.endpoint.server.port), backlog=64)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


# ---------------------------------------------------------------- the scenarios (one per test of test_stalls.py)
def _state(rank: int, step: int) -> dict[str, Any]:
    return {"step": step, "w": torch.full((64,), float(rank * 1000 + step))}


def _manager(tiers: list[Any]) -> CheckpointManager:
    mgr = CheckpointManager(tiers, CheckpointConfig(drain_timeout_s=DRAIN.total_seconds()))
    mgr.setup()
    return mgr


def _peer(tmp: Path, every: int = 2) -> PeerTier:
    return PeerTier(tmp / "shm" / "node{node}", every_n_steps=every, keep=3, ranks_per_node=1, timeout_s=PEER_TIMEOUT_S)


def _judge_emergency(r: list[dict[str, Any]]) -> str | None:
    if r[0]["saved"] == 4 and r[1]["saved"] is None and max(x["elapsed"] for x in r) < 20:
        return None
    return f"saved {r[0]['saved']}/{r[1]['saved']} in {r[0]['elapsed']:.1f}/{r[1]['elapsed']:.1f} s"


@_scenario("1 collective emergency save", _judge_emergency)
def _emergency_one_rank_busy(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """test_collective_emergency_save_returns_on_every_rank_when_one_rank_cannot_write"""
    release = threading.Event()
    local = LocalTier(tmp / "ckpt", every_n_steps=2, keep=3)
    if rank == 1:
        _hang_write(local, 4, release)  # rank 1's persist of step 4 never finishes
    mgr = _manager([MemoryTier(keep=2), local])
    for step in range(1, 5):
        mgr.on_step(step, lambda step=step: _state(rank, step))
        if step < 4:
            assert mgr.wait(DRAIN)
    start = time.monotonic()
    saved = mgr.emergency_save(timedelta(seconds=3), collective=True)
    elapsed = time.monotonic() - start
    release.set()
    mgr.close(DRAIN)
    return {"saved": saved, "elapsed": elapsed}


def _judge_peer_bug(r: list[dict[str, Any]]) -> str | None:
    if r[0].get("idle") is True and r[0]["elapsed"] < 30 and "InjectedError" in r[1].get("error", ""):
        return None
    error = "InjectedError" if "InjectedError" in r[1].get("error", "") else r[1].get("error")
    return (
        f"rank 1 raised {error} without exchanging; rank 0's persist was still waiting in the peer exchange when "
        f"its {DRAIN.seconds} s drain ended (idle={r[0].get('idle')} after {r[0]['elapsed']:.1f} s) and after its "
        f"close (pending={r[0]['pending_after_close']}); its bound is the {PEER_TIMEOUT_S:.0f} s peer timeout"
    )


@_scenario("2a peer exchange (a bug in one commit)", _judge_peer_bug)
def _peer_local_bug(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """test_a_bug_in_one_rank_s_local_commit_does_not_skip_its_peer_exchange"""
    undo = _fail_write_shard(1, 4, InjectedError)  # a bug (not an I/O error) in rank 1's commit
    try:
        mgr = _manager([MemoryTier(keep=2), _peer(tmp)])
        outcome: dict[str, Any] = {}
        for step in range(1, 4):
            mgr.on_step(step, lambda step=step: _state(rank, step))
            assert mgr.wait(DRAIN)
        mgr.on_step(4, lambda: _state(rank, 4))
        start = time.monotonic()
        try:
            outcome["idle"] = mgr.wait(DRAIN)
        except CheckpointWorkerError as err:
            outcome["error"] = str(err)
        outcome["elapsed"] = time.monotonic() - start
        mgr.close(DRAIN)
        outcome["pending_after_close"] = mgr._worker.busy
    finally:
        undo()
    return outcome


def _judge_flush(r: list[dict[str, Any]]) -> str | None:
    lists_ok = 4 in r[0]["before"] and 4 not in r[1]["before"] and 4 in r[0]["after"] and 4 in r[1]["after"]
    if lists_ok and max(x["elapsed"] for x in r) < 30:
        return None
    return (
        f"rank 1 alone lacked step 4 (peer steps {r[1]['before']}) and wrote the tier alone: rank 0's flush returned "
        f"in {r[0]['elapsed']:.1f} s, rank 1's exchanged alone until its {DRAIN.seconds} s drain ran out "
        f"({r[1]['elapsed']:.1f} s; exchange still pending={r[1]['pending']}, {PEER_TIMEOUT_S:.0f} s peer timeout)"
    )


@_scenario("2b peer exchange (flush, one rank lacks the step)", _judge_flush)
def _flush_one_rank_lacks(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """test_flush_writes_a_peer_tier_on_every_rank_when_one_rank_lacks_the_step"""
    undo = _fail_write_shard(1, 4, InjectedFault)  # rank 1's own copy of step 4 is not committed
    try:
        peer = _peer(tmp)
        mgr = _manager([MemoryTier(keep=2), peer])
        for step in range(1, 5):
            mgr.on_step(step, lambda step=step: _state(rank, step))
            assert mgr.wait(DRAIN)
        before = peer.list_steps()
        start = time.monotonic()
        mgr.flush(4, lambda: _state(rank, 4))
        elapsed = time.monotonic() - start
        pending, after = mgr._worker.busy, peer.list_steps()
        mgr.close(DRAIN)
    finally:
        undo()
    return {"before": before, "after": after, "elapsed": elapsed, "pending": pending}


def _judge_ram(r: list[dict[str, Any]]) -> str | None:
    first_ok = r[0]["first"] == r[1]["first"] == 5 and r[0]["held_after_first"] == [6]
    if first_ok and (r[0].get("second"), r[1].get("second")) == (6, 6) and (r[0]["w"], r[1]["w"]) == (6.0, 1006.0):
        return None
    return (
        f"both restored step {r[0]['first']}, but rank 0's RAM copy of step 6 was consumed by the refused attempt "
        f"(held afterwards: {r[0]['held_after_first']}); restore(6): {r[0].get('second_error', r[0].get('second'))}"
    )


@_scenario("3 RAM snapshot taken before the agreement", _judge_ram)
def _ram_step_refused(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """test_a_ram_snapshot_survives_a_step_another_rank_refuses"""
    memory = MemoryTier(keep=2)
    if rank == 1:
        _refuse_take_once(memory, 6)  # rank 1 cannot produce step 6, once
    mgr = _manager([memory])
    for step in range(1, 7):
        mgr.on_step(step, lambda step=step: _state(rank, step))
    first = mgr.restore()
    assert first is not None
    out: dict[str, Any] = {"first": first.step, "held_after_first": memory.list_steps()}
    try:  # rank 1's fault was transient: step 6 should be loadable everywhere now
        second = mgr.restore(6)
        assert second is not None
        out.update(second=second.step, w=second.state["w"][0].item())
    except NoValidCheckpointError as err:
        out["second_error"] = f"{type(err).__name__}: {err}"
    mgr.close(DRAIN)
    return out


def _s3() -> Any:
    """A private moto server with one bucket (093449b's ``own_s3`` fixture, without pytest)."""
    from tests.checkpoint._s3server import S3Endpoint, S3Server

    server = S3Server()
    server.start()
    server.reset()
    endpoint = S3Endpoint(server)
    endpoint.create_bucket()
    return endpoint


def _hung_store_tier(s3: Any, every: int, timeout_s: float = 45.0) -> RemoteTier:
    options = s3.storage_options(
        config_kwargs={"retries": {"total_max_attempts": 1}, "connect_timeout": 60, "read_timeout": 60}
    )
    tier = RemoteTier(s3.url(), every_n_steps=every, keep=2, storage_options=options, retries=0, timeout_s=timeout_s)
    tier.fs.retries = 1  # s3fs's own retry loop would wait on top of the tier's
    return tier


def _in_thread(fn: Callable[[], Any], limit_s: float) -> float:
    """Run ``fn`` on a thread; the seconds it took, or ``inf`` if it did not return within ``limit_s``."""
    done = threading.Event()
    start = time.monotonic()
    threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
    return time.monotonic() - start if done.wait(limit_s) else float("inf")


def _time_listing(tier: RemoteTier, spent: dict[str, float], then: Callable[[], None] = lambda: None) -> None:
    """Add the seconds each ``tier.list_steps`` takes to ``spent["list_s"]``, and run ``then`` after it."""
    listing = tier.list_steps

    def timed() -> list[int]:
        t0 = time.monotonic()
        try:
            return listing()
        finally:
            spent["list_s"] += time.monotonic() - t0
            then()

    tier.list_steps = timed  # type: ignore[method-assign]


def _judge_deadline(r: list[dict[str, Any]]) -> str | None:
    took, listed = r[0]["took"], r[0]["list_s"]
    if took < 15 and r[0]["saved"] is None and r[0]["failures"] == 1:
        return None
    where = f"{listed:.1f} s listing the tier" if listed > 5 else f"{took - listed:.1f} s in the tier's write"
    return (
        f"the emergency save took {took:.1f} s with a 2 s budget ({where}: one request at the 45 s request timeout; "
        f"saved={r[0]['saved']}, failures={r[0]['failures']})"
    )


def _emergency_deadline(hole_after_listing: bool) -> Ranks:
    """An emergency save with a 2 s budget while the store hangs: from the start (as the test), or only once the
    save has listed the tier, so that only the write itself can overrun the budget."""

    def scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
        s3 = _s3()
        hole, spent, outcome = _BlackHole(s3), {"list_s": 0.0}, {}
        try:
            remote = _hung_store_tier(s3, every=1000)
            mgr = _manager([MemoryTier(keep=1), remote])
            mgr.on_step(1, lambda: _state(0, 1))
            _time_listing(remote, spent, then=hole.open)
            if not hole_after_listing:
                hole.open()
            took = _in_thread(lambda: outcome.update(saved=mgr.emergency_save(timedelta(seconds=2))), MEASURE_S)
        finally:
            hole.close()
        failures = mgr.stats.tiers["remote"].failures
        mgr.close(DRAIN)
        return {"took": took, "saved": outcome.get("saved"), "failures": failures, **spent}

    return scenario


TEST_4 = "test_an_emergency_save_stops_at_its_deadline_inside_a_remote_upload"
_scenario("4a emergency deadline (store hung)", _judge_deadline, 1, TEST_4)(_emergency_deadline(False))
_scenario("4b emergency deadline (store hung once listed)", _judge_deadline, 1, TEST_4)(_emergency_deadline(True))


def _judge_listing(r: list[dict[str, Any]]) -> str | None:
    if r[0]["took"] < 5 and r[0]["remote"] == [2] and r[0]["failures"] == 1:
        return None
    return (
        f"on_step blocked the training thread {r[0]['took']:.1f} s on the hung store, {r[0]['on_step_list_s']:.1f} "
        f"s of it in the remote tier's listing (one request at the 12 s request timeout; remote steps "
        f"{r[0]['remote']})"
    )


@_scenario("5 remote listing on the training thread", _judge_listing, world=1)
def _listing_on_training_thread(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """test_the_training_thread_never_waits_on_a_remote_listing"""
    s3 = _s3()
    hole, spent = _BlackHole(s3), {"list_s": 0.0}
    remote = _hung_store_tier(s3, every=2, timeout_s=12.0)
    mgr = _manager([MemoryTier(keep=1), remote])
    assert mgr.on_step(2, lambda: _state(0, 2)) and mgr.wait(DRAIN)  # committed while the store answers
    _time_listing(remote, spent)
    try:
        hole.open()
        took = _in_thread(lambda: mgr.on_step(4, lambda: _state(0, 4)), MEASURE_S)
        spent["on_step_list_s"] = spent["list_s"]
        remote_steps = mgr.steps()["remote"]
        mgr.close(timedelta(seconds=60))  # the upload of step 4 waits for the store in the background
    finally:
        hole.close()
    return {"took": took, "remote": remote_steps, "failures": mgr.stats.tiers["remote"].failures, **spent}


# ---------------------------------------------------------------- running ranks under a hard deadline
def _child(rank: int, world: int, key: str, tmp: str, release: Any, done: Any) -> None:
    out = Path(tmp)
    log_file = open(out / f"log_rank{rank}.txt", "w")  # noqa: SIM115 (open for the life of the process)
    os.dup2(log_file.fileno(), 2)  # gloo's and the engine's warnings go to the rank's log, not the table
    logging.basicConfig(level=logging.WARNING, stream=log_file, force=True)
    stacks = open(out / f"stacks_rank{rank}.txt", "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if world > 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        init = f"file://{tmp}/pg_store"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = {"ok": True, **SCENARIOS[key].ranks(rank, world, out)}
    except BaseException:
        result = {"ok": False, "traceback": traceback.format_exc()}
    (out / f"result_rank{rank}.tmp").write_text(json.dumps(result))
    os.replace(out / f"result_rank{rank}.tmp", out / f"result_rank{rank}.json")
    done.release()
    release.wait(DEADLINE_S + HANG_LIMIT_S)  # alive, like a rank of a running job, until the runner ends us
    os._exit(0)  # a worker thread may still sit in a collective: no teardown that could wait on it


def _where(stacks: str) -> str:
    """Where a rank's busy threads are: the collective called (else the innermost frame) <- the outermost engine
    frame."""
    found = []
    for block in re.split(r"\n\s*\n", stacks):
        frames = re.findall(r'File "([^"]+)", line \d+ in (\S+)', block)  # innermost first
        engine = [func for path, func in frames if "/lightning_resilience/" in path]
        calls = [func for path, func in frames if "torch/distributed" in path and func != "wrapper"]
        inner = calls[-1] if calls else next((f"{Path(p).name}:{f}" for p, f in frames if f != "wait"), "?")
        if engine and inner != "worker.py:_loop":  # an idle persist worker is not where a rank is stuck
            found.append(f"{inner} <- {engine[-1]}")
    return "; ".join(found) or "(no stack)"


def _ok(result: dict[str, Any] | None) -> bool:
    return bool(result and result["ok"])


def _brief(result: dict[str, Any]) -> str:
    if not result["ok"]:
        return "an error: " + result["traceback"].strip().splitlines()[-1]
    return ", ".join(f"{k}={round(v, 1) if isinstance(v, float) else v}" for k, v in result.items() if k != "ok")


def run(key: str) -> tuple[str, bool]:
    """Run one scenario: its verdict, and whether the stall path reproduced (it hung or failed)."""
    scenario, ctx = SCENARIOS[key], mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix=f"stall{key}-") as tmp:
        release, done = ctx.Event(), ctx.Semaphore(0)
        args = [(r, scenario.world, key, tmp, release, done) for r in range(scenario.world)]
        procs = [ctx.Process(target=_child, args=a) for a in args]
        start = time.monotonic()
        for proc in procs:
            proc.start()
        files = [Path(tmp) / f"result_rank{r}.json" for r in range(scenario.world)]

        for _ in procs:  # each rank signals its result; a hung one never does
            if not done.acquire(timeout=max(DEADLINE_S - (time.monotonic() - start), 0.0)):
                break
        waited = time.monotonic() - start
        hung = [r for r, f in enumerate(files) if not f.exists() and procs[r].is_alive()]
        dumps = {r: Path(tmp) / f"stacks_rank{r}.txt" for r in hung}
        for r in hung:
            os.kill(procs[r].pid, signal.SIGUSR1)
        until = time.monotonic() + 5
        while any(d.stat().st_size == 0 for d in dumps.values()) and time.monotonic() < until:
            time.sleep(0.1)  # bounded polling: faulthandler writes the dump from the rank's signal handler
        stacks = {r: _where(d.read_text()) for r, d in dumps.items()}
        for r in hung:  # before the others are let go: a peer's exit would end a hung rank's wait with an error
            procs[r].kill()
        results = [json.loads(f.read_text()) if f.exists() else None for f in files]
        release.set()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    if hung:
        done = "; ".join(f"rank {r} returned {_brief(res)}" for r, res in enumerate(results) if res is not None)
        blocked = "; ".join(f"rank {r} blocked in {stacks[r]}" for r in hung)
        return f"HANG (killed after {waited:.0f} s): {blocked}" + (f"; {done}" if done else ""), True
    broken = [f"rank {r}: {res['traceback'] if res else 'died'}" for r, res in enumerate(results) if not _ok(res)]
    if broken:
        return "ERROR: " + "\n".join(broken), False
    problem = scenario.judge([res for res in results if res is not None])
    return (f"FAIL: {problem}", True) if problem else ("ok", False)


def main(argv: list[str]) -> int:
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # the ranks' imports: pynvml's deprecation
    root = Path(lightning_resilience.__file__).resolve().parent.parent
    print(f"stall paths on the code at {root} (expected: a checkout of 093449b)", flush=True)
    rows = []
    for key in argv or list(SCENARIOS):
        t0 = time.monotonic()
        verdict, reproduced = run(key)
        rows.append((SCENARIOS[key], verdict, reproduced))
        print(f"[{key}] {time.monotonic() - t0:.0f} s  {verdict}", flush=True)
    print("\n| path | on this code | test on main | reproduced |\n|---|---|---|---|")
    for scenario, verdict, reproduced in rows:
        print(f"| {scenario.path} | {verdict.splitlines()[0]} | `{scenario.test}` | {'yes' if reproduced else 'NO'} |")
    return 0 if all(reproduced for *_, reproduced in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
