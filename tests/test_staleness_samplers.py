"""``max_staleness`` on the gear samplers (``adapters/samplers/staleness.py``), checked against the fresh rows
listed by brute force: local, shared (commits of a TrajectoryWriter) and sharded (the consumer version travels
in each request to the owner)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import shared_workers as w
import torch
from helpers import one_rank_sharded_store
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import (
    CheckpointError,
    GearPrioritizedSampler,
    GearStorage,
    MaxTimesSampled,
    TopKSampler,
    TrajectoryWriter,
)
from gear_torchrl.selection.fresh import FreshSpec
from gear_torchrl.selection.priorities import PrioritySpec
from gear_torchrl.selection.rules import spec_from_json

CAPACITY = 64


def _rows(first: int, n: int, version: int) -> TensorDict:
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[-1] = True
    obs = torch.arange(first, first + n, dtype=torch.float32)
    return TensorDict({"obs": obs, "policy_version": torch.full((n,), version), ("next", "done"): done}, [n])


def _fill(write, versions: list[int], per_version: int = 10, ring: dict | None = None) -> dict[float, int]:
    """Rows of each version in ``versions``, after those of ``ring`` (ring row -> (obs, version), updated; a
    ring of CAPACITY rows laps): each live row's obs -> its version."""
    ring = {} if ring is None else ring
    first = max((obs for obs, _ in ring.values()), default=-1.0) + 1
    for version in versions:
        write(_rows(int(first), per_version, version))
        for i in range(per_version):
            ring[int(first + i) % CAPACITY] = (float(first + i), version)
        first += per_version
    return dict(ring.values())


def _fresh(live: dict[float, int], consumer: int, bound: int) -> set[float]:
    return {obs for obs, version in live.items() if consumer - version <= bound}


def _check_draws(rb: TensorDictReplayBuffer, sampler, live: dict[float, int], bound: int, shard=None) -> None:
    """Every drawn row is fresh, its staleness is reported, and (uniform over the fresh) every fresh row is drawn."""
    stored = rb.storage if shard is None else shard  # a sharded store's rows: its one shard's
    readable = set(stored[:]["obs"].tolist())  # a shared ring keeps one row out, for the next write
    fresh = _fresh(live, sampler.consumer_version, bound) & readable
    seen: set[float] = set()
    for _ in range(40):
        batch = rb.sample()
        obs = batch["obs"].tolist()
        assert set(obs) <= fresh, sorted(set(obs) - fresh)
        expected = torch.tensor([sampler.consumer_version - live[o] for o in obs])
        assert torch.equal(batch["staleness"].reshape(-1).cpu(), expected)
        seen |= set(obs)
    assert seen == fresh


@pytest.mark.parametrize("shared", [False, True], ids=["local", "shared"])
@pytest.mark.parametrize("bound", [0, 1, 3])
def test_prioritized_rows_are_drawn_from_the_fresh_rows_only(shared, bound):
    storage = GearStorage(CAPACITY, shared=shared)
    try:
        sampler = GearPrioritizedSampler(CAPACITY, alpha=0.0, beta=0.4, max_staleness=bound)
        rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=32)
        writer = TrajectoryWriter(storage)  # commits the sampler follows (another process's, when shared)

        def write(rows):
            writer.extend(rows)
            writer.end_episode()

        ring: dict = {}
        live = _fill(write, [0, 1, 2, 3, 4, 5, 6, 7], ring=ring)  # 80 rows: the ring lapped past versions 0, 1
        for consumer in (4, 5, 7, 8):
            sampler.consumer_version = consumer
            if not _fresh(live, consumer, bound):
                with pytest.raises(RuntimeError, match=f"max_staleness={bound}"):
                    rb.sample()
                continue
            _check_draws(rb, sampler, live, bound)
        live = _fill(write, [9], ring=ring)  # rewritten rows come back fresh
        sampler.increment_consumer_version()
        assert sampler.consumer_version == 9
        _check_draws(rb, sampler, live, bound)
    finally:
        storage.close()


def test_rows_another_process_writes_are_bounded_by_the_versions_it_stamped():
    storage = GearStorage(CAPACITY, shared=True)
    try:
        sampler = GearPrioritizedSampler(CAPACITY, alpha=0.0, beta=0.4, max_staleness=1)
        rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=32)
        versions = [0, 1, 2, 3, 4, 5, 6, 7]
        generator = mp.get_context("spawn").Process(target=w.write_policy_versions, args=(storage, versions, 10))
        generator.start()
        generator.join(120)
        assert generator.exitcode == 0
        live = _fill(lambda rows: None, versions)  # what the generator wrote, listed here
        for consumer in (6, 8):
            sampler.consumer_version = consumer
            _check_draws(rb, sampler, live, 1)
    finally:
        storage.close()


def test_topk_is_the_best_of_the_fresh_rows():
    sampler = TopKSampler(CAPACITY, key="obs", max_staleness=1)
    rb = TensorDictReplayBuffer(storage=GearStorage(CAPACITY), sampler=sampler, batch_size=5)
    live = _fill(rb.extend, [3, 0, 2, 1])  # the newest versions hold the lowest scores
    sampler.consumer_version = 3
    best = sorted(_fresh(live, 3, 1), reverse=True)[:5]
    batch = rb.sample()
    assert batch["obs"].tolist() == best
    assert batch["staleness"].tolist() == [3 - live[o] for o in best]


def test_without_a_bound_nothing_is_filtered_and_no_staleness_is_reported():
    sampler = GearPrioritizedSampler(CAPACITY, alpha=0.0, beta=0.4)
    rb = TensorDictReplayBuffer(storage=GearStorage(CAPACITY), sampler=sampler, batch_size=64)
    rb.extend(_rows(0, 20, 0))
    sampler.consumer_version = 100
    batches = [rb.sample() for _ in range(10)]
    assert all("staleness" not in batch.keys() for batch in batches)
    assert {o for batch in batches for o in batch["obs"].tolist()} == set(map(float, range(20)))


