"""CUDA gather (gear_torchrl.kernels._C.gather into CUDA tensors) against the CPU gather.

Every CUDA result is compared bit for bit with the CPU gather of the same
request (the CPU gather is the reference semantics). Columns live in pinned
host memory (torch .pin_memory()), in registered host memory
(_C.cuda_host_register on a plain CPU tensor) or in device memory.

Needs only torch and the compiled extension (no torchrl / tensordict), so it
runs on a bare GPU machine. Skips, with the reason, without a GPU or without
the extension's CUDA part.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from cuda_kernels import cuda_extension
from helpers import COLUMN_DTYPES

_C = cuda_extension()

DEVICE = torch.device("cuda")
TIERS = ["pinned", "registered", "device"]


# ---------------------------------------------------------------- helpers
def random_column(capacity, step_shape, dtype, gen):
    """Random bits of any dtype (NaNs included for floats); bools are 0/1."""
    shape = (capacity, *step_shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    nbytes = torch.empty(shape, dtype=dtype).element_size()
    raw = torch.randint(
        0,
        256,
        (*shape[:-1], shape[-1] * nbytes) if step_shape else (capacity * nbytes,),
        generator=gen,
        dtype=torch.uint8,
    )
    return raw.view(dtype).reshape(shape).contiguous()


PAGE = os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096


def page_aligned_empty(nbytes):
    """A CPU uint8 tensor of whole pages, alone on its pages.

    cudaHostRegister refuses a range that shares a page with a range already
    registered; plain CPU allocations may share pages, so registered tensors in
    these tests are views of page-aligned, page-rounded ranges.
    """
    rounded = max(PAGE, -(-nbytes // PAGE) * PAGE)
    backing = torch.empty(rounded + PAGE, dtype=torch.uint8)
    off = (-backing.data_ptr()) % PAGE
    return backing[off : off + rounded]


class Registered:
    """CPU tensors registered with cuda_host_register for a test's lifetime."""

    def __init__(self):
        self.kept = []

    def __call__(self, t):
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return t.clone()
        pages = page_aligned_empty(nbytes)
        host = pages[:nbytes].view(t.dtype).view(t.shape)
        host.copy_(t)
        _C.cuda_host_register(pages)
        self.kept.append(pages)
        return host

    def release(self):
        for pages in self.kept:
            _C.cuda_host_unregister(pages)
        self.kept.clear()


@pytest.fixture
def place():
    """place(tensor, tier) -> the same data in pinned, registered or device memory."""
    reg = Registered()

    def _place(t, tier):
        if tier == "pinned":
            return t.pin_memory()
        if tier == "registered":
            return reg(t)
        if tier == "device":
            return t.to(DEVICE)
        raise ValueError(tier)

    yield _place
    torch.cuda.synchronize()
    reg.release()


def as_bytes(t):
    return t.detach().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def assert_bitwise_equal(gpu, ref, what=""):
    assert gpu.shape == ref.shape and gpu.dtype == ref.dtype, what
    g = as_bytes(gpu.cpu())
    r = as_bytes(ref)
    if not torch.equal(g, r):
        bad = (g != r).nonzero()
        raise AssertionError(
            f"{what}: {bad.numel()} bytes differ, first at byte {bad[0].item()} "
            f"(gpu {g[bad[0]].item()} ref {r[bad[0]].item()})"
        )


def gather_both(columns, starts, window_len=1, valid_begin=None, valid_end=None, with_mask=False, idx_device="cpu"):
    """Run the CUDA gather on `columns` (any tier) and the CPU gather on CPU copies; compare."""
    n = starts.shape[0]
    rows = n * window_len
    cpu_cols = [c if c.device.type == "cpu" else c.cpu() for c in columns]
    ref_out = [torch.empty((rows, *c.shape[1:]), dtype=c.dtype) for c in cpu_cols]
    for o in ref_out:
        as_bytes(o).fill_(0x5A)
    ref_mask = torch.ones(rows, dtype=torch.bool) if with_mask else None
    _C.gather(
        cpu_cols, ref_out, starts, valid_begin=valid_begin, valid_end=valid_end, window_len=window_len, mask=ref_mask
    )

    outs = [torch.empty((rows, *c.shape[1:]), dtype=c.dtype, device=DEVICE) for c in columns]
    for o in outs:  # garbage everywhere: the kernel must write every byte
        as_bytes(o).fill_(0xA5)
    mask = torch.ones(rows, dtype=torch.bool, device=DEVICE) if with_mask else None
    if mask is not None:  # with_mask
        mask.view(torch.uint8).fill_(0xA5)

    def move(t):
        return None if t is None else t.to(idx_device)

    _C.gather(
        columns,
        outs,
        move(starts),
        valid_begin=move(valid_begin),
        valid_end=move(valid_end),
        window_len=window_len,
        mask=mask,
    )
    torch.cuda.synchronize()
    for k, (o, r) in enumerate(zip(outs, ref_out)):
        assert_bitwise_equal(o, r, f"column {k} ({r.dtype}, step {tuple(r.shape[1:])})")
    if with_mask:
        assert_bitwise_equal(mask, ref_mask, "mask")
    return outs, mask


