"""GearDataset: the stream a DataLoader iterates, with and without prefetch."""
from __future__ import annotations

import pytest
import torch
from helpers import make_steps
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import GearDataset, GearStorage


def test_dataset_prefetch_yields_the_same_stream_and_forwards_errors():
    rb = TensorDictReplayBuffer(storage=GearStorage(100), batch_size=8)
    rb.extend(make_steps(50, seed=0))
    torch.manual_seed(0)
    plain = [b["obs"] for b in GearDataset(rb, num_batches=5)]
    torch.manual_seed(0)
    ahead = [b["obs"] for b in GearDataset(rb, num_batches=5, prefetch=2)]
    assert len(ahead) == 5 and all(torch.equal(a, b) for a, b in zip(plain, ahead))
    stream = iter(GearDataset(rb, prefetch=3))  # endless: stopping early must not hang
    next(stream)
    stream.close()
    empty = TensorDictReplayBuffer(storage=GearStorage(10), batch_size=4)
    with pytest.raises(RuntimeError, match="empty"):
        next(iter(GearDataset(empty, prefetch=1)))


def test_loader_hands_over_pinned_batches_for_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA (torch.cuda.is_available() is False)")
    rb = TensorDictReplayBuffer(storage=GearStorage(100), batch_size=8)
    rb.extend(make_steps(50, seed=0))
    batches = list(GearDataset(rb, num_batches=2, prefetch=1).loader(pin_memory=True))
    assert len(batches) == 2 and all(b["obs"].is_pinned() for b in batches)
