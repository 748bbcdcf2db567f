"""GearPrioritizedSampler: frequencies follow priorities, weights match TorchRL, bad input changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_steps
from prioritized_agreement import check_prioritized_against_torchrl
from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictReplayBuffer

from gear_torchrl import GearPrioritizedSampler, GearStorage

CHI2_DF19_P001 = 43.82  # critical value: a correct sampler exceeds it with probability 0.001


def buffer(capacity=100, rows=20, alpha=0.7, beta=0.5, **kwargs):
    rb = TensorDictReplayBuffer(
        storage=GearStorage(capacity), sampler=GearPrioritizedSampler(capacity, alpha, beta, **kwargs), batch_size=8
    )
    rb.extend(make_steps(rows, seed=0))
    return rb


def test_frequencies_follow_priorities_chi_square():
    rb = buffer(alpha=0.8, beta=0.5)
    priorities = torch.linspace(0.1, 5.0, 20)
    rb.update_priority(torch.arange(20), priorities)
    torch.manual_seed(1234)
    draws = torch.cat([rb.sampler.sample(rb.storage, 10_000)[0] for _ in range(20)])
    observed = torch.bincount(draws, minlength=20).double()
    expected = priorities.double().add(1e-8).pow(0.8)
    expected = expected / expected.sum() * draws.numel()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_DF19_P001, chi2
    uniform = torch.full((20,), draws.numel() / 20.0)
    assert float(((observed - uniform) ** 2 / uniform).sum()) > 100 * CHI2_DF19_P001


def test_weights_and_masses_match_torchrl():
    ours = GearPrioritizedSampler(50, alpha=0.6, beta=0.4)
    ref = PrioritizedSampler(50, alpha=0.6, beta=0.4)
    storage = LazyTensorStorage(50)
    storage.set(torch.arange(30), make_steps(30, seed=1))
    priorities = torch.rand(30) * 3 + 0.05
    for s in (ours, ref):
        s.mark_update(torch.arange(30))
        s.update_priority(torch.arange(30), priorities)
    torch.manual_seed(0)
    index, info = ours.sample(storage, 256)
    ref_mass = torch.tensor([ref._sum_tree[int(i)] for i in index], dtype=torch.float64)
    assert torch.allclose(ours._trees.get(index), ref_mass, rtol=1e-6)
    expected = torch.pow(ref_mass / ref._min_tree.query(0, 30), -0.4).float()
    assert torch.allclose(info["priority_weight"], expected, rtol=1e-5)
    assert info["priority_weight"].dtype == torch.float32


def test_written_priorities_land_and_draws_agree_with_torchrl():
    check_prioritized_against_torchrl("cpu")


def test_new_rows_get_the_largest_priority_seen():
    rb = buffer()
    rb.update_priority(torch.tensor([0, 1]), torch.tensor([7.0, 2.0]))
    rb.extend(make_steps(3, seed=5))
    new = torch.arange(20, 23)
    assert torch.allclose(
        rb.sampler._trees.get(new), torch.full((3,), (7.0 + 1e-8) ** rb.sampler.alpha, dtype=torch.float64)
    )


def test_update_tensordict_priority_path():
    rb = buffer(alpha=1.0, beta=1.0)
    sample = rb.sample()
    sample["td_error"] = torch.full((8,), 0.0)
    rb.update_tensordict_priority(sample)
    assert torch.all(rb.sampler._trees.get(sample["index"]) == 1e-8)


def test_stale_generation_updates_are_skipped():
    rb = buffer(capacity=20, rows=20)
    torch.manual_seed(0)
    sample = rb.sample()
    rb.extend(make_steps(5, seed=9))  # overwrites rows 0..4
    before = rb.sampler._trees.get(sample["index"]).clone()
    rb.sampler.update_priority(sample["index"], torch.full((8,), 42.0), generation=sample["generation"])
    after = rb.sampler._trees.get(sample["index"])
    stale = sample["index"] < 5
    assert torch.equal(after[stale], before[stale])
    assert torch.all(after[~stale] == (42.0 + 1e-8) ** rb.sampler.alpha)
    assert bool(stale.any()) and bool((~stale).any())


def test_emptying_the_buffer_forgets_the_last_draw():
    """``rb.empty()`` clears the core and the last draw, whose generations no longer name stored rows."""
    rb = buffer()
    rb.sample()
    assert rb.sampler._last_draw is not None
    rb.empty()
    assert rb.sampler._last_draw is None and rb.sampler.total_mass == 0


@pytest.mark.parametrize(
    "index, priority, error, match",
    [
        (torch.tensor([0, 1]), torch.tensor([1.0, float("nan")]), ValueError, "got nan at position 1"),
        (torch.tensor([0, 1]), torch.tensor([float("inf"), 1.0]), ValueError, "got inf at position 0"),
        (torch.tensor([0, 1]), torch.tensor([1.0, -0.5]), ValueError, "got -0.5 at position 1"),
        (torch.tensor([0, 1, 2]), torch.tensor([1.0, 2.0]), ValueError, "got 2 priorities for 3 indices"),
        (torch.tensor([0, 100]), torch.tensor([1.0, 2.0]), IndexError, "index 100 is out of range"),
    ],
)
def test_bad_priorities_are_rejected_and_trees_unchanged(index, priority, error, match):
    rb = buffer()
    trees = (rb.sampler._trees.sum.clone(), rb.sampler._trees.min.clone(), rb.sampler.default_priority)
    with pytest.raises(error, match=match):
        rb.update_priority(index, priority)
    assert torch.equal(rb.sampler._trees.sum, trees[0]) and torch.equal(rb.sampler._trees.min, trees[1])
    assert rb.sampler.default_priority == trees[2]


def test_empty_and_zero_mass_sampling_errors():
    rb = TensorDictReplayBuffer(storage=GearStorage(10), sampler=GearPrioritizedSampler(10, 0.7, 0.5), batch_size=2)
    with pytest.raises(RuntimeError, match="empty"):
        rb.sample()
    rb.extend(make_steps(3, seed=0))
    rb.update_priority(torch.arange(3), torch.zeros(3))
    with pytest.raises(RuntimeError, match="priority 0"):
        GearPrioritizedSampler(10, 1.0, 0.5, eps=0.0).sample(rb.storage, 2)


def test_beta_anneals_linearly():
    rb = buffer(alpha=0.6, beta=0.4, beta_final=1.0, beta_anneal_steps=4)
    betas = []
    for _ in range(6):
        rb.sample()
        betas.append(round(rb.sampler.beta, 6))
    assert betas == [0.55, 0.7, 0.85, 1.0, 1.0, 1.0]


def test_checkpoint_round_trip(tmp_path):
    rb = buffer()
    rb.update_priority(torch.arange(20), torch.rand(20) + 0.1)
    rb.dumps(tmp_path)
    loaded = TensorDictReplayBuffer(
        storage=GearStorage(100), sampler=GearPrioritizedSampler(100, 0.1, 0.1), batch_size=8
    )
    loaded.loads(tmp_path)
    assert torch.equal(loaded.sampler._trees.sum, rb.sampler._trees.sum)
    assert torch.equal(loaded.sampler._generation, rb.sampler._generation)
    assert loaded.sampler.alpha == rb.sampler.alpha
    restored = GearPrioritizedSampler(100, 0.1, 0.1)
    restored.load_state_dict(rb.sampler.state_dict())
    assert torch.equal(restored._trees.min, rb.sampler._trees.min)


def test_million_priorities_checkpoint_restores_exactly(tmp_path):
    sampler = GearPrioritizedSampler(1_000_000, 0.6, 0.4)
    index = torch.arange(1_000_000)
    sampler.mark_update(index)
    sampler.update_priority(index, torch.rand(1_000_000, generator=torch.Generator().manual_seed(0)) + 0.01)
    sampler.dumps(tmp_path)
    restored = GearPrioritizedSampler(1_000_000, 0.6, 0.4)
    restored.loads(tmp_path)
    assert torch.equal(restored._trees.sum, sampler._trees.sum)
    np.testing.assert_allclose(restored._trees.total, sampler._trees.total)


# -- the GPU structure (blocked prefix sums), checked on the CPU: same code on every device --


def test_block_prefix_sums_find_the_same_rows_as_the_trees():
    from gear_torchrl.selection.block_sums import BlockPrefixSums
    from gear_torchrl.selection.trees import PriorityTrees

    g = torch.Generator().manual_seed(0)
    capacity = 3000
    blocks, trees = BlockPrefixSums(capacity, block=64), PriorityTrees(capacity)
    index = torch.randint(0, capacity, (5000,), generator=g)
    mass = torch.randint(0, 5, (5000,), generator=g).double()  # integers: every sum is exact
    blocks.set(index, mass)
    trees.set(*_last_write(index, mass))
    assert blocks.total == trees.total and blocks.minimum == trees.minimum
    prefix = torch.rand(20_000, generator=g, dtype=torch.float64) * trees.total
    prefix[:3] = torch.tensor([0.0, trees.total, trees.total * (1 - 1e-16)])
    assert torch.equal(blocks.find(prefix), trees.find(prefix))
    assert bool((blocks.get(blocks.find(prefix)) > 0).all())
    # dropped entries (stale or skipped rows) change nothing, even where a kept write hits the same row
    keep = torch.rand(5000, generator=g) < 0.5
    new_mass = torch.randint(1, 5, (5000,), generator=g).double()
    blocks.set(index, new_mass, keep)
    trees.set(*_last_write(index[keep], new_mass[keep]))
    assert torch.equal(blocks.get(torch.arange(capacity)), trees.get(torch.arange(capacity)))
    assert blocks.total == trees.total and blocks.minimum == trees.minimum
    # a write smaller than the number of blocks recomputes only the blocks it touches
    few = torch.tensor([5, 700, 5, 2999, 64])
    blocks.set(few, torch.tensor([9.0, 0.0, 1.0, 3.0, 0.0]))
    trees.set(*_last_write(few, torch.tensor([9.0, 0.0, 1.0, 3.0, 0.0])))
    assert torch.equal(
        blocks.block_sum,
        BlockPrefixSums(capacity, block=64).block_sum.index_add(
            0, torch.arange(capacity) // 64, trees.get(torch.arange(capacity))
        ),
    )
    assert blocks.total == trees.total and blocks.minimum == trees.minimum
    assert torch.equal(blocks.find(prefix), trees.find(prefix))


def _last_write(index, mass):
    last = {}
    for i, m in zip(index.tolist(), mass.tolist()):
        last[i] = m
    return torch.tensor(list(last)), torch.tensor(list(last.values()), dtype=torch.float64)


def test_sampler_state_moves_between_structures(tmp_path):
    from gear_torchrl.selection.block_sums import BlockPrefixSums

    trees_sampler = GearPrioritizedSampler(500, 0.7, 0.4)
    trees_sampler.mark_update(torch.arange(300))
    trees_sampler.update_priority(torch.arange(0, 300, 3), torch.rand(100) + 0.5)
    trees_sampler.dumps(tmp_path)
    blocks_sampler = GearPrioritizedSampler(500, 0.1, 0.1)
    blocks_sampler._trees = BlockPrefixSums(500, block=32)  # what device="cuda" builds, here on the CPU
    blocks_sampler.loads(tmp_path)
    assert blocks_sampler.total_mass == pytest.approx(trees_sampler.total_mass, rel=1e-12)
    index = torch.arange(500)
    assert torch.equal(blocks_sampler._trees.get(index), trees_sampler._trees.get(index))
    assert blocks_sampler._trees.minimum == trees_sampler._trees.minimum


# -- the CPU selector's one-pass update and draw (the extension) against the tensor ops a GPU runs --


def _selectors(capacity=3000, alpha=0.5):
    """A CPU selector (its trees and update in the extension) and one over blocked prefix sums on the CPU (the
    tensor ops a GPU selector runs), both holding ``capacity`` written rows."""
    from gear_torchrl.selection.block_sums import BlockPrefixSums
    from gear_torchrl.selection.priorities import PrioritySpec

    spec = PrioritySpec(alpha=alpha, eps=1e-6)
    extension, tensor_ops = spec.build(capacity), spec.build(capacity)
    tensor_ops.trees = BlockPrefixSums(capacity, block=64)
    for selector in (extension, tensor_ops):
        selector.written(torch.arange(capacity), None)
    return extension, tensor_ops


def _same_state(a, b, capacity=3000):
    rows = torch.arange(capacity)
    assert torch.equal(a.trees.get(rows), b.trees.get(rows))
    assert float(a.max_raw_priority) == float(b.max_raw_priority)
    assert torch.equal(a.generation, b.generation)


@pytest.mark.parametrize("alpha,size", [(0.5, 700), (0.7, 700), (0.6, 1), (0.6, 9), (0.6, 67)])
def test_one_pass_update_lands_what_the_tensor_ops_land(alpha, size):
    # alpha 0.5 is a square root to torch; others take its vector and scalar pow, split by the update's size
    extension, tensor_ops = _selectors(alpha=alpha)
    g = torch.Generator().manual_seed(7)
    for step in range(6):
        rows = torch.randint(-1, 3000, (size,), generator=g)  # -1: skipped; repeats: the last one lands
        priority = torch.randint(0, 9, (size,), generator=g).double() / 4  # zeros included
        priority[::3] = torch.rand(priority[::3].shape, generator=g, dtype=torch.float64) * 3
        drawn = extension.generation[rows.clamp_min(0)].clone()
        if step % 2:
            rewritten = torch.randint(0, 3000, (200,), generator=g)
            for selector in (extension, tensor_ops):
                selector.written(rewritten, None)  # rows drawn before this write keep their masses
        for selector in (extension, tensor_ops):
            selector.update(rows, priority, drawn if step < 4 else None)
        _same_state(extension, tensor_ops)
    assert float(extension.max_raw_priority) == float(tensor_ops.max_raw_priority) > 0


@pytest.mark.parametrize(
    "rows,priority,stored,error,match",
    [
        ([3, 3000], [1.0, 1.0], None, IndexError, "priority index 3000 is out of range for 3000 rows"),
        ([-2, 5], [1.0, 1.0], None, IndexError, "priority index -2 is out of range"),
        ([3, 40], [1.0, 1.0], 40, IndexError, "priority index 40 is out of range for 40 stored rows"),
        ([3, 4, 5], [1.0, float("nan"), -1.0], None, ValueError, "got nan at position 1"),
        ([3, 4], [1.0, -0.5], None, ValueError, "got -0.5 at position 1"),
        ([3, 4], [float("inf"), 1.0], None, ValueError, "got inf at position 0"),
    ],
)
def test_one_pass_update_refuses_what_the_tensor_ops_refuse_and_changes_nothing(rows, priority, stored, error, match):
    extension, tensor_ops = _selectors()
    for selector in (extension, tensor_ops):
        selector.update(torch.arange(10), torch.full((10,), 3.0))
        with pytest.raises(error, match=match):
            selector.update(torch.tensor(rows), torch.tensor(priority), stored=stored)
    _same_state(extension, tensor_ops)
    assert float(extension.max_raw_priority) == 3.0


def test_a_seeded_draw_in_the_extension_is_the_tensor_ops_draw():
    extension, tensor_ops = _selectors()
    for selector in (extension, tensor_ops):
        selector.update(torch.arange(0, 3000, 7), torch.arange(0, 3000, 7).double() % 5)  # integers: exact sums
    a = extension.pick(None, 500, torch.Generator().manual_seed(3))
    b = tensor_ops.pick(None, 500, torch.Generator().manual_seed(3))
    assert torch.equal(a.starts, b.starts) and torch.equal(a.extra["mass"], b.extra["mass"])
    assert bool((a.extra["mass"] > 0).all())
    assert extension.pick(None, 0, None).count == 0