# ---------------------------------------------------------------- tests
def test_built_with_cuda():
    assert _C.built_with_cuda()


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", COLUMN_DTYPES, ids=str)
def test_rows_every_dtype(tier, dtype, place):
    gen = torch.Generator().manual_seed(1)
    capacity = 1000
    cols = [place(random_column(capacity, shape, dtype, gen), tier) for shape in [(), (3,), (5, 7), (64,)]]
    starts = torch.randint(-3 * capacity, 3 * capacity, (4096,), generator=gen)
    gather_both(cols, starts)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", COLUMN_DTYPES, ids=str)
def test_windows_every_dtype_padding_and_mask(tier, dtype, place):
    gen = torch.Generator().manual_seed(2)
    capacity, window_len, n = 500, 16, 300
    cols = [place(random_column(capacity, shape, dtype, gen), tier) for shape in [(), (3,), (33,)]]
    starts = torch.randint(-capacity, capacity, (n,), generator=gen)
    begin = torch.randint(-2, window_len + 2, (n,), generator=gen)  # clamped by the gather
    end = torch.randint(-2, window_len + 3, (n,), generator=gen)
    gather_both(cols, starts, window_len, begin, end, with_mask=True)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("row_bytes", [1, 2, 3, 5, 7, 12, 16, 17, 100, 4096, 4100, 65536])
