"""The hot tier's bookkeeping (store/hot_tier.py) on the CPU; the kernel that reads it is in tests/gpu."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from gear_torchrl import GearStorage
from gear_torchrl.store.hot_tier import HotTier
from gear_torchrl.store.table_spec import TableSpec


def simulate(slots: int, writes: list[torch.Tensor]) -> dict[int, int]:
    """Slot -> row after the writes, one row at a time: the last write of a residue wins."""
    held = {}
    for rows in writes:
        for r in rows.tolist():
            held[r % slots] = r
    return held


@pytest.mark.parametrize("slots", [1, 7, 64, 1000])
def test_slots_hold_the_last_row_written_to_them(slots):
    capacity = 250
    gen = torch.Generator().manual_seed(slots)
    spec = TableSpec.from_data(
        TensorDict({"x": torch.zeros(1, 3), "y": torch.zeros(1, dtype=torch.int64)}, [1]), row_dims=1
    )
    tier = HotTier(slots, torch.device("cpu"))
    tier.allocate(spec)
    host_x = torch.zeros(capacity, 3)
    writes, cursor = [], 0
    for k in range(30):
        run = k % 3 != 2
        if not run:  # distinct rows anywhere
            rows = torch.randperm(capacity, generator=gen)[: int(torch.randint(1, 90, (1,), generator=gen))]
        else:  # an append that may wrap the ring, sometimes longer than the tier
            n = int(torch.randint(1, 120, (1,), generator=gen))
            rows = (torch.arange(cursor, cursor + n) % capacity).unique_consecutive()
            cursor += n
            rows = rows[-capacity:]
        x = torch.randn(rows.numel(), 3, generator=gen)
        host_x[rows] = x
        tier.admit(rows, [x, rows.clone()], run=run)
        writes.append(rows)
    held = simulate(slots, writes)
    assert tier.rows is not None  # allocated with the columns
    owner = tier.rows.owner
    expected_owner = torch.full((slots,), -1, dtype=torch.int64)
    for s, r in held.items():
        expected_owner[s] = r
    assert torch.equal(owner, expected_owner)
    owned = (owner >= 0).nonzero().flatten()
    assert torch.equal(tier.rows.columns[0][owned], host_x[owner[owned]])  # the same bytes as the host row
    assert torch.equal(tier.rows.columns[1][owned], owner[owned])
    tier.forget()
    assert bool((tier.rows.owner == -1).all())


def test_hot_rows_needs_cuda_host_memory_and_a_local_store():
    with pytest.raises(ValueError, match="hot_rows .*device='cuda' and memory='host'"):
        GearStorage(100, hot_rows=10)
    with pytest.raises(ValueError, match="hot_rows must be a non-negative int"):
        GearStorage(100, hot_rows=-1)
    with pytest.raises(ValueError, match="hot_rows must be a non-negative int"):
        GearStorage(100, hot_rows=2.5)  # type: ignore[arg-type]  # bad input: a float where an int belongs
