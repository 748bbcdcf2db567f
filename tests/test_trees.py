"""The extension's float64 trees against a plain oracle: every node, the search, the kept entries."""

from __future__ import annotations

import pytest
import torch

from gear_torchrl.selection.trees import PriorityTrees, ScoreTree


def levels_from_leaves(leaves: torch.Tensor, combine) -> list[torch.Tensor]:
    """Each level of an 8-ary tree over ``leaves`` (a power of 8 of them), root level last."""
    out = [leaves]
    while out[-1].numel() > 1:
        out.append(combine(out[-1].reshape(-1, 8)))
    return out


def stored_levels(tree: torch.Tensor, leaf_count: int) -> list[torch.Tensor]:
    """The same levels read from the flat layout of csrc/kernels/trees.h (level k >= 1 starts at 8 + (8^k - 8) / 7)."""
    depth = len(f"{leaf_count:o}") - 1  # leaf_count == 8 ** depth
    out = []
    for k in range(depth, 0, -1):
        start = 8 + (8**k - 8) // 7
        out.append(tree[start : start + 8**k])
    return [*out, tree[:1]]


def write_in_order(values: torch.Tensor, index: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The oracle of a batched set: entries applied one by one, so a repeated index keeps its last value."""
    for i, v in zip(index.tolist(), new.tolist()):
        values[i] = v
    return values


@pytest.mark.parametrize("capacity,count", [(1, 1), (9, 40), (700, 5), (4096, 4096), (100_000, 6_000)])
def test_priority_trees_match_the_oracle_at_every_node(capacity, count):
    g = torch.Generator().manual_seed(capacity)
    trees = PriorityTrees(capacity)
    expected = torch.zeros(capacity, dtype=torch.float64)
    for _ in range(3):  # batches with repeats, zeros, and entries dropped by `keep`
        index = torch.randint(0, capacity, (count,), generator=g)
        mass = torch.randint(0, 6, (count,), generator=g).double()  # integers: every sum is exact
        keep = torch.rand(count, generator=g) < 0.7
        trees.set(index, mass, keep)
        write_in_order(expected, index[keep], mass[keep])
        leaf_count = trees.sum.numel() - trees._leaf
        padded = torch.zeros(leaf_count, dtype=torch.float64)
        padded[:capacity] = expected
        sums = levels_from_leaves(padded, lambda x: x.sum(1))
        mins = levels_from_leaves(torch.where(padded > 0, padded, torch.inf), lambda x: x.min(1).values)
        for level, (want_sum, want_min) in enumerate(zip(sums, mins)):
            assert torch.equal(stored_levels(trees.sum, leaf_count)[level], want_sum), f"sum level {level}"
            if level > 0:  # the min tree's leaves keep zeros as +inf too
                assert torch.equal(stored_levels(trees.min, leaf_count)[level], want_min), f"min level {level}"
        assert trees.total == float(expected.sum())
        assert trees.minimum == float(torch.where(expected > 0, expected, torch.inf).min())
        if trees.total > 0:
            prefix = torch.rand(count + 37, generator=g, dtype=torch.float64) * trees.total
            prefix[:2] = torch.tensor([0.0, trees.total])  # the ends: first row with mass, last row with mass
            want = torch.searchsorted(expected.cumsum(0), prefix, right=True).clamp_max(capacity - 1)
            want[1] = int(expected.nonzero().max())
            assert torch.equal(trees.find(prefix), want)


def test_keep_must_match_the_index():
    trees = PriorityTrees(10)
    with pytest.raises(RuntimeError, match="keep must be a 1-D bool tensor with 3 elements"):
        trees.set(torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.float64), torch.tensor([True, False]))
    assert trees.total == 0.0


def test_score_tree_keeps_the_maximum_at_every_node():
    g = torch.Generator().manual_seed(1)
    capacity, count = 5000, 3000
    tree = ScoreTree(capacity)
    index = torch.randint(0, capacity, (count,), generator=g)
    score = torch.randn(count, generator=g, dtype=torch.float64)
    tree.set(index, score)
    expected = write_in_order(torch.full((capacity,), float("-inf"), dtype=torch.float64), index, score)
    leaf_count = 8 ** len(f"{capacity - 1:o}")
    padded = torch.full((leaf_count,), float("-inf"), dtype=torch.float64)
    padded[:capacity] = expected
    for level, want in enumerate(levels_from_leaves(padded, lambda x: x.max(1).values)):
        assert torch.equal(stored_levels(tree.max, leaf_count)[level], want), f"max level {level}"
    assert torch.equal(tree.top(10), expected.topk(10).indices)


@pytest.mark.parametrize("count", [1, 7, 1000, 5000])
def test_a_tree_draw_is_what_torch_rand_draws_found_in_the_tree(count):
    """The extension draws its uniforms without the dispatcher (``uniforms_into``): the same numbers as
    ``torch.rand``'s from the same generator, seeded or the global one."""
    from gear_torchrl.kernels import _C

    trees = PriorityTrees(5000)
    trees.set(torch.arange(5000), torch.rand(5000, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    drawn = _C.sum_tree_draw(trees.sum, count, torch.Generator().manual_seed(count))
    uniforms = torch.rand(count, dtype=torch.float64, generator=torch.Generator().manual_seed(count))
    assert torch.equal(drawn, _C.sum_tree_find(trees.sum, uniforms * trees.total))
    torch.manual_seed(count)
    drawn = _C.sum_tree_draw(trees.sum, count, None)
    torch.manual_seed(count)
    assert torch.equal(drawn, _C.sum_tree_find(trees.sum, torch.rand(count, dtype=torch.float64) * trees.total))
