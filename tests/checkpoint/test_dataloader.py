"""ResumableDataLoader: a resumed loader yields exactly the rest of the interrupted epoch and adds no RNG draw."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from lightning.fabric.utilities.types import _Stateful
from torch.utils.data import DataLoader, Dataset

from lightning_resilience.checkpoint.dataloader import ResumableDataLoader
from lightning_resilience.checkpoint.tree import flatten_state, unflatten_state

pytestmark = pytest.mark.timeout(60)

N, BATCH = 20, 3  # 7 batches, the last one short


class _Indices(Dataset[int]):
    """Deterministic items: a batch is the list of sample indices, so an order difference is visible."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> int:
        return idx


class _Augmented(Dataset[tuple[int, float]]):
    """Items that draw from the global torch RNG (random augmentation), in the main process or a worker."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> tuple[int, float]:
        return idx, float(torch.rand(()))


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


def _as_lists(batches: list[Any]) -> list[Any]:
    out = []
    for batch in batches:
        if isinstance(batch, torch.Tensor):
            out.append(batch.tolist())
        else:  # (indices, values) from _Augmented
            out.append([b.tolist() for b in batch])
    return out


def _through_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint gives back: the tree codec, strict JSON and fresh tensors."""
    flat = flatten_state(state)
    skeleton = json.loads(json.dumps(flat.skeleton, allow_nan=False))
    return unflatten_state(skeleton, {n: t.clone() for n, t in flat.tensors.items()})


def _scramble_global_rng() -> None:
    torch.manual_seed(987654)
    torch.rand(13)


@pytest.mark.parametrize("consumed", [1, 3, 6])
def test_resume_yields_exactly_the_remaining_batches(consumed: int) -> None:
    """After k batches, a NEW loader loaded with state_dict yields the original epoch's remaining batches."""
    torch.manual_seed(2024)
    original = ResumableDataLoader(_Indices(), batch_size=BATCH, shuffle=True)
    it = iter(original)
    head = [next(it) for _ in range(consumed)]
    state = _through_checkpoint(original.state_dict())
    assert state["position"] == consumed
    rest = list(it)
    assert len(head) + len(rest) == len(original) == 7
    assert sorted(i for b in _as_lists(head + rest) for i in b) == list(range(N))  # a real shuffled epoch

    _scramble_global_rng()
    resumed = ResumableDataLoader(_Indices(), batch_size=BATCH, shuffle=True)
    resumed.load_state_dict(state)
    before = torch.get_rng_state()
    resumed_it = iter(resumed)
    assert torch.equal(torch.get_rng_state(), before), "resuming drew from (or changed) the global RNG"
    got = list(resumed_it)
    assert torch.equal(torch.get_rng_state(), before)
    assert _as_lists(got) == _as_lists(rest)
    # the resumed loader keeps counting from where the original stopped
    assert resumed.state_dict()["position"] == len(resumed)


def test_resumed_state_dict_can_be_resumed_again() -> None:
    """A state_dict taken from a resumed loader mid-epoch resumes the same original epoch once more."""
    torch.manual_seed(11)
    original = ResumableDataLoader(_Indices(), batch_size=BATCH, shuffle=True)
    full = _as_lists(list(original))

    # replay the epoch start to cut it after 2 batches, as an interrupted run would
    torch.manual_seed(11)
    first = ResumableDataLoader(_Indices(), batch_size=BATCH, shuffle=True)
    it = iter(first)
    next(it), next(it)
    state_2 = _through_checkpoint(first.state_dict())

    _scramble_global_rng()
    second = ResumableDataLoader(_Indices(), batch_size=BATCH, shuffle=True)
    second.load_state_dict(state_2)
    it2 = iter(second)
    assert _as_lists([next(it2), next(it2)]) == full[2:4]
    state_4 = _through_checkpoint(second.state_dict())
    assert state_4["position"] == 4

    _scramble_global_rng()
    third = ResumableDataLoader(_Indices(), batch_size=BATCH, shuffle=True)
    third.load_state_dict(state_4)
    assert _as_lists(list(third)) == full[4:]


def test_main_process_augmentation_is_exact_when_rng_is_restored_too() -> None:
    """With dataset-side randomness, restoring the captured global RNG plus the loader state repeats every value."""
    torch.manual_seed(5)
    original = ResumableDataLoader(_Augmented(10), batch_size=2, shuffle=True)
    it = iter(original)
    next(it), next(it)
    state = _through_checkpoint(original.state_dict())
    rng_at_save = torch.get_rng_state()  # what the checkpoint's RNG capture holds
    rest = _as_lists(list(it))

    _scramble_global_rng()
    resumed = ResumableDataLoader(_Augmented(10), batch_size=2, shuffle=True)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng_at_save)  # Lightning restores the RNG states of the checkpoint
    assert _as_lists(list(resumed)) == rest


