"""A buffer seeded with ``rb.set_rng`` draws the same batches whatever the global seed, with every sampler."""

from __future__ import annotations

import pytest
import torch
from helpers import make_steps
from torchrl.data import PrioritizedSampler, SliceSampler, TensorDictReplayBuffer

from gear_torchrl import (
    GearPrioritizedSampler,
    GearPrioritizedSequenceSampler,
    GearSequenceSampler,
    GearStorage,
    GearUniformSampler,
    MaxTimesSampled,
)

ROWS = 500
SAMPLERS = {
    "uniform (TorchRL's RandomSampler)": lambda: None,
    "TorchRL PrioritizedSampler": lambda: PrioritizedSampler(ROWS, 0.7, 0.5),
    "TorchRL SliceSampler": lambda: SliceSampler(slice_len=4, end_key=("next", "done")),
    "GearUniformSampler": lambda: GearUniformSampler(),
    "GearPrioritizedSampler": lambda: GearPrioritizedSampler(ROWS, 0.7, 0.5),
    "GearSequenceSampler": lambda: GearSequenceSampler(4, strict_length=False),
    "GearPrioritizedSequenceSampler": lambda: GearPrioritizedSequenceSampler(ROWS, 4, strict_length=False),
    "MaxTimesSampled": lambda: MaxTimesSampled(GearPrioritizedSampler(ROWS, 0.7, 0.5), max_times=50, max_capacity=ROWS),
}


def _draws(make_sampler, global_seed: int) -> list[torch.Tensor]:
    torch.manual_seed(global_seed)
    sampler = make_sampler()
    kwargs = {} if sampler is None else {"sampler": sampler}
    rb = TensorDictReplayBuffer(storage=GearStorage(ROWS), batch_size=32, **kwargs)
    rb.extend(make_steps(ROWS, seed=3))
    rb.set_rng(torch.Generator().manual_seed(0))
    draws = []
    for _ in range(3):
        batch = rb.sample()
        draws.append(batch["info", "step"].clone())
        if "priority_weight" in batch.keys() or isinstance(sampler, (PrioritizedSampler, MaxTimesSampled)):
            rb.update_tensordict_priority(batch.set("td_error", (batch["info", "step"] % 7 + 1).float()))
    return draws


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_a_seeded_buffer_draws_the_same_whatever_the_global_seed(name):
    first, second = _draws(SAMPLERS[name], 1), _draws(SAMPLERS[name], 2)
    for a, b in zip(first, second):
        assert torch.equal(a, b), f"{name}: the buffer's generator does not decide its draws"
