"""SDC engine pieces on plain torch: digests, guards, votes, bit flips, and the single-process monitor."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_resilience.sdc.config import SDCConfig
from lightning_resilience.sdc.fingerprint import BitwiseDigest, ToleranceDigest, digest_all, group_rows
from lightning_resilience.sdc.guards import Guards
from lightning_resilience.sdc.inject import BIT_CLASSES, LOCATIONS, FlipSpec, bit_positions, flip_bit_
from lightning_resilience.sdc.localize import Opinion, next_device, vote
from lightning_resilience.sdc.monitor import SDCMonitor
from lightning_resilience.sdc.verdict import Diagnosis, VerifiedSteps
from tests.sdc._loop import batches, make_model, train

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_bitwise_digest_sees_every_single_bit_flip(dtype: torch.dtype) -> None:
    t = torch.randn(37, generator=torch.Generator().manual_seed(0)).to(dtype)
    d, base = BitwiseDigest(), BitwiseDigest().compute(t)
    for bit in range(t.element_size() * 8):
        flipped = t.clone()
        flip_bit_(flipped, 5, bit)
        assert not d.equal(d.compute(flipped), base), f"bit {bit} of {dtype} not seen"
        flip_bit_(flipped, 5, bit)
        assert d.equal(d.compute(flipped), base)  # flipping back restores the digest


def test_digests_are_additive_over_buckets() -> None:
    tensors = [torch.randn(5), torch.randn(3, 2), torch.randn(4)]
    for d in (BitwiseDigest(), ToleranceDigest()):
        rows = digest_all(d, tensors)
        flat = d.compute(torch.cat([t.reshape(-1) for t in tensors]))
        assert d.equal(group_rows(d, rows, [[0, 1, 2]])[0], flat) or isinstance(d, BitwiseDigest)


@pytest.mark.parametrize("batch_elements", [1 << 22, 1000])
def test_digests_of_many_tensors_together_are_each_tensors_own(
    batch_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small tensors are digested together, padded to whole rows; every digest is the bits of the tensor's own, for
    every dtype and width, partial and whole rows, 0-d, empty, missing, strided and wrapping tensors, in batches
    that fill up (1,000 elements) and with tensors too large for one (digested alone)."""
    import lightning_resilience.sdc.fingerprint as fingerprint

    monkeypatch.setattr(fingerprint, "BATCH_ELEMENTS", batch_elements)
    g = torch.Generator().manual_seed(0)
    tensors: list[torch.Tensor | None] = [None, torch.tensor(3.5), torch.randn(40, 30, generator=g).t()]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8):
        for n in (0, 1, 255, 256, 257, 1000, 5000):
            tensors.append((torch.randn(n, generator=g) * 1e6).to(dtype))
    tensors += [torch.randn(300, generator=g) > 0, torch.complex(torch.randn(300), torch.randn(300))]
    tensors.append(torch.randint(-(2**62), 2**62, (3000,), generator=g))  # the sums wrap around
    # 4-byte elements at the ends of their range: the widest row sums a batch of narrow elements can hold
    tensors += [torch.full((1024,), -(2**31), dtype=torch.int32), torch.full((700,), 2**31 - 1, dtype=torch.int32)]
    tensors.append(torch.randint(-(2**31), 2**31, (3000,), dtype=torch.int32, generator=g))
    order = torch.randperm(len(tensors), generator=g).tolist()
    tensors = [tensors[i] for i in order]
    d = BitwiseDigest()
    expected = torch.stack([d.compute(t) for t in tensors])
    assert torch.equal(d.compute_many(tensors), expected)
    assert torch.equal(digest_all(d, tensors), expected)


