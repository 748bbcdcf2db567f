"""QueueSampler, TopKSampler and MaxTimesSampled: Reverb's selectors as TorchRL samplers."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import (
    GearPrioritizedSampler,
    GearSequenceSampler,
    GearStorage,
    MaxTimesSampled,
    QueueSampler,
    TopKSampler,
)


def steps(first: int, n: int) -> TensorDict:
    return TensorDict(
        {
            "step": torch.arange(first, first + n),
            ("next", "reward"): torch.arange(first, first + n).float().remainder(7).unsqueeze(-1),
        },
        [n],
    )


def buffer(sampler, capacity=50):
    return TensorDictReplayBuffer(storage=GearStorage(capacity), sampler=sampler)


@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_queue_serves_each_row_once_in_order(order):
    rb = buffer(QueueSampler(50, order=order))
    rb.extend(steps(0, 10))
    first = rb.sample(4)["step"].tolist()
    rb.extend(steps(10, 3))
    rest = rb.sample(9)["step"].tolist()
    if order == "fifo":
        assert first == [0, 1, 2, 3] and rest == list(range(4, 13))
    else:
        assert first == [9, 8, 7, 6] and rest == [12, 11, 10, 5, 4, 3, 2, 1, 0]
    assert rb.sampler.ran_out and len(rb.sampler) == 0
    with pytest.raises(RuntimeError, match="0 rows wait to be consumed, asked for 1"):
        rb.sample(1)


def test_queue_skips_rows_overwritten_before_consumption():
    rb = buffer(QueueSampler(8), capacity=8)
    rb.extend(steps(0, 6))
    rb.sample(2)  # consumes 0, 1
    rb.extend(steps(6, 6))  # ring of 8: overwrites rows of steps 0..3
    served = rb.sample(len(rb.sampler))["step"].tolist()
    assert served == list(range(4, 12))
    assert len(set(served)) == len(served)


def test_queue_failed_sample_changes_nothing():
    rb = buffer(QueueSampler(50))
    rb.extend(steps(0, 3))
    with pytest.raises(RuntimeError, match="3 rows wait"):
        rb.sample(5)
    assert rb.sample(3)["step"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_rows_given_back_are_served_first_again(order):
    rb = buffer(QueueSampler(8, order=order), capacity=8)
    rb.extend(steps(0, 6))
    taken = rb.sampler.take(3)  # what a shard owner hands out for a batch that is then left unfilled
    rb.sampler.give_back(taken)
    assert len(rb.sampler) == 6
    assert rb.sample(6)["step"].tolist() == (list(range(6)) if order == "fifo" else list(range(5, -1, -1)))


def test_rows_rewritten_since_they_were_taken_do_not_come_back():
    rb = buffer(QueueSampler(8), capacity=8)
    rb.extend(steps(0, 8))
    rb.sample(6)  # rows 0..5 consumed
    taken = rb.sampler.take(2)  # rows 6, 7
    rb.extend(steps(8, 2))  # rewrites rows 0, 1
    rb.sampler.give_back(taken)  # not rewritten: served first again
    assert rb.sample(4)["step"].tolist() == [6, 7, 8, 9]
    assert rb.sampler.take(0).numel() == 0
    rb.extend(steps(10, 4))  # rows 2..5
    taken = rb.sampler.take(2)  # rows 2, 3 (steps 10, 11)
    rb.extend(steps(14, 4))  # rows 6, 7, 0, 1: not the taken ones
    rb.extend(steps(18, 2))  # rows 2, 3 rewritten: queued as new, their taken rows are gone
    rb.sampler.give_back(taken)
    assert rb.sample(len(rb.sampler))["step"].tolist() == [12, 13, 14, 15, 16, 17, 18, 19]


def test_topk_by_key_and_by_priority():
    rb = buffer(TopKSampler(50, key=("next", "reward")))
    rb.extend(steps(0, 20))
    top = rb.sample(4)
    assert top["next", "reward"].flatten().tolist() == [6.0, 6.0, 5.0, 5.0]  # best first
    chosen = set(top["step"].tolist())
    assert {6, 13} <= chosen <= {6, 13, 5, 12, 19}  # reward 6 at steps 6, 13; reward 5 at 5, 12, 19
    by_priority = buffer(TopKSampler(50))
    by_priority.extend(steps(0, 10))
    by_priority.update_priority(torch.arange(10), torch.tensor([0.0, 9, 1, 8, 2, 7, 3, 6, 4, 5]))
    assert by_priority.sample(3)["step"].tolist() == [1, 3, 5]
    with pytest.raises(RuntimeError, match="only 10 are stored"):
        by_priority.sample(11)


def test_max_times_sampled_caps_each_row_exactly():
    sampler = MaxTimesSampled(GearPrioritizedSampler(50, alpha=0.0, beta=0.0), max_times=2, max_capacity=50)
    rb = buffer(sampler)
    rb.extend(steps(0, 10))
    drawn = torch.cat([rb.sample(5)["step"] for _ in range(4)])
    assert torch.bincount(drawn, minlength=10).tolist() == [2] * 10
    with pytest.raises(RuntimeError, match="max_times_sampled=2"):
        rb.sample(1)
    rb.extend(steps(10, 2))  # new rows are sampleable again
    assert sorted(rb.sample(4)["step"].tolist()) == [10, 10, 11, 11]


def test_max_times_needs_a_sampler_that_can_exclude():
    with pytest.raises(TypeError, match="cannot exclude rows"):
        MaxTimesSampled(GearSequenceSampler(4), max_times=1, max_capacity=10)


def test_queue_write_larger_than_the_ring_serves_each_row_once():
    rb = buffer(QueueSampler(8), capacity=8)
    rb.extend(steps(0, 20))  # rows repeat in the writer's index: only steps 12..19 survive
    assert len(rb.sampler) == 8
    assert rb.sample(8)["step"].tolist() == list(range(12, 20))
