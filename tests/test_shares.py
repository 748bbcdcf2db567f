"""A batch's split across shards (``_C.draw_shares``): a multinomial over the masses, drawn from the learner's
generator, so a seeded learner repeats its batches; and clear refusals of masses no shard can have."""
from __future__ import annotations

import pytest
import torch

from gear_torchrl.kernels import _C


def test_a_seeded_split_repeats_and_sums_to_the_batch():
    first = _C.draw_shares([3.0, 1.0, 4.0], 256, torch.Generator().manual_seed(7))
    again = _C.draw_shares([3.0, 1.0, 4.0], 256, torch.Generator().manual_seed(7))
    other = _C.draw_shares([3.0, 1.0, 4.0], 256, torch.Generator().manual_seed(8))
    assert first == again and first != other
    counts, seeds = first
    assert sum(counts) == 256 and len(seeds) == 3 and all(0 <= s < 1 << 62 for s in seeds)


def test_shares_follow_the_masses_and_a_shard_without_mass_gets_none():
    generator = torch.Generator().manual_seed(0)
    totals = torch.zeros(4)
    for _ in range(200):
        counts, _ = _C.draw_shares([1.0, 2.0, 0.0, 7.0], 500, generator)
        totals += torch.tensor(counts, dtype=torch.float32)
    share = totals / totals.sum()
    assert share[2] == 0
    assert torch.allclose(share[[0, 1, 3]], torch.tensor([0.1, 0.2, 0.7]), atol=0.01)


def test_one_shard_takes_the_batch_without_drawing_and_no_mass_gives_no_shares():
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    assert _C.draw_shares([5.0], 64, None) == ([64], None)
    assert _C.draw_shares([0.0], 64, None) == ([0], None)
    assert _C.draw_shares([0.0, 0.0], 64, None) == ([0, 0], None)
    assert _C.draw_shares([2.0, 2.0], 0, None) == ([0, 0], None)
    assert torch.equal(generator.get_state(), state)


@pytest.mark.parametrize("masses, message", [([float("nan"), 1.0], "mass of nan"), ([1.0, -2.0], "mass of -2"),
                                             ([1.0, float("inf")], "mass of inf"), ([], "no shards")])
def test_masses_no_shard_can_have_are_refused(masses, message):
    with pytest.raises(ValueError, match=message):
        _C.draw_shares(masses, 8, torch.Generator())
    with pytest.raises(ValueError, match="negative batch size"):
        _C.draw_shares([1.0], -1, None)