def test_norms_are_the_bits_of_get_total_norm() -> None:
    """The guards' norms in three operations are ``torch.nn.utils.get_total_norm``'s bits: one dtype, and mixed dtypes
    (its own path); parameters are not detached one by one (nothing is recorded either way)."""
    from lightning_resilience.sdc.guards import grad_norm, param_norm

    model, _ = make_model()
    params = list(model.parameters())
    model.compute_loss(batches(0, 1)[0]).backward()
    grads = [p.grad for p in params if p.grad is not None]
    assert torch.equal(grad_norm(params), torch.nn.utils.get_total_norm(grads, 2.0))
    assert torch.equal(param_norm(params), torch.nn.utils.get_total_norm([p.detach() for p in params], 2.0))
    assert not param_norm(params).requires_grad
    mixed = [torch.randn(10), torch.randn(7, dtype=torch.float64), torch.randn(3, dtype=torch.bfloat16)]
    assert torch.equal(param_norm(mixed), torch.nn.utils.get_total_norm(mixed, 2.0))


def test_robust_baseline_keeps_the_median_and_mad_of_its_window() -> None:
    """The window is kept in order as values come and go: every z-score is the one of the window's median and MAD
    taken afresh (repeated values, non-finite values refused, the window full and evicting)."""
    from lightning_resilience.sdc.guards import RobustBaseline

    def naive(window: list[float], value: float) -> float:
        ordered = sorted(window)
        n = len(ordered)
        med = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
        dev = sorted(abs(v - med) for v in window)
        mad = dev[n // 2] if n % 2 else 0.5 * (dev[n // 2 - 1] + dev[n // 2])
        return abs(value - med) / max(1.4826 * mad, 1e-3 * abs(med), 1e-12)

    g = torch.Generator().manual_seed(1)
    values = (torch.randn(400, generator=g) * 3).round(decimals=1).tolist() + [float("nan"), float("inf")] * 3
    baseline, window = RobustBaseline(window=16, min_history=4), []
    for i, v in enumerate(values[:400] + values[400:] + values[:50]):
        finite = math.isfinite(v)
        if len(window) >= 4 and finite:
            assert baseline.zscore(v) == naive(window, v), i
        baseline.add(v)
        window = [*window, v][-16:] if finite else window
    assert len(baseline) == 16


def test_tolerance_digest_ignores_rounding_noise_only() -> None:
    d = ToleranceDigest(rtol=1e-5)
    t = torch.randn(100, dtype=torch.float32)
    assert d.equal(d.compute(t), d.compute(t * (1 + 1e-7)))
    assert not d.equal(d.compute(t), d.compute(t * -1))


def test_bit_classes_map_to_the_right_bits() -> None:
    assert bit_positions(torch.float32, "sign") == [31]
    assert bit_positions(torch.float32, "exponent") == list(range(23, 31))
    assert bit_positions(torch.bfloat16, "exponent") == list(range(7, 15))
    x = torch.tensor([1.5])
    assert flip_bit_(x, 0, 31) == (1.5, -1.5)
    assert flip_bit_(x, 0, 30)[1] == pytest.approx(-1.5 * 2.0**128, rel=1e-6) or not torch.isfinite(x).all()
    with pytest.raises(ValueError, match="bit_class"):
        bit_positions(torch.float32, "mantissa")
    with pytest.raises(ValueError, match=r"inject\.location"):
        FlipSpec("buffer", step=0)  # type: ignore[arg-type]


def test_guards_fire_on_nonfinite_and_spikes_not_on_noise() -> None:
    g = Guards(window=32, min_history=8, threshold=8.0)
    gen = torch.Generator().manual_seed(0)
    for step in range(40):
        loss, gn = (
            3.0 - 0.01 * step + 0.02 * float(torch.randn(1, generator=gen)),
            1.0 + 0.05 * float(torch.rand(1, generator=gen)),
        )
        report = g.check(step, loss, gn, 100.0 + 0.01 * step)
        assert report.fired == [], report
        g.accept(report)
    assert g.check(41, float("nan"), 1.0).fired == ["nonfinite_loss"]
    assert g.check(41, 2.6, float("inf")).fired == ["nonfinite_grad"]
    assert g.check(41, 2.6, 1e6).fired == ["grad_norm_spike"]
    assert g.check(41, 50.0, 1.0).fired == ["loss_spike"]
    assert g.check(41, 2.6, 1.0, 1e9).fired == ["param_norm_jump"]


def test_a_spike_found_genuine_quiets_the_same_guard_for_quiet_steps() -> None:
    """After a replay found a gradient-norm spike genuine, that guard's spikes of the next ``quiet_steps`` steps ask
    for no replay (they are still reported and counted); a loss spike, a non-finite value and a spike after the quiet
    period still ask."""
    g = Guards(window=32, min_history=8, threshold=8.0, quiet_steps=5)
    for step in range(20):
        g.accept(g.check(step, 3.0 + 0.01 * (step % 3), 1.0 + 0.01 * (step % 3)))
    first = g.check(20, 3.0, 1e3)
    assert first.fired == ["grad_norm_spike"] and first.quiet == []
    g.genuine(first)
    again = g.check(25, 3.0, 1e3)
    assert again.fired == again.quiet == ["grad_norm_spike"]
    assert g.fired["grad_norm_spike"] == 2
    assert g.check(23, 50.0, float("inf")).quiet == []  # a loss spike and a non-finite gradient are not quieted
    assert g.check(26, 3.0, 1e3).quiet == []  # past the quiet period
    assert g.check(19, 3.0, 1e3).quiet == []  # before the genuine spike (a rollback went back)
    g.reset()  # baselines, counts and quiet periods are forgotten
    assert g.fired == {} and len(g.log_grad_norm) == 0 and g.check(25, 3.0, 1e3).fired == []
    none = Guards(window=32, min_history=8, threshold=8.0, quiet_steps=0)
    for step in range(20):
        none.accept(none.check(step, 3.0 + 0.01 * (step % 3), 1.0 + 0.01 * (step % 3)))
    none.genuine(none.check(20, 3.0, 1e3))
    assert none.check(21, 3.0, 1e3).quiet == []


def test_a_jump_a_reconciliation_found_clean_quiets_the_jump_guard_for_quiet_steps() -> None:
    """After a clean reconciliation at step 20 that a parameter-norm jump asked for, the jumps of steps 21 to 25 ask
    for none (still reported and counted); a jump past the quiet period or before step 20, a non-finite norm and
    a gradient-norm spike still ask."""
    g = Guards(window=32, min_history=8, threshold=8.0, quiet_steps=5)
    for step in range(20):
        g.accept(g.check(step, 3.0, 1.0 + 0.01 * (step % 3), 100.0 + 0.01 * step + 0.001 * (step % 2)))
    assert g.check(20, 3.0, 1.0, 200.0).fired == ["param_norm_jump"]
    g.reconciled(20)
    again = g.check(25, 3.0, 1e3, 200.0)
    assert again.fired == ["grad_norm_spike", "param_norm_jump"] and again.quiet == ["param_norm_jump"]
    assert g.fired["param_norm_jump"] == 2
    assert g.check(23, 3.0, 1.0, float("inf")).quiet == []
    assert g.check(26, 3.0, 1.0, 200.0).quiet == [] and g.check(19, 3.0, 1.0, 200.0).quiet == []


def _op(rank: int, kind: str, value: int) -> Opinion:
    return Opinion(rank, kind, torch.tensor([value]))


def test_vote_names_transient_persistent_and_ties() -> None:
    eq = BitwiseDigest().equal
    transient = vote([_op(1, "original", 9), _op(1, "replay", 1), _op(2, "replay", 1)], eq)
    assert transient.verdict is Diagnosis.TRANSIENT and transient.suspects == [1]
    # a device reproducing its own wrong answer counts once: a tie between two devices, then a third decides
    tie = [_op(1, "original", 9), _op(1, "replay", 9), _op(2, "replay", 1)]
    assert vote(tie, eq).verdict is Diagnosis.INCONCLUSIVE and vote(tie, eq).suspects == []  # nobody blamed
    assert next_device(1, tie, 3, others=True) == 0
    persistent = vote([*tie, _op(0, "replay", 1)], eq)
    assert persistent.verdict is Diagnosis.PERSISTENT and persistent.suspects == [1]
    # one device alone: opinions count (original glitched, two replays agree)
    single = vote([_op(0, "original", 9), _op(0, "replay", 1), _op(0, "replay", 1)], eq)
    assert single.verdict is Diagnosis.TRANSIENT and single.dissent == [0]
    assert vote([_op(0, "replica", 1), _op(1, "replica", 1), _op(2, "replica", 3)], eq).persistent == [2]


def test_config_names_the_bad_key() -> None:
    with pytest.raises(ValueError, match=r"sdc\.guard_window"):
        SDCConfig(guard_window=2)
    with pytest.raises(ValueError, match=r"sdc\.compare"):
        SDCConfig(compare="close")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sdc\.max_opinions"):
        SDCConfig(max_opinions=2)


def test_clean_loop_many_steps_no_false_positive() -> None:
    _, _, monitor = train(40, SDCConfig(replay_every_n_steps=1, param_norm_every_n_steps=1))
    assert monitor is not None and monitor.events == [] and monitor.stats.replays == 40
    assert list(monitor.verified_steps) == list(range(41))


@pytest.mark.parametrize("location", ["grad", "activation"])
@pytest.mark.parametrize("bit_class", BIT_CLASSES)
def test_single_process_flip_is_fixed_to_clean_weights(location: str, bit_class: str) -> None:
    reference, _, _ = train(8, None)
    plan = [FlipSpec(location, step=3, bit_class=bit_class, seed=5)]  # type: ignore[arg-type]
    final, _, monitor = train(8, SDCConfig(replay_every_n_steps=1), plan=plan)
    assert monitor is not None
    for k in reference:
        assert torch.equal(final[k], reference[k]), k
    # a flip either changed the gradients (then it was caught and fixed) or changed nothing at all
    assert [(e.verdict, e.action) for e in monitor.events] in ([(Diagnosis.TRANSIENT, "recomputed")], [])
    if location == "grad":
        assert monitor.events and monitor.events[0].suspects == [0]


def test_tolerance_mode_clean_and_exponent_flip() -> None:
    cfg = SDCConfig(replay_every_n_steps=1, compare="tolerance")
    _, _, clean = train(6, cfg)
    assert clean is not None and clean.events == []
    _, _, flipped = train(6, cfg, plan=[FlipSpec("grad", step=2, bit_class="exponent", bit=30)])
    assert flipped is not None and [e.verdict for e in flipped.events] == [Diagnosis.TRANSIENT]


def test_locations_constant_lists_every_target() -> None:
    assert set(LOCATIONS) == {"param", "grad", "optim", "activation"}


def test_same_bit_in_two_elements_gives_two_digests() -> None:
    # a vote between corrupted opinions must not mistake two different corruptions for agreement
    d = BitwiseDigest()
    t = torch.zeros(64)
    a, b = t.clone(), t.clone()
    flip_bit_(a, 3, 25)
    flip_bit_(b, 40, 25)
    assert not d.equal(d.compute(a), d.compute(b))
    t = torch.randn(64)
    a, b = t.clone(), t.clone()
    flip_bit_(a, 3, 30)
    flip_bit_(b, 40, 30)
    assert not d.equal(d.compute(a), d.compute(b))


def _single_process_steps(
    monitor: SDCMonitor, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, spike_at: int = -1
) -> None:
    """``steps`` steps of one process under ``monitor`` (set up and attached here); the loss scaled by 1e4 at
    ``spike_at`` (a genuine spike); no step asks for a rollback."""
    monitor.setup()
    monitor.attach(model.compute_loss)
    for step, batch in enumerate(batches(0, steps)):
        monitor.begin_step(step, batch)
        loss = model.compute_loss(batch) * (1e4 if step == spike_at else 1.0)
        monitor.observe_loss(loss)
        loss.backward()
        assert not monitor.before_optimizer_step().needs_rollback
        opt.step()
        opt.zero_grad(set_to_none=True)
        monitor.after_optimizer_step()


def test_guard_read_late_replays_the_next_step_and_keeps_the_update() -> None:
    # a genuine spike (the loss scaled at one step): its values reach the host one step later, that step is
    # replayed, the replay reproduces it, and training goes on (finite: no rollback)
    model, opt = make_model()
    monitor = SDCMonitor(list(model.named_parameters()), [opt], SDCConfig(replay_every_n_steps=0, guard_min_history=4))
    _single_process_steps(monitor, model, opt, 14, spike_at=9)
    assert monitor.stats.replay_rounds == 1 and not monitor.dirty
    [event] = monitor.events
    assert (event.step, event.verdict, event.action) == (11, Diagnosis.ANOMALY, "none")
    assert "loss_spike@10" in event.mechanism


@pytest.mark.parametrize("lag", [1, 0])
def test_the_rng_state_is_kept_only_for_steps_that_may_be_replayed(lag: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ordinary step keeps no RNG state (a copy of the generator a step, paid on the training thread): a step with a
    scheduled round does, and with no read lag every step does (its own guards may ask for its replay at once)."""
    import lightning_resilience.sdc.monitor as monitor_module

    kept: list[int] = []
    capture = monitor_module.capture_rng
    model, opt = make_model()
    monitor = SDCMonitor(list(model.named_parameters()), [opt], SDCConfig(replay_every_n_steps=5, guard_read_lag=lag))

    def counted() -> dict[str, torch.Tensor]:
        kept.append(monitor.stats.steps)  # steps done: the step that begins
        return capture()

    monkeypatch.setattr(monitor_module, "capture_rng", counted)
    _single_process_steps(monitor, model, opt, 12)
    assert monitor.stats.replay_rounds == 2 and monitor.events == []
    assert kept == ([4, 9] if lag else list(range(12)))


@pytest.mark.parametrize("exact", [True, False])
def test_reconciler_agrees_on_a_hash_only_with_an_exact_digest(exact: bool) -> None:
    from lightning_resilience.sdc.reconcile import ReplicaReconciler, digest_key

    model, opt = make_model()
    digest = BitwiseDigest() if exact else ToleranceDigest()
    rec = ReplicaReconciler(list(model.named_parameters()), [opt], digest)
    keys: list[int] = []
    gathers: list[int] = []

    def all_same(key: int) -> bool:
        keys.append(key)
        return True

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        gathers.append(1)
        return [t, t.clone(), t.clone()]

    ballot, differing = rec.reconcile(gather, all_same)
    assert ballot.decided and ballot.verdict is Diagnosis.CLEAN and differing == []
    assert (len(keys), len(gathers)) == ((1, 0) if exact else (0, 1))
    if exact:  # the key is a 62-bit hash of the digests: any flipped bit of the state moves it
        _, mine = rec.local()
        assert keys[0] == digest_key(mine) and 0 <= keys[0] < 2**62
        with torch.no_grad():
            flip_bit_(next(model.parameters()).data.view(-1), 0, 3)
        assert digest_key(rec.local()[1]) != keys[0]


def test_verified_steps_answer_a_step_from_their_order_and_a_rollback_forgets_the_later_ones() -> None:
    """What every snapshot asks (is this step verified, the newest, the newest few) is read from the steps kept in
    order, never by sorting or scanning the run's history; a rollback to a step forgets the later ones."""
    steps = VerifiedSteps()
    for step in (50, 100, 150, 75, 100):  # a check may cover a step out of order, or twice
        steps.add(step)
    assert list(steps) == [0, 50, 75, 100, 150] and steps.newest == 150 and len(steps) == 5
    assert steps.newest_few(2) == [100, 150] and 75 in steps and 80 not in steps
    steps.keep_until(90)  # rolled back to step 90: its state is the verified one now
    assert list(steps) == [0, 50, 75, 90] and steps.newest == 90 and 100 not in steps
    steps.add(120)
    assert steps.newest_few(64) == [0, 50, 75, 90, 120]