def test_fresh_epoch_matches_plain_dataloader() -> None:
    """An epoch that does not resume (first, after a completed one, or after a resumed one) equals DataLoader's."""

    def plain(seed: int) -> tuple[list[Any], torch.Tensor]:
        torch.manual_seed(seed)
        batches = _as_lists(list(DataLoader(_Indices(), batch_size=BATCH, shuffle=True)))
        return batches, torch.get_rng_state()

    loader = ResumableDataLoader(_Indices(), batch_size=BATCH, shuffle=True)
    for seed in (1, 2):
        torch.manual_seed(seed)
        got = _as_lists(list(loader))
        rng_after = torch.get_rng_state()
        want, want_rng = plain(seed)
        assert got == want
        assert torch.equal(rng_after, want_rng), "a fresh epoch must draw exactly like DataLoader"

    # interrupted epoch, resumed to its end, then a fresh epoch
    torch.manual_seed(3)
    interrupted = ResumableDataLoader(_Indices(), batch_size=BATCH, shuffle=True)
    it = iter(interrupted)
    next(it)
    state = interrupted.state_dict()
    resumed = ResumableDataLoader(_Indices(), batch_size=BATCH, shuffle=True)
    resumed.load_state_dict(state)
    assert len(list(resumed)) == len(resumed) - 1
    torch.manual_seed(4)
    got = _as_lists(list(resumed))
    rng_after = torch.get_rng_state()
    want, want_rng = plain(4)
    assert got == want
    assert torch.equal(rng_after, want_rng), "a fresh epoch must draw exactly like DataLoader"


@pytest.mark.parametrize("saved", ["end_of_epoch", "never_iterated"])
def test_state_without_an_open_epoch_starts_fresh(saved: str) -> None:
    """A state saved at the end of an epoch, or before any iteration, makes the next iter() a plain fresh epoch."""
    source = ResumableDataLoader(_Indices(), batch_size=BATCH, shuffle=True)
    if saved == "end_of_epoch":
        torch.manual_seed(8)
        list(source)
        assert source.state_dict()["position"] == len(source)
    else:
        assert source.state_dict()["position"] == 0 and source.state_dict()["epoch"] is None
    state = _through_checkpoint(source.state_dict())

    loader = ResumableDataLoader(_Indices(), batch_size=BATCH, shuffle=True)
    loader.load_state_dict(state)
    torch.manual_seed(9)
    got = _as_lists(list(loader))
    torch.manual_seed(9)
    assert got == _as_lists(list(DataLoader(_Indices(), batch_size=BATCH, shuffle=True)))


def test_resume_with_two_workers_is_exact() -> None:
    """With num_workers=2 the remaining batches, including worker-side random values, are identical."""
    kwargs: dict[str, Any] = {"batch_size": 2, "shuffle": True, "num_workers": 2}
    torch.manual_seed(31)
    original = ResumableDataLoader(_Augmented(12), **kwargs)
    it = iter(original)
    head = [next(it), next(it)]
    state = _through_checkpoint(original.state_dict())
    rest = _as_lists(list(it))
    assert len(head) + len(rest) == 6

    _scramble_global_rng()
    resumed = ResumableDataLoader(_Augmented(12), **kwargs)
    resumed.load_state_dict(state)
    before = torch.get_rng_state()
    got_it = iter(resumed)
    assert torch.equal(torch.get_rng_state(), before)
    assert _as_lists(list(got_it)) == rest


def test_is_a_lightning_stateful() -> None:
    """Lightning recognises the loader as stateful, so its fit loop saves and restores the position."""
    loader = ResumableDataLoader(_Indices(), batch_size=BATCH, shuffle=True)
    assert isinstance(loader, _Stateful)
    assert isinstance(loader, DataLoader)
    state = loader.state_dict()
    assert state["position"] == 0
    json.dumps(flatten_state(state).skeleton, allow_nan=False)  # storable by the checkpoint codec