def test_bad_bounds_versions_and_keys_are_refused_and_leave_the_sampler_as_it_was():
    for bad in (-2, 1.5, "1", True):
        with pytest.raises(ValueError, match="max_staleness must be an integer >= -1"):
            GearPrioritizedSampler(CAPACITY, alpha=0.0, beta=0.4, max_staleness=bad)  # type: ignore[arg-type]
    sampler = GearPrioritizedSampler(CAPACITY, alpha=0.0, beta=0.4, max_staleness=1)
    sampler.consumer_version = 5
    with pytest.raises(ValueError, match="goes forward only: it is 5, got 4"):
        sampler.consumer_version = 4
    for wrong in (5.5, "6", torch.tensor([6, 7])):
        with pytest.raises((TypeError, ValueError), match="consumer version"):
            sampler.consumer_version = wrong  # type: ignore[assignment]
    assert sampler.consumer_version == 5
    rb = TensorDictReplayBuffer(storage=GearStorage(CAPACITY), sampler=sampler, batch_size=4)
    with pytest.raises(KeyError, match="'policy_version'"):
        rb.extend(TensorDict({"obs": torch.zeros(4)}, [4]))
    mine = TopKSampler(CAPACITY, key="obs", max_staleness=0, version_key=("meta", "v"))
    rb = TensorDictReplayBuffer(storage=GearStorage(CAPACITY), sampler=mine, batch_size=4)
    with pytest.raises(KeyError, match="'meta.v'"):
        rb.extend(_rows(0, 4, 0))


@pytest.mark.parametrize("saved", ["dumps", "state_dict"])
def test_a_bounded_sampler_saves_its_rows_versions_and_consumer_version(saved, tmp_path):
    storage = GearStorage(CAPACITY)
    sampler = GearPrioritizedSampler(CAPACITY, alpha=0.0, beta=0.4, max_staleness=1)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=32)
    live = _fill(rb.extend, [0, 1, 2, 3])
    sampler.consumer_version = 2
    back = GearPrioritizedSampler(CAPACITY, alpha=0.0, beta=0.4, max_staleness=1)
    if saved == "dumps":
        sampler.dumps(tmp_path)
        back.loads(tmp_path)
    else:
        back.load_state_dict(sampler.state_dict())
    assert back.consumer_version == 2
    rb = TensorDictReplayBuffer(storage=storage, sampler=back, batch_size=32)
    _check_draws(rb, back, live, 1)
    back.consumer_version = 3  # the versions came back too: the bound moves with them
    _check_draws(rb, back, live, 1)
    topk = TopKSampler(CAPACITY, key="obs", max_staleness=0)
    topk.consumer_version = 4
    again = TopKSampler(CAPACITY, key="obs", max_staleness=0)
    again.load_state_dict(topk.state_dict())
    assert again.consumer_version == 4


def test_a_state_without_versions_is_refused_by_a_bounded_sampler_which_stays_as_it_was():
    unbounded = GearPrioritizedSampler(CAPACITY, alpha=0.0, beta=0.4)
    bounded = GearPrioritizedSampler(CAPACITY, alpha=0.0, beta=0.4, max_staleness=1)
    bounded.consumer_version = 3
    with pytest.raises(CheckpointError, match="policy_version"):
        bounded.load_state_dict(unbounded.state_dict())
    state = bounded.state_dict()
    with pytest.raises(CheckpointError, match="consumer version"):
        bounded.load_state_dict({**state, "consumer_version": 1.5})
    assert bounded.consumer_version == 3


def test_a_cap_around_a_bound_is_refused():
    with pytest.raises(TypeError, match="cap around a staleness bound"):
        MaxTimesSampled(GearPrioritizedSampler(CAPACITY, 0.0, 0.4, max_staleness=1), 2, CAPACITY)
    assert MaxTimesSampled(GearPrioritizedSampler(CAPACITY, 0.0, 0.4), 2, CAPACITY).max_times == 2


def test_the_consumer_version_travels_in_the_spec_outside_its_identity():
    asked = FreshSpec(PrioritySpec(0.0, 1e-8), 1, consumer_version=7)
    back = spec_from_json(asked.to_json())
    assert isinstance(back, FreshSpec) and back.consumer_version == 7 and back == FreshSpec(PrioritySpec(0.0, 1e-8), 1)
    assert hash(back) == hash(FreshSpec(PrioritySpec(0.0, 1e-8), 1))  # an owner keeps one core across versions
    with pytest.raises(ValueError, match="consumer_version must be an int"):
        spec_from_json({**asked.to_json(), "consumer_version": "7"})


@pytest.fixture(scope="module")
def sharded():
    with one_rank_sharded_store(CAPACITY) as store:
        yield store


def test_a_sharded_owner_filters_by_the_consumer_version_each_request_carries(sharded):
    writer = TrajectoryWriter(sharded.local)

    def write(rows):
        writer.extend(rows)
        writer.end_episode()

    live = _fill(write, [0, 1, 2, 3, 4, 5])
    sampler = GearPrioritizedSampler(CAPACITY, alpha=0.0, beta=0.4, max_staleness=1)
    rb = TensorDictReplayBuffer(storage=sharded, sampler=sampler, batch_size=32)
    for consumer in (2, 4, 5):
        sampler.consumer_version = consumer  # set on the learner only: the owner learns it from the requests
        _check_draws(rb, sampler, live, 1, shard=sharded.local)
    sampler.consumer_version = 7
    with pytest.raises(RuntimeError, match="max_staleness=1"):
        rb.sample()
