"""The hot tier on a GPU: rows that own their slot come from GPU memory, the rest from host memory.

The tier's copies are made to differ from the host rows on purpose, so every
test sees where each byte came from, against an oracle written with plain
indexing. Needs only torch and the extension for the kernel tests; the storage
tests need torchrl/tensordict.
"""

from __future__ import annotations

import pytest
import torch
from cuda_kernels import cuda_extension

_C = cuda_extension()

DEVICE = torch.device("cuda")


def random_bytes(shape, gen):
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def owner_after_appends(slots: int, capacity: int, written: int) -> torch.Tensor:
    """Who owns each slot after rows 0, 1, ... (mod capacity) were appended ``written`` times."""
    owner = torch.full((slots,), -1, dtype=torch.int64)
    for t in range(max(0, written - 3 * capacity), written):  # enough laps to settle every slot
        r = t % capacity
        owner[r % slots] = r
    return owner


def owner_random(slots: int, capacity: int, gen) -> torch.Tensor:
    """Each slot owned by a random row of its residue, or by none."""
    owner = torch.full((slots,), -1, dtype=torch.int64)
    for s in range(slots):
        candidates = torch.arange(s, capacity, slots)
        pick = int(torch.randint(0, candidates.numel() + 1, (1,), generator=gen))
        if pick < candidates.numel():
            owner[s] = candidates[pick]
    return owner


def oracle(host, hot, owner, starts, window_len, begin=None, end=None):
    """What a gather with a hot tier must return, by plain indexing (CPU tensors)."""
    capacity, slots = host.shape[0], owner.numel()
    rows = (starts[:, None] + torch.arange(window_len)) % capacity
    slot = rows % slots
    out = host[rows]
    from_hot = owner[slot] == rows
    out[from_hot] = hot[slot[from_hot]]
    pos = torch.arange(window_len)
    b = torch.zeros_like(starts) if begin is None else begin.clamp(0, window_len)
    e = torch.full_like(starts, window_len) if end is None else torch.maximum(end, b).clamp(max=window_len)
    out[~((pos >= b[:, None]) & (pos < e[:, None]))] = 0
    return out.reshape(-1, *host.shape[1:]), from_hot


@pytest.mark.parametrize("row_bytes", [3, 12, 1024])
@pytest.mark.parametrize("window_len", [1, 5, 64])
@pytest.mark.parametrize("owners", ["appends", "random"])
def test_each_row_comes_from_its_tier(row_bytes, window_len, owners):
    gen = torch.Generator().manual_seed(row_bytes * 100 + window_len)
    capacity, slots, n = 1000, 137, 300  # slots divide neither the capacity nor a window
    host = random_bytes((capacity, row_bytes), gen).pin_memory()
    hot = random_bytes((slots, row_bytes), gen)
    owner = owner_after_appends(slots, capacity, 2345) if owners == "appends" else owner_random(slots, capacity, gen)
    starts = torch.randint(-capacity, 2 * capacity, (n,), generator=gen)
    begin = torch.randint(-1, window_len, (n,), generator=gen) if window_len > 1 else None
    end = torch.randint(0, window_len + 2, (n,), generator=gen) if window_len > 1 else None
    want, from_hot = oracle(host, hot, owner, starts, window_len, begin, end)
    assert 0 < int(from_hot.sum()) < from_hot.numel(), "the case must mix both tiers"

    out = torch.full((n * window_len, row_bytes), 0xA5, dtype=torch.uint8, device=DEVICE)
    mask = torch.empty(n * window_len, dtype=torch.bool, device=DEVICE) if window_len > 1 else None
    _C.gather(
        [host], [out], starts, begin, end, window_len, mask, hot_columns=[hot.to(DEVICE)], hot_owner=owner.to(DEVICE)
    )
    got = out.cpu()
    bad = (got != want).any(-1).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} rows differ, first at output row {int(bad[0])}"


def test_many_columns_and_device_indices():
    gen = torch.Generator().manual_seed(3)
    capacity, slots, n, window_len = 500, 64, 128, 16
    shapes = [(4,), (33,), (1,), (2, 5)]
    hosts = [random_bytes((capacity, *s), gen).pin_memory() for s in shapes]
    hots = [random_bytes((slots, *s), gen) for s in shapes]
    owner = owner_after_appends(slots, capacity, 777)
    starts = torch.randint(0, capacity, (n,), generator=gen)
    outs = [torch.empty((n * window_len, *s), dtype=torch.uint8, device=DEVICE) for s in shapes]
    _C.gather(
        hosts,
        outs,
        starts.to(DEVICE),
        window_len=window_len,
        hot_columns=[h.to(DEVICE) for h in hots],
        hot_owner=owner.to(DEVICE),
    )
    for host, hot, out in zip(hosts, hots, outs):
        want, _ = oracle(host, hot, owner, starts, window_len)
        assert torch.equal(out.cpu(), want)


