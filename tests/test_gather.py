"""The extension's gather against plain indexing: rows, windows, padding, ring wrap, every dtype."""

from __future__ import annotations

import pytest
import torch
from helpers import COLUMN_DTYPES

from gear_torchrl.kernels import _C, gather


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (random bytes read as floats include NaNs)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def column(capacity, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (capacity, *shape, dtype.itemsize), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        return raw[..., 0] % 2 == 1
    return raw.view(dtype).squeeze(-1) if dtype.itemsize > 1 else raw.squeeze(-1).view(dtype)


@pytest.mark.parametrize("dtype", COLUMN_DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (3,), (5, 7), (1025,)])
def test_rows_match_index_select(dtype, shape):
    col = column(97, shape, dtype)
    rows = torch.randint(0, 97, (300,))
    (out,) = gather.gather_rows([col], rows, torch.device("cpu"))
    assert same_bits(out, col[rows])


def reference_windows(col, starts, window_len, begin, end):
    cap = col.shape[0]
    out = torch.zeros((starts.numel() * window_len, *col.shape[1:]), dtype=col.dtype)
    mask = torch.zeros(starts.numel() * window_len, dtype=torch.bool)
    for i, s in enumerate(starts.tolist()):
        for j in range(window_len):
            if begin[i] <= j < end[i]:
                out[i * window_len + j] = col[(s + j) % cap]
                mask[i * window_len + j] = True
    return out, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64])
def test_windows_with_padding_and_wrap(dtype):
    cap, window_len = 23, 6
    cols = [column(cap, (3,), dtype, 1), column(cap, (), torch.uint8, 2)]
    starts = torch.tensor([0, 20, -3, 17, 5, 100])
    begin = torch.tensor([0, 0, 2, 1, 6, -4])
    end = torch.tensor([6, 6, 6, 4, 6, 99])
    out, mask = gather.gather_windows(cols, starts, window_len, torch.device("cpu"), begin, end)
    for c, o in zip(cols, out):
        want, want_mask = reference_windows(c, starts, window_len, begin.clamp(0, window_len), end.clamp(0, window_len))
        assert same_bits(o, want)
        assert torch.equal(mask, want_mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.int64])
def test_one_row_windows_are_rows_or_padding(dtype):
    """Windows of one row (an owner's prioritized picks) take the rows' copy: each row read, or zeros where its
    valid range is empty; enough of them that the copy reads ahead, with starts past the ring's end."""
    cap, n = 1009, 3000
    g = torch.Generator().manual_seed(3)
    cols = [column(cap, (7,), dtype, 4), column(cap, (), torch.uint8, 5), column(cap, (84,), torch.float32, 6)]
    starts = torch.randint(-cap, 3 * cap, (n,), generator=g)
    begin = torch.randint(-1, 2, (n,), generator=g)
    end = torch.randint(0, 3, (n,), generator=g)
    out, mask = gather.gather_windows(cols, starts, 1, torch.device("cpu"), begin, end)
    valid = (begin <= 0) & (end >= 1)
    assert torch.equal(mask, valid) and 0 < int(valid.sum()) < n
    for c, o in zip(cols, out):
        want = torch.zeros_like(o)
        want[valid] = c[starts[valid] % cap]
        assert same_bits(o, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.int64])
def test_runs_of_consecutive_rows_read_as_rows(dtype):
    """A packed batch's tokens: runs of consecutive rows (one copy each) broken by padding, by a jump and by
    the ring's end, starts past the end included; the same bytes as reading each row."""
    cap = 503
    g = torch.Generator().manual_seed(4)
    cols = [column(cap, (7,), dtype, 7), column(cap, (), torch.uint8, 8)]
    lengths = torch.randint(1, 60, (80,), generator=g)
    firsts = torch.randint(-cap, 2 * cap, (80,), generator=g)
    firsts[3], lengths[3] = cap - 5, 20  # a run across the ring's end
    rows = torch.cat([f + torch.arange(int(n)) for f, n in zip(firsts, lengths)])
    valid = (torch.rand(rows.numel(), generator=g) > 0.05).to(torch.int64)  # padding inside runs too
    out, mask = gather.gather_windows(cols, rows, 1, torch.device("cpu"), torch.zeros_like(valid), valid)
    assert torch.equal(mask, valid.bool())
    for c, o in zip(cols, out):
        want = torch.zeros_like(o)
        want[valid.bool()] = c[rows[valid.bool()] % cap]
        assert same_bits(o, want)


def test_window_longer_than_the_ring():
    col = torch.arange(5)
    out, mask = gather.gather_windows([col], torch.tensor([3]), 12, torch.device("cpu"))
    assert torch.equal(out[0], torch.tensor([3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]))
    assert bool(mask.all())


def test_many_threads_same_answer():
    col = column(10_000, (64,), torch.float32)
    rows = torch.randint(0, 10_000, (50_000,))
    torch.set_num_threads(2)
    (out,) = gather.gather_rows([col], rows, torch.device("cpu"))
    assert same_bits(out, col[rows])


def test_argument_errors_are_python_exceptions():
    col = torch.zeros(10, 3)
    with pytest.raises(RuntimeError, match="column 0 is Float but its output is Double"):
        _C.gather([col], [torch.zeros(2, 3, dtype=torch.float64)], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="must have 2 rows"):
        _C.gather([col], [torch.zeros(3, 3)], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="starts must be a 1-D int64"):
        _C.gather([col], [torch.zeros(2, 3)], torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="contiguous"):
        _C.gather([torch.zeros(3, 10).t()], [torch.zeros(2, 3)], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="empty table"):
        _C.gather([torch.zeros(0, 3)], [torch.zeros(2, 3)], torch.tensor([0, 1]))


def test_large_local_columns_ask_for_huge_pages():
    from pathlib import Path

    from gear_torchrl.store.huge_pages import advise_huge_pages, empty_huge

    small = empty_huge((1000,), torch.float32)
    assert small.shape == (1000,) and small.dtype == torch.float32
    assert not advise_huge_pages(small)  # below the size worth asking for
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip(f"transparent huge pages are off or absent here ({mode}): nothing to grant")
    big = torch.empty(16 << 20, dtype=torch.uint8)
    assert advise_huge_pages(big)
