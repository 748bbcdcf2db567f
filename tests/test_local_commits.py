"""Rows a TrajectoryWriter commits reach samplers that keep per-row state, local store or shared."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import (
    GearPrioritizedSampler,
    GearPrioritizedSequenceSampler,
    GearStorage,
    MaxTimesSampled,
    QueueSampler,
    TrajectoryWriter,
)
from gear_torchrl.store.local_commits import CommitRecord


def episode(n: int, first: int) -> TensorDict:
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict(
        {"obs": torch.arange(first, first + n, dtype=torch.float32).unsqueeze(-1), ("next", "done"): done}, [n]
    )


def commit(writer: TrajectoryWriter, n: int, first: int) -> None:
    writer.extend(episode(n, first))
    writer.end_episode()


def test_commit_record_reports_each_row_once_and_forgets_what_newer_commits_overwrote():
    record = CommitRecord(10)
    record.add(torch.arange(0, 6), size_before=0)
    gone, new, seen = record.since((0, 0))
    assert gone.numel() == 0 and new.tolist() == [0, 1, 2, 3, 4, 5]
    record.add(torch.tensor([6, 7, 8, 9, 0, 1]), size_before=6)  # wraps: rows 0 and 1 held data
    gone, new, _ = record.since(seen)
    assert gone.tolist() == [0, 1] and new.tolist() == [6, 7, 8, 9, 0, 1]
    gone, new, _ = record.since((0, 0))  # a follower that saw nothing: each row once, in its last write's order
    assert new.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    record.add(torch.arange(2, 10), size_before=10)
    assert [c[0] for c in record._commits] == [2, 3]  # commit 1's rows were all written again since
    record.clear()
    assert record.since(seen)[1].numel() == 0 and record.since((0, 0))[2] == (3, 0)


def test_prioritized_sampler_gives_committed_rows_the_largest_priority():
    storage = GearStorage(40)
    sampler = GearPrioritizedSampler(40, alpha=1.0, beta=0.5, eps=0.0)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=8)
    writer = TrajectoryWriter(storage)
    for k in range(4):
        commit(writer, 10, 10 * k)
    batch = rb.sample()  # before the fix: "every stored row has priority 0"
    rb.update_priority(batch["index"], torch.full((8,), 5.0))
    commit(writer, 10, 100)  # rows 0..9 again
    rb.sample()
    assert sampler._trees.get(torch.arange(10)).tolist() == [5.0] * 10


@pytest.mark.parametrize("shared", [False, True])
def test_prioritized_windows_over_rewritten_rows_start_at_the_largest_priority(shared):
    storage = GearStorage(40, shared=shared)
    sampler = GearPrioritizedSequenceSampler(40, 4, alpha=1.0, beta=0.5, eps=0.0)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=8)
    writer = TrajectoryWriter(storage)
    for k in range(4):
        commit(writer, 10, 10 * k)
    rb.sample()
    windows = torch.arange(40)  # ten windows of 4 steps, one priority each (lands on each window's first row)
    rb.update_priority(windows, torch.linspace(0.1, 0.2, 10))
    rb.update_priority(windows[:4], torch.tensor([5.0]))  # the largest priority seen
    kept = sampler._row_mass[20:].clone()
    for k in range(2):
        commit(writer, 10, 100 + 10 * k)  # rows 0..19: new data in place of rows with old priorities
    rb.sample()
    assert sampler._row_mass[:20].tolist() == [5.0] * 20  # not the old rows' 5.0 / 0.1-0.2, not the default 1.0
    assert torch.equal(sampler._row_mass[20:], kept)


def test_queue_sampler_serves_committed_rows_in_order():
    storage = GearStorage(10)
    rb = TensorDictReplayBuffer(storage=storage, sampler=QueueSampler(10), batch_size=4)
    writer = TrajectoryWriter(storage)
    commit(writer, 6, 0)
    assert rb.sample()["obs"].flatten().tolist() == [0, 1, 2, 3]
    commit(writer, 6, 100)  # overwrites rows 6..9, 0, 1
    assert rb.sample()["obs"].flatten().tolist() == [4, 5, 100, 101]
    assert rb.sample()["obs"].flatten().tolist() == [102, 103, 104, 105]


@pytest.mark.parametrize("shared", [False, True])
def test_rewritten_rows_start_uncounted_under_max_times_sampled(shared):
    storage = GearStorage(16, shared=shared)
    sampler = MaxTimesSampled(GearPrioritizedSampler(16, alpha=0.0, beta=0.5), 1, 16)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=4)
    writer = TrajectoryWriter(storage)
    for first in (0, 100, 200):
        commit(writer, 4, first)
    first_round = torch.cat([rb.sample()["obs"].flatten() for _ in range(3)])
    assert sorted(first_round.tolist()) == [0, 1, 2, 3, 100, 101, 102, 103, 200, 201, 202, 203]
    for first in (300, 400):  # rows 12..15, then rows 0..3 again: new data, never sampled
        commit(writer, 4, first)
    second_round = torch.cat([rb.sample()["obs"].flatten() for _ in range(2)])
    assert sorted(second_round.tolist()) == [300, 301, 302, 303, 400, 401, 402, 403]
