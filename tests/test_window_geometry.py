"""The window geometry kernels against the tensor formulas they replace."""

from __future__ import annotations

import pytest
import torch

from gear_torchrl.kernels import _C


def episodes(n=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    length = torch.randint(1, 200, (n,), generator=g)
    start = torch.cumsum(length, 0) - length + 7
    return start, length


def reference(start, length, slots, first, window_len):
    """The sampler's former tensor code: position 0 at ``first`` steps into the episode."""
    starts = start[slots] + first
    valid_begin = (-first).clamp_min(0)
    valid_end = torch.minimum(length[slots] - first, torch.full_like(first, window_len))
    return starts, valid_begin, valid_end


@pytest.mark.parametrize("strict_length", [True, False])
@pytest.mark.parametrize("burn_in", [0, 5])
def test_uniform_windows_match_the_tensor_formulas(strict_length, burn_in):
    start, length = episodes()
    window_len = burn_in + 16
    tail = window_len - 1 if strict_length else 0
    eligible = torch.nonzero(length > tail).flatten()
    g = torch.Generator().manual_seed(1)
    slots = eligible[torch.randint(0, eligible.numel(), (4000,), generator=g)]
    u = torch.rand(4000, dtype=torch.float64, generator=g)
    u[:3] = torch.tensor([0.0, 1.0 - 2**-53, 0.5])  # the ends of [0, 1)
    got = _C.uniform_windows(start, length, slots, u, window_len, burn_in, strict_length)

    choices = (length[slots] - tail).clamp_min(0)
    offset = (u * choices).long().clamp_max(choices - 1)
    first = offset if strict_length else offset - burn_in
    for g_, r in zip(got, reference(start, length, slots, first, window_len)):
        assert torch.equal(g_, r)
    # every offset of a short episode is reachable: the draw is uniform over its windows
    one = int(eligible[0])
    hits = _C.uniform_windows(
        start,
        length,
        torch.full((20000,), one),
        torch.rand(20000, dtype=torch.float64),
        window_len,
        burn_in,
        strict_length,
    )[0]
    assert hits.unique().numel() == int(length[one] - tail)


def test_place_windows_pads_head_and_tail():
    start, length = torch.tensor([100]), torch.tensor([10])
    first = torch.tensor([-3, 0, 4, 8])
    starts, begin, end = _C.place_windows(start, length, torch.zeros(4, dtype=torch.int64), first, 6)
    assert starts.tolist() == [97, 100, 104, 108]
    assert begin.tolist() == [3, 0, 0, 0]
    assert end.tolist() == [6, 6, 6, 2]


@pytest.mark.parametrize("window_len,capacity", [(8, 100), (8, 5), (1, 3)])
def test_window_rows_wrap_the_ring(window_len, capacity):
    starts = torch.tensor([0, capacity - 1, -2, 3 * capacity + 1, 37])
    expected = ((starts % capacity)[:, None] + torch.arange(window_len)) % capacity
    assert torch.equal(_C.window_rows(starts, window_len, capacity), expected.reshape(-1))


def test_bad_arguments_are_refused():
    start, length = episodes(5)
    with pytest.raises(RuntimeError, match="slot 5 out of range"):
        _C.place_windows(start, length, torch.tensor([0, 5]), torch.zeros(2, dtype=torch.int64), 4)
    with pytest.raises(RuntimeError, match="u must be"):
        _C.uniform_windows(start, length, torch.tensor([0]), torch.rand(1), 4, 0, True)
    with pytest.raises(RuntimeError, match="one entry per slot"):
        _C.place_windows(start, length, torch.tensor([0, 1]), torch.zeros(3, dtype=torch.int64), 4)
    with pytest.raises(RuntimeError, match="int64"):
        _C.window_rows(torch.tensor([0.5]), 4, 10)


def test_window_mask_matches_the_tensor_formula():
    begin, end = torch.tensor([0, 2, 3, 0, 5]), torch.tensor([5, 5, 3, 1, 5])
    pos = torch.arange(5)
    expected = ((pos >= begin[:, None]) & (pos < end[:, None])).reshape(-1)
    assert torch.equal(_C.window_mask(begin, end, 5), expected)
    with pytest.raises(RuntimeError, match="differ in length"):
        _C.window_mask(begin, end[:2], 5)


def test_check_windows_names_the_bad_window():
    starts, begin, end = torch.tensor([0, 9]), torch.tensor([0, 0]), torch.tensor([4, 4])
    _C.check_windows(starts, begin, end, 4, 10)  # in bounds: no error
    with pytest.raises(IndexError, match="row 10 is out of range for a shard of 10 rows"):
        _C.check_windows(torch.tensor([0, 10]), begin, end, 4, 10)
    with pytest.raises(IndexError, match=r"window 1 has \[3, 2\)"):
        _C.check_windows(starts, torch.tensor([0, 3]), torch.tensor([4, 2]), 4, 10)
    with pytest.raises(IndexError, match="valid_end <= window_len"):
        _C.check_windows(starts, begin, torch.tensor([4, 5]), 4, 10)
    with pytest.raises(ValueError, match="window_len 11 is outside"):
        _C.check_windows(starts, begin, end, 11, 10)
    with pytest.raises(ValueError, match="differ in length"):
        _C.check_windows(starts, begin, torch.tensor([4]), 4, 10)


@pytest.mark.parametrize("lo,hi", [(0, 10), (3, 8), (7, 12), (15, 40), (9, 9)])
def test_first_row_outside_matches_the_position_formula(lo, hi):
    """Rows readable in positions [lo, hi) of a ring of 10: the shared store's check, row by row."""
    capacity, window_len = 10, 3
    starts = torch.arange(capacity)
    begin, end = torch.zeros(capacity, dtype=torch.int64), torch.full((capacity,), window_len)
    end[4] = 1  # a window whose tail is padding: its padded rows are not checked
    rows = torch.cat([(s + torch.arange(int(e))) % capacity for s, e in zip(starts, end)])
    newest = hi - 1 - (hi - 1 - rows) % capacity
    stale = rows[newest < lo]
    got = _C.first_row_outside(starts, begin, end, window_len, capacity, lo % capacity, hi - lo)
    assert got == (int(stale[0]) if stale.numel() else -1)


@pytest.mark.parametrize("strict_length", [True, False])
def test_draw_windows_is_the_tree_search_then_a_uniform_window(strict_length):
    """One kernel draws what the two calls it replaced drew, from the same uniforms."""
    from gear_torchrl.selection.trees import PriorityTrees

    start, length = episodes()
    trees = PriorityTrees(start.numel())
    trees.set(torch.arange(start.numel()), (length - 15).clamp_min(0).double())
    u = torch.rand(2, 500, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = _C.draw_windows(trees.sum, start, length, u, 16, 4, strict_length)
    slots = _C.sum_tree_find(trees.sum, u[0] * trees.total)
    for g_, r in zip(got, _C.uniform_windows(start, length, slots, u[1].contiguous(), 16, 4, strict_length)):
        assert torch.equal(g_, r)
    with pytest.raises(RuntimeError, match="tree must be"):
        _C.draw_windows(torch.zeros(0, dtype=torch.float32), start, length, u, 16, 4, strict_length)
    with pytest.raises(RuntimeError, match="u must be"):
        _C.draw_windows(trees.sum, start, length, torch.rand(3, 5, dtype=torch.float64), 16, 4, strict_length)
    with pytest.raises(RuntimeError, match="of one length"):
        _C.draw_windows(trees.sum, start, length[:-1], u, 16, 4, strict_length)
    with pytest.raises(RuntimeError, match="burn_in < window_len"):
        _C.draw_windows(trees.sum, start, length, u, 4, 4, strict_length)