def test_hot_tier_argument_errors():
    host = torch.zeros(10, 4, dtype=torch.uint8).pin_memory()
    out = torch.empty(3, 4, dtype=torch.uint8, device=DEVICE)
    starts = torch.tensor([0, 1, 2])
    hot = torch.zeros(5, 4, dtype=torch.uint8, device=DEVICE)
    owner = torch.full((5,), -1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(RuntimeError, match="hot_columns without hot_owner"):
        _C.gather([host], [out], starts, hot_columns=[hot])
    with pytest.raises(RuntimeError, match="hot column 0 must be"):
        _C.gather([host], [out], starts, hot_columns=[hot[:4]], hot_owner=owner)
    with pytest.raises(RuntimeError, match="hot_owner must be on the outputs' device"):
        _C.gather([host], [out], starts, hot_columns=[hot], hot_owner=owner.cpu())
    with pytest.raises(RuntimeError, match="1 hot columns for 2 columns"):
        _C.gather([host, host], [out, out.clone()], starts, hot_columns=[hot], hot_owner=owner)


# ---------------------------------------------------------------- through GearStorage
try:
    from helpers import as_td  # tests/helpers.py, which imports torchrl
    from tensordict import TensorDict

    from gear_torchrl import GearStorage
    from gear_torchrl.store.windows import Windows

    HAVE_TORCHRL = True
except ImportError as err:  # the GPU machine needs the carried torchrl/tensordict wheels
    HAVE_TORCHRL, WHY = False, str(err)


def steps(n, seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(n, 33, generator=g),
            "action": torch.randint(0, 5, (n,), generator=g),
            ("next", "done"): torch.rand(n, 1, generator=g) < 0.05,
        },
        [n],
    )


@pytest.mark.skipif(not HAVE_TORCHRL, reason="torchrl/tensordict not importable; carry their wheels")
def test_storage_with_hot_rows_reads_what_the_plain_one_reads():
    capacity, hot_rows = 1000, 300
    plain = GearStorage(capacity, device="cuda")
    tiered = GearStorage(capacity, device="cuda", hot_rows=hot_rows)
    cursor = 0
    for k in range(7):  # appends that wrap the ring twice, then writes at random rows
        data = steps(333, seed=k)
        rows = torch.arange(cursor, cursor + 333) % capacity
        for s in (plain, tiered):
            s.set(rows, data)
        cursor += 333
    scattered = torch.randperm(capacity, generator=torch.Generator().manual_seed(9))[:150]
    for s in (plain, tiered):
        s.set(scattered, steps(150, seed=99), set_cursor=False)

    assert tiered.shard.hot is not None and tiered.shard.hot.rows is not None
    owner = tiered.shard.hot.rows.owner.cpu()
    newest = torch.arange(cursor - hot_rows, cursor) % capacity
    newest = newest[~torch.isin(newest, scattered)]  # some slots went to the scattered rows since
    held = owner[newest % hot_rows] == newest
    assert held.float().mean() > 0.5, "the newest appended rows should mostly be hot"

    index = torch.randint(0, capacity, (4000,))
    a, b = as_td(plain.get(index)), as_td(tiered.get(index))
    for key in a.keys(True, True):
        assert torch.equal(a.get(key).cpu(), b.get(key).cpu()), key
    windows = Windows(torch.randint(0, capacity, (64,)), 40, torch.randint(0, 5, (64,)), torch.randint(30, 41, (64,)))
    wa, wb = as_td(plain.shard.read_windows(windows)), as_td(tiered.shard.read_windows(windows))
    for key in wa.keys(True, True):
        assert torch.equal(wa.get(key).cpu(), wb.get(key).cpu()), key

    # A restored checkpoint replaces the host rows: the tier forgets what it held.
    state = plain.state_dict()
    tiered.load_state_dict(state)
    assert tiered.shard.hot is not None and tiered.shard.hot.rows is not None
    assert bool((tiered.shard.hot.rows.owner == -1).all())
    c = as_td(tiered.get(index))
    for key in a.keys(True, True):
        assert torch.equal(a.get(key).cpu(), c.get(key).cpu()), key
