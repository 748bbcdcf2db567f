"""The hot tier: the most recently written rows of a host shard, copied into GPU memory.

A store larger than GPU memory keeps its rows in pinned host memory, where
the gather kernel reads them across PCIe. The hot tier adds ``slots`` rows of
GPU memory in front of it: row ``r`` lives in slot ``r % slots`` and takes it
over whenever it is written, so the newest ``slots`` rows of an appending
writer are on the GPU (all of them unless they wrap the ring's end, where two
of them may share a slot). ``owner[s]`` names the row slot ``s`` holds; the
kernel reads a row from its slot when the owner matches and from host memory
otherwise, in the same launch (csrc/kernels/cuda/gather_kernel.cuh).

Every write reaches the host rows first and then the tier, so a row's two
copies agree whenever the gather can see the tier's one.
"""

from __future__ import annotations

import torch

from gear_torchrl.kernels.gather import HotRows
from gear_torchrl.store.last_writes import last_write_positions
from gear_torchrl.store.table_spec import TableSpec


class HotTier:
    """``slots`` rows of every column on ``device`` (the GPU; any device in tests), filled by the shard's writes."""

    def __init__(self, slots: int, device: torch.device) -> None:
        if slots <= 0:
            raise ValueError(f"a hot tier needs at least one slot, got {slots}")
        self.slots = int(slots)
        self.device = device
        self.rows: HotRows | None = None  # allocated with the shard's columns

    def allocate(self, spec: TableSpec) -> None:
        columns = [torch.empty((self.slots, *c.row_shape), dtype=c.dtype, device=self.device) for c in spec.columns]
        owner = torch.full((self.slots,), -1, dtype=torch.int64, device=self.device)
        self.rows = HotRows(columns, owner)

    @property
    def nbytes(self) -> int:
        if self.rows is None:
            return 0
        return sum(c.numel() * c.element_size() for c in self.rows.columns) + self.rows.owner.numel() * 8

    def forget(self) -> None:
        """No row is hot (the host rows changed by other means than ``admit``)."""
        if self.rows is not None:
            self.rows.owner.fill_(-1)

    def admit(self, rows: torch.Tensor, values: list[torch.Tensor], run: bool) -> None:
        """Copy the rows just written with their ``values`` into their slots.

        ``rows``: distinct CPU int64 rows in write order; ``run``: they are
        consecutive ring rows (an append).
        """
        hot = self.rows
        assert hot is not None, "allocate() first"
        tail = rows[-self.slots :]
        r0, m = int(tail[0]), tail.numel()
        if run and int(tail[-1]) == r0 + m - 1:
            # An append that does not wrap the ring: its last `slots` rows take
            # distinct slots, and every slot an earlier row of it would have taken.
            values = [v[-m:] for v in values]
            first = r0 % self.slots
            split = min(m, self.slots - first)
            self._fill(hot, slice(first, first + split), tail[:split], [v[:split] for v in values])
            if split < m:
                self._fill(hot, slice(0, m - split), tail[split:], [v[split:] for v in values])
        else:
            keep = last_write_positions(rows % self.slots, self.slots)
            where = (rows[keep] % self.slots).to(self.device, non_blocking=True)
            self._fill(hot, where, rows[keep], [v[keep] for v in values])

    def _fill(self, hot: HotRows, where: slice | torch.Tensor, rows: torch.Tensor, values: list[torch.Tensor]) -> None:
        # Slots are disowned while their data changes: if a copy fails, reads fall back to the host rows.
        owner = hot.owner
        owner[where] = -1
        for column, value in zip(hot.columns, values):
            column[where] = value.to(self.device, non_blocking=True)
        owner[where] = rows.to(self.device, non_blocking=True)
