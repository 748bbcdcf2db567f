"""A batch's split across shards (``_C.draw_shares``): a multinomial over the masses, drawn from the learner's
generator, so a seeded learner repeats its batches; and clear refusals of masses no shard can have. A batch's
priority updates split by owner (``_C.split_updates``): grouped stably, framed as wire.encode frames them,
and refused before anything is framed."""

from __future__ import annotations

import pytest
import torch

from gear_torchrl.distributed import wire
from gear_torchrl.distributed.shard_client import rule_meta, update_message
from gear_torchrl.kernels import _C
from gear_torchrl.selection.priorities import PrioritySpec


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


@pytest.mark.parametrize("shards", [3, 8, 13, 64])
def test_many_shards_get_their_masses_share_and_those_without_mass_none(shards):
    masses = [float(i % 4) for i in range(shards)]  # zeros among them, and at either end for some widths
    masses[-1] = 0.0
    generator = torch.Generator().manual_seed(shards)
    totals = torch.zeros(shards, dtype=torch.float64)
    for _ in range(100):
        counts, _ = _C.draw_shares(masses, 2000, generator)
        assert sum(counts) == 2000
        totals += torch.tensor(counts, dtype=torch.float64)
    expected = torch.tensor(masses, dtype=torch.float64) / sum(masses)
    assert totals[expected == 0].sum() == 0
    assert torch.allclose(totals / totals.sum(), expected, atol=0.005)


def test_one_shard_takes_the_batch_without_drawing_and_no_mass_gives_no_shares():
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    assert _C.draw_shares([5.0], 64, None) == ([64], None)
    assert _C.draw_shares([0.0], 64, None) == ([0], None)
    assert _C.draw_shares([0.0, 0.0], 64, None) == ([0, 0], None)
    assert _C.draw_shares([2.0, 2.0], 0, None) == ([0, 0], None)
    assert torch.equal(generator.get_state(), state)


@pytest.mark.parametrize(
    "masses, message",
    [
        ([float("nan"), 1.0], "mass of nan"),
        ([1.0, -2.0], "mass of -2"),
        ([1.0, float("inf")], "mass of inf"),
        ([], "no shards"),
    ],
)
def test_masses_no_shard_can_have_are_refused(masses, message):
    with pytest.raises(ValueError, match=message):
        _C.draw_shares(masses, 8, torch.Generator())
    with pytest.raises(ValueError, match="negative batch size"):
        _C.draw_shares([1.0], -1, None)


RULE = PrioritySpec(alpha=0.6)


def _split(shards, rows, priority, generation=None, capacities=(10, 10, 10)):
    return _C.split_updates(
        torch.tensor(shards),
        torch.tensor(rows),
        torch.tensor(priority, dtype=torch.float64),
        None if generation is None else torch.tensor(generation),
        list(capacities),
        wire.Op.POST_UPDATE,
        rule_meta(RULE),
    )


@pytest.mark.parametrize("generation", [None, [5, 6, 7, 8, 9, 10]])
def test_updates_are_grouped_by_owner_in_the_batchs_order_and_framed_as_wire_encodes_them(generation):
    shards, rows, priority = [2, 0, 2, 0, 2, 0], [4, 1, 4, 3, 7, 9], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    refused, _, _, _, owners, counts, grouped, told, generations, frames = _split(shards, rows, priority, generation)
    assert refused == 0 and owners == [0, 2] and counts == [3, 3]
    assert grouped.tolist() == [1, 3, 9, 4, 4, 7] and told.tolist() == [2.0, 4.0, 6.0, 1.0, 3.0, 5.0]
    assert generations is None if generation is None else generations.tolist() == [6, 8, 10, 5, 7, 9]
    for owner, frame, part in zip(owners, frames, (slice(0, 3), slice(3, 6))):
        expected = update_message(
            RULE, grouped[part], told[part], None if generations is None else generations[part], posted=True
        )
        assert frame == wire.encode(expected), f"owner {owner}'s message"


def test_entries_of_a_skipped_shard_are_left_out_and_their_rows_not_checked():
    refused, _, _, _, owners, counts, grouped, _, _, frames = _split(
        [1, 0, 1], [99, 2, 3], [1.0, 1.0, 1.0], capacities=(10, -1, 10)
    )
    assert refused == 0 and owners == [0] and counts == [1] and grouped.tolist() == [2] and len(frames) == 1


@pytest.mark.parametrize(
    "shards, rows, priority, expected",
    [
        ([0, 1, 1], [1, 2, 3], [1.0, float("nan"), -1.0], (1, 1, 0, 0)),  # the first bad priority
        ([0, 1, 2, 1], [1, 12, 3, 4], [1.0] * 4, (2, 1, 4, 12)),  # shard 1's rows span 4..12
        ([0, 5, 4, 2], [1, 1, 1, 11], [1.0] * 4, (2, 2, 11, 11)),  # a row past its shard, before shards past the store
        ([0, 5, 4], [1, 1, 1], [1.0] * 3, (3, 4, 0, 0)),  # the first shard past the store
    ],
)
def test_refusals_name_the_first_problem_in_the_order_python_checks_and_frame_nothing(shards, rows, priority, expected):
    refused, at, lo, hi, owners, _, _, _, _, frames = _split(shards, rows, priority)
    assert (refused, at, lo, hi) == expected and owners == [] and frames == []
