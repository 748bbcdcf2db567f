"""GearStorage against LazyTensorStorage: same writes, same reads, identical TensorDicts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers import as_td, assert_same_td, make_steps
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    PrioritizedReplayBuffer,
    PrioritizedSampler,
    RandomSampler,
    ReplayBuffer,
    SamplerWithoutReplacement,
    SliceSampler,
    TensorDictReplayBuffer,
    TensorStorage,
)

from gear_torchrl import GearStorage

CAPACITY = 100


def read(storage: TensorStorage, index: list[int]) -> Any:
    """``storage.get(index)`` as TensorStorage declares it: LazyTensorStorage annotates its ``get`` for slices
    only, yet reads index lists as its base does."""
    return storage.get(index)


def filled_pair(sizes, capacity=CAPACITY):
    gear, ref = GearStorage(capacity), LazyTensorStorage(capacity)
    for s in (gear, ref):
        rb = ReplayBuffer(storage=s)
        for i, n in enumerate(sizes):
            rb.extend(make_steps(n, seed=i))
    return gear, ref


@pytest.mark.parametrize("sizes", [[7], [37, 37, 37], [250], [99, 1, 100, 3]])
def test_every_index_type_reads_the_same(sizes):
    gear, ref = filled_pair(sizes)
    assert len(gear) == len(ref)
    n = len(ref)
    indices = [
        0,
        n - 1,
        -1,
        -n,
        slice(None),
        slice(3, 17),
        slice(None, None, 7),
        slice(-5, None),
        [0, 3, 3, n - 1],
        np.array([5, 1, -2]),
        torch.tensor([n - 1, 0, 2]),
        torch.tensor(4),
        torch.randint(0, n, (3, 5)),
        torch.arange(n) % 2 == 0,
        torch.tensor([], dtype=torch.int64),
    ]
    for index in indices:
        got, want = gear.get(index), ref.get(index)
        assert_same_td(got, want)


def test_tensor_data_without_tensordict():
    gear, ref = GearStorage(10), LazyTensorStorage(10)
    for s in (gear, ref):
        rb = ReplayBuffer(storage=s)
        rb.extend(torch.arange(24.0).view(12, 2))
        rb.add(torch.tensor([100.0, 101.0]))
    assert torch.equal(gear.get(slice(None)), ref.get(slice(None)))
    assert torch.equal(gear.get([2, 3]), read(ref, [2, 3]))


def test_nested_batch_dims_and_row_batches():
    data = TensorDict({"a": torch.randn(6, 5, 2), "sub": TensorDict({"b": torch.randn(6, 5)}, [6, 5])}, [6, 5])
    gear, ref = GearStorage(4), LazyTensorStorage(4)
    for s in (gear, ref):
        ReplayBuffer(storage=s).extend(data)
    assert_same_td(gear.get([0, 3]), read(ref, [0, 3]))
    assert as_td(gear.get([0, 3]))["sub"].batch_size == read(ref, [0, 3])["sub"].batch_size


@pytest.mark.parametrize(
    "sampler",
    [
        lambda: RandomSampler(),
        lambda: SamplerWithoutReplacement(),
        lambda: SliceSampler(slice_len=4, end_key=("next", "done")),
        lambda: SliceSampler(num_slices=2, end_key=("next", "done"), strict_length=False),
        lambda: PrioritizedSampler(CAPACITY, alpha=0.7, beta=0.5),
    ],
    ids=["random", "without_replacement", "slice", "slice_not_strict", "prioritized"],
)
def test_torchrl_samplers_see_identical_data(sampler):
    batches = []
    for storage in (GearStorage(CAPACITY), LazyTensorStorage(CAPACITY)):
        rb = TensorDictReplayBuffer(storage=storage, sampler=sampler(), batch_size=16)
        torch.manual_seed(0)
        np.random.seed(0)
        out = []
        for i in range(4):
            rb.extend(make_steps(45, seed=i, done_prob=0.15))
            sample = rb.sample()
            if isinstance(rb._sampler, PrioritizedSampler):
                sample["td_error"] = torch.rand(16)
                rb.update_tensordict_priority(sample)
            out.append(sample)
        batches.append(out)
    for got, want in zip(*batches):
        assert_same_td(got, want)


def test_prioritized_replay_buffer_drop_in():
    results = []
    for storage in (GearStorage(CAPACITY), LazyTensorStorage(CAPACITY)):
        rb = PrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=storage, batch_size=8)
        torch.manual_seed(1)
        np.random.seed(1)
        rb.extend(make_steps(60, seed=3))
        sample, info = rb.sample(return_info=True)
        rb.update_priority(info["index"], torch.rand(8) + 0.1)
        results.append((sample, rb.sample(return_info=True)))
    assert_same_td(results[0][0], results[1][0])
    assert_same_td(results[0][1][0], results[1][1][0])
    assert torch.equal(results[0][1][1]["index"], results[1][1][1]["index"])


def test_memmap_storage_oracle_too():
    gear, mm = GearStorage(50), LazyMemmapStorage(50)
    for s in (gear, mm):
        rb = ReplayBuffer(storage=s)
        rb.extend(make_steps(70, seed=9))
    assert_same_td(gear.get(slice(None)), mm.get(slice(None)).to_tensordict())


def test_state_dict_round_trip_matches_oracle():
    gear, ref = filled_pair([130, 20])
    restored_gear, restored_ref = GearStorage(CAPACITY), LazyTensorStorage(CAPACITY)
    restored_gear.load_state_dict(gear.state_dict())
    restored_ref.load_state_dict(ref.state_dict())
    assert len(restored_gear) == len(restored_ref)
    assert_same_td(restored_gear.get(slice(None)), restored_ref.get(slice(None)))
    assert restored_gear._last_cursor_index == gear._last_cursor_index


def test_buffer_dumps_loads_restores_data_episodes_and_cursor(tmp_path):
    rb = TensorDictReplayBuffer(storage=GearStorage(CAPACITY), batch_size=8)
    for i in range(5):
        rb.extend(make_steps(37, seed=i))
    rb.dumps(tmp_path)
    loaded = TensorDictReplayBuffer(storage=GearStorage(CAPACITY), batch_size=8)
    loaded.loads(tmp_path)
    assert len(loaded) == len(rb)
    assert_same_td(loaded.storage.get(slice(None)), rb.storage.get(slice(None)))
    before, after = rb.storage.shard.episodes.live(), loaded.storage.shard.episodes.live()
    for field in ("serial", "start", "length", "closed"):
        assert torch.equal(getattr(before, field), getattr(after, field))
    assert loaded.storage.shard.head == rb.storage.shard.head
    # the writer continues where it stopped, in both
    more = make_steps(10, seed=99)
    rb.extend(more)
    loaded.extend(more)
    assert_same_td(loaded.storage.get(slice(None)), rb.storage.get(slice(None)))


def test_empty_resets_like_torchrl():
    gear, ref = filled_pair([30])
    for s in (gear, ref):
        s._empty()
        assert len(s) == 0
    assert gear.shard.episodes.num_episodes == 0
    for s in (gear, ref):
        ReplayBuffer(storage=s).extend(make_steps(5, seed=4))
    assert_same_td(gear.get(slice(None)), ref.get(slice(None)))


def test_replay_buffer_empty_and_refill():
    rb = TensorDictReplayBuffer(storage=GearStorage(20), batch_size=4)
    rb.extend(make_steps(30, seed=1))
    rb.empty()
    assert len(rb) == 0
    rb.extend(make_steps(3, seed=2))
    assert len(rb) == 3
    assert torch.equal(rb.storage.get(slice(None))["info", "step"], make_steps(3, seed=2)["info", "step"])


def test_write_at_and_setitem_match_oracle():
    gear, ref = filled_pair([40])
    patch = make_steps(3, seed=50)
    for s in (gear, ref):
        s[torch.tensor([5, 0, 39])] = patch
    assert_same_td(gear.get(slice(None)), ref.get(slice(None)))
    assert len(gear) == len(ref)


def test_contains_and_shape():
    gear, ref = filled_pair([12])
    assert gear.contains(11) and not gear.contains(12) and gear.contains(-12)
    assert torch.equal(gear.contains(torch.tensor([0, 12, -1])), torch.tensor([True, False, True]))
    assert gear.shape == ref.shape == torch.Size([12])
    assert gear.ndim == 1 and gear.device == torch.device("cpu")