@pytest.mark.parametrize("window_len", [1, 7, 64])
def test_odd_row_sizes(tier, row_bytes, window_len, place):
    """Row sizes that give every source/destination alignment mod 16."""
    gen = torch.Generator().manual_seed(row_bytes * 100 + window_len)
    capacity = max(8, min(4000, (64 << 20) // (row_bytes * 16)))
    n = max(1, min(512, (32 << 20) // (row_bytes * window_len)))
    cols = [place(random_column(capacity, (row_bytes,), torch.uint8, gen), tier)]
    if row_bytes % 2 == 0:
        cols.append(place(random_column(capacity, (row_bytes // 2,), torch.bfloat16, gen), tier))
    starts = torch.randint(-2 * capacity, 2 * capacity, (n,), generator=gen)
    begin = torch.randint(0, window_len, (n,), generator=gen) if window_len > 1 else None
    end = torch.randint(0, window_len + 1, (n,), generator=gen) if window_len > 1 else None
    gather_both(cols, starts, window_len, begin, end, with_mask=window_len > 1)


@pytest.mark.parametrize("tier", TIERS)
def test_mixed_columns_one_call(tier, place):
    """A realistic table: image obs, vector obs, action, reward, done, bf16 logits."""
    gen = torch.Generator().manual_seed(3)
    capacity = 2048
    specs = [
        ((4, 21, 21), torch.uint8),
        ((17,), torch.float32),
        ((), torch.int64),
        ((), torch.float32),
        ((), torch.bool),
        ((6,), torch.bfloat16),
        ((3,), torch.int16),
        ((2, 2), torch.float64),
    ]
    cols = [place(random_column(capacity, s, d, gen), tier) for s, d in specs]
    n, window_len = 256, 40
    starts = torch.randint(0, capacity, (n,), generator=gen)
    begin = torch.randint(0, 10, (n,), generator=gen)
    end = torch.randint(30, window_len + 1, (n,), generator=gen)
    gather_both(cols, starts, window_len, begin, end, with_mask=True)
    gather_both(cols, starts[:5], 1)


@pytest.mark.parametrize("tier", TIERS)
def test_ring_wrap_and_negative_starts(tier, place):
    gen = torch.Generator().manual_seed(4)
    capacity, window_len = 50, 20
    cols = [
        place(random_column(capacity, (9,), torch.float32, gen), tier),
        place(random_column(capacity, (), torch.uint8, gen), tier),
    ]
    starts = torch.tensor([capacity - 1, capacity - 5, -1, -capacity, -7 * capacity - 3, 10**12, -(10**12) + 7, 0])
    gather_both(cols, starts, window_len)
    gather_both(cols, starts, window_len, torch.full_like(starts, 3), torch.full_like(starts, 15), with_mask=True)


@pytest.mark.parametrize("tier", TIERS)
def test_window_longer_than_ring(tier, place):
    gen = torch.Generator().manual_seed(5)
    capacity, window_len = 7, 50
    cols = [
        place(random_column(capacity, (5,), torch.int32, gen), tier),
        place(random_column(capacity, (), torch.bool, gen), tier),
    ]
    starts = torch.randint(-20, 20, (33,), generator=gen)
    begin = torch.randint(-1, 10, (33,), generator=gen)
    end = torch.randint(10, 60, (33,), generator=gen)
    gather_both(cols, starts, window_len, begin, end, with_mask=True)


@pytest.mark.parametrize("idx_device", ["cpu", "cuda"])
def test_indices_on_either_device(idx_device, place):
    gen = torch.Generator().manual_seed(6)
    capacity, window_len, n = 300, 12, 77
    cols = [
        place(random_column(capacity, (11,), torch.float16, gen), "pinned"),
        place(random_column(capacity, (4,), torch.float32, gen), "device"),
    ]  # tiers mix in one call
    starts = torch.randint(-500, 500, (n,), generator=gen)
    begin = torch.randint(0, 6, (n,), generator=gen)
    end = torch.randint(6, 13, (n,), generator=gen)
    gather_both(cols, starts, window_len, begin, end, with_mask=True, idx_device=idx_device)
    gather_both(cols, starts, window_len, None, end, with_mask=True, idx_device=idx_device)
    gather_both(cols, starts, window_len, begin, None, with_mask=False, idx_device=idx_device)


def test_misaligned_column_views(place):
    """Contiguous views at odd byte offsets inside one pinned / registered / device buffer."""
    gen = torch.Generator().manual_seed(7)
    capacity, row = 1000, 37
    for tier in TIERS:
        backing = place(torch.randint(0, 256, (capacity * row * 3 + 64,), generator=gen, dtype=torch.uint8), tier)
        cols = [backing[off : off + capacity * row].view(capacity, row) for off in (1, 3, 8, 13)]
        cols.append(
            backing[capacity * row * 2 + 2 : capacity * row * 2 + 2 + capacity * 16].view(torch.int16).view(capacity, 8)
        )
        starts = torch.randint(-capacity, capacity, (500,), generator=gen)
        gather_both(cols, starts)
        gather_both(cols, starts[:50], 9, torch.full((50,), 2), torch.full((50,), 8), with_mask=True)


def test_many_columns(place):
    gen = torch.Generator().manual_seed(8)
    capacity = 64
    cols = [
        place(random_column(capacity, (1 + k % 13,), COLUMN_DTYPES[k % len(COLUMN_DTYPES)], gen), TIERS[k % 2 * 2])
        for k in range(150)
    ]
    starts = torch.randint(0, capacity, (40,), generator=gen)
    gather_both(cols, starts, 5, torch.randint(0, 3, (40,), generator=gen), None, with_mask=True)


def test_empty_batch_and_empty_rows(place):
    gen = torch.Generator().manual_seed(9)
    cols = [place(random_column(10, (4,), torch.float32, gen), "pinned"), place(torch.empty(10, 0), "device")]
    gather_both(cols, torch.empty(0, dtype=torch.int64), 3, with_mask=True)
    gather_both(cols, torch.tensor([1, 2, 3]), 3, with_mask=True)


def test_runs_on_current_stream(place):
    gen = torch.Generator().manual_seed(10)
    src = place(random_column(4096, (1024,), torch.uint8, gen), "pinned")
    starts = torch.randint(0, 4096, (2048,), generator=gen)
    ref = src[starts % 4096]
    side = torch.cuda.Stream()
    out = torch.empty(2048, 1024, dtype=torch.uint8, device=DEVICE)
    with torch.cuda.stream(side):
        out.zero_()
        _C.gather([src], [out], starts)
        copy = out.clone()  # ordered after the gather on the same stream
    side.synchronize()
    assert torch.equal(copy.cpu(), ref)


def test_unpinned_cpu_column_is_a_clear_error():
    col = torch.zeros(100, 8)  # pageable
    out = torch.empty(4, 8, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"column 0 .*pageable CPU memory.*pin_memory"):
        _C.gather([col], [out], torch.tensor([0, 1, 2, 3]))
    pinned = torch.zeros(100, 8).pin_memory()
    with pytest.raises(RuntimeError, match=r"column 1 "):
        _C.gather([pinned, col], [out, torch.empty(4, 8, device=DEVICE)], torch.tensor([0, 1, 2, 3]))
    torch.cuda.synchronize()  # the error left no sticky CUDA error behind
    _C.gather([pinned], [out], torch.tensor([0, 1, 2, 3]))
    torch.cuda.synchronize()


def test_register_errors_are_clear():
    t = page_aligned_empty(1 << 20)
    _C.cuda_host_register(t)
    try:
        with pytest.raises(RuntimeError, match="cuda_host_register.*already"):
            _C.cuda_host_register(t)
    finally:
        _C.cuda_host_unregister(t)
    with pytest.raises(RuntimeError, match="cuda_host_unregister"):
        _C.cuda_host_unregister(t)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        _C.cuda_host_register(torch.zeros(4, device=DEVICE))
    with pytest.raises(RuntimeError, match="contiguous"):
        _C.cuda_host_register(torch.zeros(64, 64).t())
    # CUDA still works after the failed calls.
    torch.cuda.synchronize()
    assert torch.zeros(3, device=DEVICE).sum().item() == 0


def _free_host_bytes():
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


@pytest.mark.large
@pytest.mark.parametrize("tier", ["pinned", "registered", "device"])
def test_table_larger_than_4gib(tier):
    """Rows past the 4 GiB mark: 64-bit offsets in the kernel and the host glue."""
    row = 4096
    capacity = (4 << 30) // row + 300_000  # about 5.2 GiB
    nbytes = capacity * row
    if tier == "device":
        free, _ = torch.cuda.mem_get_info()
        if free < nbytes + (1 << 30):
            pytest.skip(f"needs {nbytes / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    elif _free_host_bytes() < 2 * nbytes + (4 << 30):
        pytest.skip(
            f"needs about {2 * nbytes / 2**30:.1f} GiB of free host memory, "
            f"{_free_host_bytes() / 2**30:.1f} GiB available"
        )
    gen = torch.Generator().manual_seed(11)
    n, window_len = 512, 4
    starts = torch.cat(
        [
            torch.randint(capacity - 200_000, capacity, (n - 8,), generator=gen),
            torch.tensor([capacity - 1, capacity - 2, -1, 0, 1, (4 << 30) // row, (4 << 30) // row - 1, capacity - 3]),
        ]
    )
    touched = torch.unique(torch.cat([(starts + j) % capacity for j in range(window_len)]))
    if tier == "registered":
        table = page_aligned_empty(nbytes).view(capacity, row)
    else:
        table = torch.empty(capacity, row, dtype=torch.uint8, pin_memory=True)
    table[touched] = torch.randint(0, 256, (touched.numel(), row), generator=gen, dtype=torch.uint8)
    expected = table[(starts[:, None] + torch.arange(window_len)).reshape(-1) % capacity]
    if tier == "registered":
        _C.cuda_host_register(table)
    try:
        src = table.to(DEVICE) if tier == "device" else table
        out = torch.empty(n * window_len, row, dtype=torch.uint8, device=DEVICE)
        _C.gather([src], [out], starts, window_len=window_len)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), expected)
        del src
    finally:
        if tier == "registered":
            _C.cuda_host_unregister(table)
    del table
    torch.cuda.empty_cache()


def test_kernel_source_compiles_with_nvrtc_via_cupy():
    """The CuPy run-time path (the same kernel file, compiled by NVRTC) gathers the same bytes."""
    pytest.importorskip("cupy")
    from gear_torchrl.kernels import cupy_kernels

    gen = torch.Generator().manual_seed(12)
    capacity, window_len, n = 300, 10, 97
    cols = [
        random_column(capacity, (7,), torch.uint8, gen).pin_memory(),
        random_column(capacity, (32,), torch.float32, gen).to(DEVICE),
    ]
    starts = torch.randint(-400, 400, (n,), generator=gen)
    begin = torch.randint(0, 4, (n,), generator=gen)
    end = torch.randint(5, 11, (n,), generator=gen)
    ref = [torch.empty(n * window_len, *c.shape[1:], dtype=c.dtype) for c in cols]
    ref_mask = torch.empty(n * window_len, dtype=torch.bool)
    _C.gather([c.cpu() for c in cols], ref, starts, begin, end, window_len, ref_mask)

    outs = [torch.full((n * window_len, *c.shape[1:]), 7, dtype=c.dtype, device=DEVICE) for c in cols]
    mask = torch.ones(n * window_len, dtype=torch.bool, device=DEVICE)
    cupy_kernels.gather(cols, outs, starts, begin, end, window_len, mask)
    torch.cuda.synchronize()
    for o, r in zip(outs, ref):
        assert_bitwise_equal(o, r, "cupy kernel")
    assert_bitwise_equal(mask, ref_mask, "cupy mask")


if os.environ.get("GEAR_GPU_TEST_DEBUG"):
    print("gear_torchrl.kernels._C from", getattr(_C, "__file__", "?"), file=sys.stderr)
