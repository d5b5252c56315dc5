"""StragglerDetector on an in-process cluster of real detectors with fake clocks (no processes, no sleeps)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest

from lightning_resilience.policy import Action
from lightning_resilience.step.agreement import frame
from lightning_resilience.straggler import StragglerDetector, StragglerGatherError
from lightning_resilience.straggler.config import StragglerConfig, StragglerLevelConfig
from lightning_resilience.straggler.exchange import decode_gathered, decode_payload, encode_payload
from tests.straggler._sim import Cluster, FakeClock, jitter_cost

STOP_LADDER = [
    StragglerLevelConfig(action="log", slowdown=1.1, persist_steps=1),
    StragglerLevelConfig(action="alert", slowdown=1.2, persist_steps=3),
    StragglerLevelConfig(action="stop", slowdown=1.3, persist_steps=6),
]


@pytest.mark.parametrize("seed", range(4))
def test_slow_rank_named_with_node_section_and_factor_within_bound(seed: int) -> None:
    rng = np.random.default_rng(seed)
    world, onset, slow = 4, int(rng.integers(20, 60)), int(rng.integers(4))
    cluster = Cluster(world, StragglerConfig(warmup_steps=3), ranks_per_node=2)
    cluster.run(onset + 15, jitter_cost(seed, slow_rank=slow, factor=1.2, onset=onset))
    verdicts = cluster.verdicts
    assert verdicts, "no verdict"
    v = verdicts[0]
    assert (v.rank, v.node, v.node_index, v.section, v.score, v.scope) == (
        slow,
        f"node{slow // 2}",
        slow // 2,
        "compute",
        "relative",
        "rank",
    )
    assert onset <= v.step <= onset + 4  # at most 5 slow steps observed
    assert 1.1 <= v.slowdown <= 1.35
    assert abs(v.onset_step - onset) <= 3
    assert len(verdicts) == 1


def test_clean_run_has_no_verdict() -> None:
    cluster = Cluster(4, StragglerConfig())
    cluster.run(1500, jitter_cost(11))
    assert cluster.verdicts == []
    assert all(d == [] for d in cluster.decisions)


def test_one_off_spikes_are_not_stragglers() -> None:
    spikes = {(1, 60): 4.0, (2, 90): 2.5, (2, 91): 1.4, (0, 150): 10.0, (3, 200): 3.0}
    cluster = Cluster(4, StragglerConfig())
    cluster.run(260, jitter_cost(5, spikes=spikes))
    assert cluster.verdicts == []


def test_every_rank_takes_the_same_decisions_and_stop_reaches_all() -> None:
    cluster = Cluster(4, StragglerConfig(levels=STOP_LADDER))
    cluster.run(120, jitter_cost(3, slow_rank=2, factor=1.5, onset=50))
    per_rank = [[(s, d.to_dict()) for s, d in decisions] for decisions in cluster.decisions]
    assert all(p == per_rank[0] for p in per_rank)
    actions = [(s, d.action) for s, d in cluster.decisions[0]]
    assert [a for _, a in actions] == [Action.LOG, Action.ALERT, Action.CHECKPOINT_AND_STOP]
    stop_step = actions[-1][0]
    assert 50 + 5 <= stop_step <= 50 + 4 + 6
    assert all(det.should_stop for det in cluster.detectors)
    assert {det.stop_decision.step for det in cluster.detectors if det.stop_decision} == {stop_step}


def test_user_section_names_the_rank_when_the_step_is_equalised() -> None:
    """Under data parallelism whole-step times are equal; the compute section (no collective) differs."""
    cfg = StragglerConfig(sections=["step", "forward"])
    cluster = Cluster(3, cfg)
    base = jitter_cost(8, slow_rank=0, factor=1.3, onset=40)

    def cost(rank: int, step: int) -> float:
        return base(rank, step)

    cluster.run(60, cost, section="forward")
    sections = {v.section for v in cluster.verdicts}
    assert "forward" in sections and all(v.rank == 0 for v in cluster.verdicts)


def test_an_exclude_level_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"straggler\.levels\.action"):
        StragglerLevelConfig(action="exclude", slowdown=1.2, persist_steps=3)


def test_gather_cadence_limits_exchanges_and_still_detects() -> None:
    cluster = Cluster(4, StragglerConfig(warmup_steps=2), gather_every=4)
    cluster.run(42, jitter_cost(6))
    assert cluster.detectors[0].gathers == (42 - 2) // 4
    cluster.run(60, jitter_cost(7, slow_rank=3, factor=1.5, onset=42))
    (v,) = cluster.verdicts
    assert v.rank == 3 and 42 <= v.step <= 42 + 6


def test_a_cadence_delays_the_decisions_but_scores_every_step_alike() -> None:
    """Exchanging every 10 steps carries each step's timings: the same verdicts at the same steps as exchanging
    every step, reported at most one cadence later."""
    runs = {}
    for every in (1, 10):
        cluster = Cluster(4, StragglerConfig(levels=STOP_LADDER), gather_every=every)
        cluster.run(120, jitter_cost(3, slow_rank=2, factor=1.5, onset=50))
        runs[every] = cluster
    assert [v.to_dict() for v in runs[10].verdicts] == [v.to_dict() for v in runs[1].verdicts]
    each, batched = runs[1].decisions[0], runs[10].decisions[0]
    assert [d.to_dict() for _, d in batched] == [d.to_dict() for _, d in each]
    for (reported, _), (decided, _) in zip(batched, each):
        assert decided <= reported < decided + 10


def test_single_rank_uses_its_own_history() -> None:
    clock = FakeClock()
    det = StragglerDetector(StragglerConfig(warmup_steps=0, levels=STOP_LADDER), clock=clock)
    assert det.mode == "individual"
    cost = jitter_cost(9, slow_rank=0, factor=1.5, onset=80)
    for step in range(120):
        det.start_step()
        clock.advance(cost(0, step))
        det.end_step(step)
        if det.should_stop:
            break
    assert det.verdicts and det.verdicts[0].score == "individual" and det.verdicts[0].step >= 80
    assert det.should_stop


def test_report_is_json_and_summary_names_the_straggler() -> None:
    cluster = Cluster(4, StragglerConfig(levels=STOP_LADDER))
    cluster.run(100, jitter_cost(3, slow_rank=1, factor=1.6, onset=50))
    det = cluster.detectors[0]
    report = json.loads(json.dumps(det.report()))
    assert report["verdicts"][0]["rank"] == 1 and report["should_stop"] is True
    assert report["sections"]["compute"]["relative_max"][1] > 1.4
    assert all(math.isfinite(v) for v in report["step_time_median_s"])
    summary = det.summary()
    assert "rank 1 (node 0, node0) is" in summary and "STOP" in summary
    # the slowest rank is listed first
    assert summary.splitlines()[2].split()[0] == "1"


def test_gather_failure_is_a_named_error() -> None:
    def broken(payload: dict) -> list:
        raise RuntimeError("connection reset by peer")

    config = StragglerConfig(warmup_steps=0, gather_every_n_steps=1)
    det = StragglerDetector(config, rank=0, world_size=2, gather=broken, clock=FakeClock())
    det.start_step()
    with pytest.raises(StragglerGatherError, match="a rank is hung, gone"):
        det.end_step(0)
    with pytest.raises(ValueError, match="gather function or a tree is required"):
        StragglerDetector(world_size=2, rank=0)


def test_plot_is_skipped_cleanly_without_matplotlib(tmp_path: Path) -> None:
    cluster = Cluster(2, StragglerConfig())
    cluster.run(20, jitter_cost(1))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert cluster.detectors[0].plot(tmp_path / "p.png") is None
        assert not (tmp_path / "p.png").exists()
    else:
        out = cluster.detectors[0].plot(tmp_path / "p.png")
        assert out is not None and out.stat().st_size > 0


def test_data_slow_rank_is_named_in_data_while_every_step_is_equalised() -> None:
    cluster = Cluster(4, StragglerConfig())

    def data(rank: int, step: int) -> float:
        return 0.001 + (0.05 if rank == 3 and step >= 60 else 0.0)  # half a compute step more: 1.5x its work

    cluster.run(80, jitter_cost(12), data=data)
    (v,) = cluster.verdicts
    assert (v.rank, v.section, v.scope) == (3, "data", "rank") and 60 <= v.step <= 64
    assert 1.3 <= v.slowdown <= 1.7
    last = cluster.detectors[0].history[-1][1]
    periods = [s + d for s, d in zip(last["step"], last["data"])]
    assert max(periods) / min(periods) < 1.01  # the collective made every rank's step period equal


def test_job_wide_slowdown_is_one_job_verdict_and_no_rank_is_blamed() -> None:
    cluster = Cluster(4, StragglerConfig())
    cost = jitter_cost(13)
    cluster.run(120, lambda rank, step: cost(rank, step) * (1.5 if step >= 80 else 1.0))
    (v,) = cluster.verdicts
    assert (v.scope, v.rank, v.section, v.score) == ("job", -1, "work", "individual")
    assert 80 <= v.step <= 85 and 1.3 <= v.slowdown <= 1.7
    assert "the whole job is" in v.describe()
    actions = {d.action for _, d in cluster.decisions[0]}
    assert actions <= {Action.LOG, Action.ALERT}  # no rank to exclude or restart without


def test_noise_level_confirmation_is_listed_but_never_acted_on() -> None:
    loud = Cluster(2, StragglerConfig(noise_level=100.0))  # nothing can stand out of the jitter
    loud.run(90, jitter_cost(4, slow_rank=1, factor=1.5, onset=50))
    det = loud.detectors[0]
    assert det.verdicts == [] and det.decisions == [] and det.active == []
    assert [(v.rank, v.section) for v in det.noise_level] == [(1, "compute")]
    assert "noise-level confirmation(s), not verdicts" in det.summary()
    assert det.report()["noise_level"][0]["rank"] == 1 and det.report()["verdicts"] == []
    quiet = Cluster(2, StragglerConfig())  # the same run with the default: a verdict, nothing noise-level
    quiet.run(90, jitter_cost(4, slow_rank=1, factor=1.5, onset=50))
    assert [(v.rank, v.section) for v in quiet.verdicts] == [(1, "compute")] and quiet.detectors[0].noise_level == []


def test_clean_run_with_heavy_jitter_has_no_verdict() -> None:
    cluster = Cluster(2, StragglerConfig())
    cluster.run(2000, jitter_cost(21, sigma=0.15, common_sigma=0.1))
    assert cluster.verdicts == [], [v.describe() for v in cluster.verdicts]


def test_a_payload_travels_as_a_binary_head_a_node_s_text_and_packed_timings() -> None:
    """What every rank sends up the tree each exchange (rank 0 receives N of them): the real payload of a detector,
    read back as it was, and small (its timings packed, not written out as JSON)."""
    clock = FakeClock()
    config = StragglerConfig(warmup_steps=1, gather_every_n_steps=10)
    detector = StragglerDetector(config, rank=0, world_size=2, gather=lambda p: [p], clock=clock, hostname="node0")
    payload = None
    for step in range(11):
        detector.start_step()
        with detector.section("forward"):
            clock.advance(0.05)
        detector.timer.end_step()
        payload = detector.prepare(step) or payload  # end_step's first half: the payload at its cadence
    assert payload is not None and len(payload["times"]) == 10
    body = encode_payload(payload)
    back = decode_payload(body)
    assert back["rank"] == 0 and back["steps"] == payload["steps"] and back["host"] == payload["host"]
    for got, sent in zip(back["times"], payload["times"]):
        assert got.keys() == sent.keys()
        # seconds travel as float32: a microsecond in a 10 s step
        assert all(
            g == float(np.float32(s)) or (math.isnan(g) and math.isnan(s)) for g, s in zip(got.values(), sent.values())
        )
    as_json = len(json.dumps(payload, separators=(",", ":")))
    assert len(body) < 0.5 * as_json, (len(body), as_json)
    for bad in (b"", b"{}", body[:-3], b"LRT1" + body[4:12] + b"not json"):
        with pytest.raises(StragglerGatherError, match="malformed payload"):
            decode_payload(bad)
    other = encode_payload(payload | {"rank": 1})
    blobs = [frame([(1, other)]), frame([(0, body)])]  # as the tree brings them: rank 0's scorer reads them
    assert decode_gathered(blobs).ranks == [0, 1]
    with pytest.raises(StragglerGatherError, match="arrived malformed"):
        decode_gathered([blobs[0][:-1]])


def test_an_exchange_is_read_into_one_table_and_a_large_job_keeps_a_bounded_history() -> None:
    """Rank 0's scorer reads N records into one ranks x samples x sections array (one JSON text a node), the same
    values the payloads hold (seconds as float32); the history of samples kept for the plot is bounded in values,
    not only in steps, so 16,384 ranks do not keep 20,000 x 65,536 floats."""
    from lightning_resilience.straggler.exchange import table_of
    from lightning_resilience.straggler.scores import nanmedian

    payloads = [
        {
            "rank": r,
            "host": f"n{r // 2}",
            "local_world_size": 2,
            "steps": [7, 8, 9],
            "times": [{"compute": 0.1 * (r + 1) + s, "data": 0.01 * s} for s in range(3)],
        }
        for r in range(4)
    ]
    blobs = [frame([(r, encode_payload(p))]) for r, p in reversed(list(enumerate(payloads)))]
    table = decode_gathered(blobs)
    assert table.ranks == [0, 1, 2, 3] and table.steps == [7, 8, 9] and table.sections == ("compute", "data")
    assert table.hosts == ["n0", "n0", "n1", "n1"] and table.times.shape == (4, 3, 2)
    expected = table_of(payloads).times.astype(np.float32).astype(np.float64)
    assert np.array_equal(table.times, expected)
    # a blob of records of one layout is read as one array; hosts of other lengths record by record: the same table
    uniform = decode_gathered([frame([(r, encode_payload(p)) for r, p in enumerate(payloads)])])
    mixed = [p | {"host": "h" * (r + 1)} for r, p in enumerate(payloads)]
    varied = decode_gathered([frame([(r, encode_payload(p)) for r, p in enumerate(mixed)])])
    for other in (uniform, varied):
        assert other.ranks == table.ranks and other.steps == table.steps and other.sections == table.sections
        assert np.array_equal(other.times, table.times)
    assert uniform.hosts == table.hosts and varied.hosts == ["h", "hh", "hhh", "hhhh"]
    column = table.column(1, "data")
    assert column is not None and np.array_equal(column, expected[:, 1, 1]) and table.column(0, "wait") is None
    config = StragglerConfig()
    small = StragglerDetector(config, rank=0, world_size=2, gather=lambda p: [p])
    large = StragglerDetector(config, rank=0, world_size=16_384, gather=lambda p: [p])
    assert small.history.maxlen == 20_000 and large.history.maxlen == 64
    values = np.array([[1.0, np.nan, 3.0], [np.nan, np.nan, 5.0], [2.0, np.nan, 4.0], [4.0, np.nan, np.nan]])
    assert np.array_equal(nanmedian(values, 0), [2.0, np.nan, 4.0], equal_nan=True)


def test_the_payloads_texts_are_read_once_per_run_and_a_malformed_one_is_still_named() -> None:
    """A rank's JSON text (host, sections) is the same at every exchange: the scorer parses each once (16,384 ranks
    on 2,048 hosts cost about 90 ms an exchange to parse again), and the tables are the same with and without the
    texts kept. A text that is not a payload's is refused whether or not others were kept."""
    from lightning_resilience.straggler import exchange

    def blobs(first: int) -> list[bytes]:
        payloads = [
            {"rank": r, "host": f"n{r // 2}", "local_world_size": 2, "steps": [first, first + 1],
             "times": [{"compute": 0.1 + 0.01 * r + s, "data": 0.01 * s} for s in range(2)]}
            for r in range(6)
        ]  # fmt: skip
        return [frame([(r, encode_payload(p)) for r, p in enumerate(payloads)])]

    kept: dict[bytes, tuple[str, tuple[str, ...]]] = {}
    parsed: list[bytes] = []
    real_loads = json.loads

    def counting(text: bytes) -> object:
        parsed.append(text)
        return real_loads(text)

    with patch.object(exchange.json, "loads", counting):
        for first in (10, 20, 30):
            fresh = decode_gathered(blobs(first))
            again = decode_gathered(blobs(first), kept)
            assert fresh.hosts == again.hosts and fresh.steps == again.steps == [first, first + 1]
            assert np.array_equal(fresh.times, again.times)
    assert len(kept) == 3 and len(parsed) == 3 * 3 + 3  # 3 hosts: every fresh decode parses them, the kept ones once
    bad = encode_payload({"rank": 0, "host": "n0", "local_world_size": 2, "steps": [1], "times": [{"compute": 0.1}]})
    at = bad.index(b'"sections"')
    broken = bad[:at] + b'"sectionz"' + bad[at + len(b'"sections"') :]
    with pytest.raises(StragglerGatherError, match="malformed"):
        decode_gathered([frame([(0, broken)])], kept)


def test_an_ordinary_step_end_reads_no_timings_and_the_exchange_carries_each_steps_own() -> None:
    clock = FakeClock()
    sent: list[dict] = []
    det = StragglerDetector(
        StragglerConfig(warmup_steps=2, gather_every_n_steps=4), rank=0, world_size=2, clock=clock,
        gather=lambda p: sent.append(p) or [p, {**p, "rank": 1}],
    )  # fmt: skip
    for step in range(100, 110):
        det.start_step()
        clock.advance(0.01 * (step - 99))
        det.end_step(step)
    # the warm-up's two steps are dropped; then every 4 steps, the 4 steps since, each with its own step and time
    assert [p["steps"] for p in sent] == [[102, 103, 104, 105], [106, 107, 108, 109]]
    assert [round(t["step"], 6) for t in sent[0]["times"]] == [0.03, 0.04, 0.05, 0.06]
    det.start_step()
    clock.advance(0.5)
    det.end_step(110)
    assert det.timer.collect() and len(sent) == 2  # an ordinary step leaves its timings in the timer
