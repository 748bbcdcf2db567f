"""Bad priority inputs get a clear error naming the problem, and the buffer stays exactly as it was."""

from __future__ import annotations

import pytest
import torch
from helpers import make_steps
from test_checkpoint_damage import assert_unchanged, snapshot
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import (
    GearPrioritizedSampler,
    GearPrioritizedSequenceSampler,
    GearStorage,
    MaxTimesSampled,
    QueueSampler,
    TopKSampler,
)

CAPACITY = 64
STORED = 20
OTHER_SAMPLERS = [
    lambda: GearPrioritizedSequenceSampler(CAPACITY, seq_len=2, strict_length=False),
    lambda: TopKSampler(CAPACITY),
    lambda: MaxTimesSampled(GearPrioritizedSampler(CAPACITY, 0.6, 0.4), 3, CAPACITY),
]
OTHER_SAMPLER_IDS = ["prioritized sequence", "top-k", "max times sampled"]


def buffer(sampler=None) -> TensorDictReplayBuffer:
    rb = TensorDictReplayBuffer(
        storage=GearStorage(CAPACITY), sampler=sampler or GearPrioritizedSampler(CAPACITY, 0.6, 0.4), batch_size=4
    )
    rb.extend(make_steps(STORED, seed=0))
    rb.update_priority(torch.arange(STORED), torch.linspace(0.5, 2.0, STORED))
    return rb


# -- indices --------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [STORED, 50, CAPACITY - 1])
def test_a_priority_for_a_row_not_stored_is_refused(index):
    rb = buffer()
    before = snapshot(rb)
    with pytest.raises(IndexError, match=rf"index {index}\b.*{STORED} stored rows"):
        rb.update_priority(torch.tensor([3, index]), torch.tensor([1.0, 100.0]))
    assert_unchanged(rb, before)
    for _ in range(20):  # TorchRL's PrioritizedSampler samples on: so must we
        rb.sample()


def test_a_priority_past_capacity_is_refused_without_a_storage():
    sampler = GearPrioritizedSampler(CAPACITY, 0.6, 0.4)
    with pytest.raises(IndexError, match=f"index {CAPACITY} .*{CAPACITY} rows"):
        sampler.update_priority(torch.tensor([CAPACITY]), torch.tensor([1.0]))


@pytest.mark.parametrize(
    "index",
    [
        torch.tensor([1.5]),
        torch.tensor([1.0]),
        torch.tensor([2.0], dtype=torch.float64),
        torch.tensor([True, False]),
        [1.5],
    ],
    ids=["float", "integer-valued float", "float64", "bool", "list of floats"],
)
def test_a_non_integer_index_is_refused(index):
    rb = buffer()
    before = snapshot(rb)
    dtype = str(torch.as_tensor(index).dtype)
    with pytest.raises(TypeError, match=rf"integer.*{dtype}"):
        rb.update_priority(index, torch.full((torch.as_tensor(index).numel(),), 3.0))
    assert_unchanged(rb, before)


@pytest.mark.parametrize("make", OTHER_SAMPLERS, ids=OTHER_SAMPLER_IDS)
def test_other_samplers_refuse_a_float_index(make):
    rb = buffer(make())
    before = snapshot(rb)
    with pytest.raises(TypeError, match="float32"):
        rb.update_priority(torch.tensor([0.0, 1.0]), torch.tensor([3.0, 3.0]))
    assert_unchanged(rb, before)


# -- capacities -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda n: GearPrioritizedSampler(n, 0.6, 0.4),
        lambda n: QueueSampler(n),
        lambda n: TopKSampler(n),
        lambda n: MaxTimesSampled(GearPrioritizedSampler(n, 0.6, 0.4), max_times=2, max_capacity=n),
    ],
)
def test_a_sampler_smaller_than_its_storage_is_refused_when_the_buffer_is_built(make):
    storage = GearStorage(CAPACITY)
    with pytest.raises(ValueError, match=rf"for 8 rows, but its storage holds {CAPACITY}"):
        TensorDictReplayBuffer(storage=storage, sampler=make(8), batch_size=4)
    assert len(storage) == 0 and not storage.initialized
    TensorDictReplayBuffer(storage=storage, sampler=make(CAPACITY), batch_size=4).extend(make_steps(STORED, seed=0))


# -- priorities -----------------------------------------------------------------------------------

BAD_PRIORITIES = {
    "nan": torch.tensor([1.0, float("nan"), 2.0]),
    "negative": torch.tensor([1.0, 2.0, -0.25]),
    "inf": torch.tensor([float("inf"), 1.0, 2.0]),
    "-inf": torch.tensor([1.0, float("-inf"), 2.0]),
    "nan, scalar for every index": torch.tensor(float("nan")),
}


@pytest.mark.parametrize("priority", BAD_PRIORITIES.values(), ids=list(BAD_PRIORITIES))
def test_a_bad_priority_is_refused_and_changes_nothing(priority):
    rb = buffer()
    before = snapshot(rb)
    with pytest.raises(ValueError, match="finite and non-negative"):
        rb.update_priority(torch.tensor([0, 1, 2]), priority)
    assert_unchanged(rb, before)


@pytest.mark.parametrize("priority", BAD_PRIORITIES.values(), ids=list(BAD_PRIORITIES))
def test_a_bad_priority_with_generations_or_skips_changes_nothing(priority):
    rb = buffer()
    generation = rb.sampler._generation[:3].clone()
    before = snapshot(rb)
    with pytest.raises(ValueError, match="finite and non-negative"):
        rb.sampler.update_priority(torch.tensor([0, -1, 2]), priority, storage=rb.storage, generation=generation)
    assert_unchanged(rb, before)


def test_priorities_and_generations_of_another_count_change_nothing():
    rb = buffer()
    before = snapshot(rb)
    with pytest.raises(ValueError, match="2 priorities for 3 indices"):
        rb.update_priority(torch.tensor([0, 1, 2]), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="2 generations for 3 indices"):
        rb.sampler.update_priority(
            torch.tensor([0, 1, 2]), torch.tensor([1.0, 2.0, 3.0]), generation=torch.tensor([0, 0])
        )
    assert_unchanged(rb, before)


@pytest.mark.parametrize("make", OTHER_SAMPLERS, ids=OTHER_SAMPLER_IDS)
@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_other_samplers_refuse_bad_priorities(make, bad):
    rb = buffer(make())
    before = snapshot(rb)
    with pytest.raises(ValueError, match="finite and non-negative"):
        rb.update_priority(torch.tensor([0, 1]), torch.tensor([1.0, bad]))
    assert_unchanged(rb, before)