@pytest.mark.parametrize(("old", "new", "consumed"), [(4, 2, 3), (2, 4, 4), (2, 3, 3)])
def test_elastic_restart_continues_after_the_consumed_samples(old: int, new: int, consumed: int) -> None:
    """N ranks consume k batches each; M ranks resumed from one rank's state cover the rest of the epoch, and
    together with what was consumed every sample is seen once (up to N/M batches twice when M does not divide)."""
    from torch.utils.data.distributed import DistributedSampler

    data = list(range(48))

    def loader(world: int, rank: int) -> ResumableDataLoader:
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)  # type: ignore[arg-type]
        return ResumableDataLoader(data, batch_size=2, sampler=sampler)  # type: ignore[arg-type]

    seen: list[int] = []
    states = []
    for rank in range(old):
        dl = loader(old, rank)
        it = iter(dl)
        for _ in range(consumed):
            seen += next(it).tolist()
        states.append(dl.state_dict())
    assert states[0]["replicas"] == old
    rest: list[int] = []
    for rank in range(new):
        dl = loader(new, rank)
        dl.load_state_dict(states[rank % old])
        rest += [x for batch in dl for x in batch.tolist()]
    overlap = set(seen) & set(rest)
    assert set(seen) | set(rest) == set(data)  # nothing of the epoch is lost
    assert len(overlap) <= -(-old // new) * 2 * new  # at most ceil(N/M) batches per new rank seen again
    if (consumed * old) % new == 0:
        assert overlap == set() and len(rest) == len(data) - len(seen)


class _Counting(Dataset[int]):
    """Counts the items fetched in this process (num_workers=0): a skipped batch must not be fetched."""

    def __init__(self, n: int) -> None:
        self.n, self.fetched = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, idx: int) -> int:
        self.fetched += 1
        return idx


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_skips_at_index_level(drop_last: bool) -> None:
    """Resuming at batch k fetches nothing of the k batches before it, with any drop_last."""
    torch.manual_seed(4)
    original = ResumableDataLoader(_Counting(103), batch_size=5, shuffle=True, drop_last=drop_last)
    it = iter(original)
    for _ in range(13):
        next(it)
    state = _through_checkpoint(original.state_dict())
    rest = _as_lists(list(it))

    dataset = _Counting(103)
    resumed = ResumableDataLoader(dataset, batch_size=5, shuffle=True, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert _as_lists(list(resumed)) == rest
    assert dataset.fetched == sum(len(b) for b in rest)  # only what was handed out


def test_plain_dataloader_cursor_resumes_with_a_custom_batch_sampler() -> None:
    """A LoaderCursor takes over any DataLoader, here one with a user batch sampler, and gives it back."""
    from torch.utils.data import BatchSampler, RandomSampler

    from lightning_resilience.checkpoint.dataloader import LoaderCursor

    def loader() -> tuple[DataLoader, LoaderCursor]:
        dl = DataLoader(_Indices(), batch_sampler=BatchSampler(RandomSampler(range(N)), 3, drop_last=False))
        return dl, LoaderCursor(dl)

    torch.manual_seed(12)
    dl, cursor = loader()
    it = iter(dl)
    next(it), next(it), next(it)
    state = _through_checkpoint(cursor.state_dict(consumed=3))
    rest = _as_lists(list(it))

    _scramble_global_rng()
    dl2, cursor2 = loader()
    assert cursor2.load_state_dict(state)
    assert _as_lists(list(dl2)) == rest
    original = cursor2.sampler.inner
    cursor2.detach()
    assert dl2.batch_sampler is original


def test_worker_randomness_resumes_exactly_across_epochs_with_persistent_workers() -> None:
    """Worker-side random augmentation (num_workers=2, persistent) is exact when resuming in a later epoch.

    Replaying the skipped batches cannot do this: the persistent workers of the uninterrupted run carry their RNG
    from the earlier epochs; per-batch worker seeds make every batch's draws independent of the worker history.
    """
    kwargs: dict[str, Any] = {"batch_size": 2, "shuffle": True, "num_workers": 2, "persistent_workers": True}
    torch.manual_seed(77)
    original = ResumableDataLoader(_Augmented(12), **kwargs)
    first_epoch = _as_lists(list(original))
    it = iter(original)
    next(it), next(it)
    state = _through_checkpoint(original.state_dict())
    rng_at_save = torch.get_rng_state()
    rest = _as_lists(list(it))
    assert len(rest) == 4 and rest[0] not in first_epoch

    _scramble_global_rng()
    resumed = ResumableDataLoader(_Augmented(12), **kwargs)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng_at_save)
    assert _as_lists(list(resumed)) == rest


def test_worker_randomness_does_not_depend_on_the_number_of_workers() -> None:
    """Each batch's worker seed comes from its position, not from the worker that happens to fetch it."""

    def epoch(workers: int) -> list[Any]:
        torch.manual_seed(5)
        return _as_lists(list(ResumableDataLoader(_Augmented(12), batch_size=2, shuffle=True, num_workers=workers)))

    assert epoch(1) == epoch(2)


def test_cursor_replays_a_stateful_loader_whose_sampler_lightning_wrapped() -> None:
    """torchdata's ``StatefulDataLoader(shuffle=True)`` under DDP: Lightning wraps torchdata's own ``RandomSampler``
    (not torch's) in a ``DistributedSamplerWrapper``; its generator, found behind the wrapper, is put back to replay
    the order of an epoch that is not the first."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    from lightning_resilience.checkpoint.dataloader import LoaderCursor

    def loader() -> tuple[Any, LoaderCursor]:
        torch.manual_seed(4)  # torchdata's sampler seeds its generator from the global one when built
        inner = stateful.StatefulDataLoader(_Indices(), shuffle=True).sampler
        wrapped = DistributedSamplerWrapper(inner, num_replicas=2, rank=1, shuffle=False)
        dl = stateful.StatefulDataLoader(_Indices(), batch_size=3, sampler=wrapped)
        return dl, LoaderCursor(dl)

    dl, cursor = loader()
    list(dl)  # the first epoch moves the sampler's generator on
    it = iter(dl)
    next(it), next(it)
    state = _through_checkpoint(cursor.state_dict(consumed=2))
    rest = _as_lists(list(it))

    _scramble_global_rng()
    dl2, cursor2 = loader()  # a new process: the sampler's generator is where it was before the first epoch
    assert cursor2.load_state_dict(state)
    assert _as_lists(list(dl2)) == rest
