"""Priority masses on a GPU: blocked prefix sums in plain tensor ops.

The sum tree's pointer chasing suits a CPU; on a GPU, a batch of draws is
cheaper as two searches: over the running sum of per-block masses, then
inside each drawn block. Block sums are recomputed exactly (never updated by
deltas, so no drift) for the blocks a write touches. Per call: O(batch · block)
work for draws and writes plus an O(blocks) running sum, in a few kernels and
without waiting for the device: data-dependent sizes (``unique``, boolean
masks) are avoided, and the total and minimum stay 0-dim device tensors.
The same code runs on the CPU, which is how the tests check it against the
trees without a GPU.
"""
from __future__ import annotations

import torch

BLOCK = 256


class BlockPrefixSums:
    """Per-row masses with batched set, prefix search, total and minimum, on any device."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu", block: int = BLOCK) -> None:
        self.capacity = capacity
        self.block = block
        blocks = -(-capacity // block)
        # One slot past the blocks absorbs the writes that lose (see ``set``).
        self._slots = torch.zeros(blocks * block + 1, dtype=torch.float64, device=device)
        self._discard = blocks * block
        self.mass = self._slots[: blocks * block]
        self.block_sum = torch.zeros(blocks, dtype=torch.float64, device=device)
        self.block_min = torch.full((blocks,), float("inf"), dtype=torch.float64, device=device)

    @property
    def total(self) -> torch.Tensor:
        """Sum of all masses, a 0-dim tensor on the masses' device."""
        return self.block_sum.sum()

    @property
    def minimum(self) -> torch.Tensor:
        """Smallest positive mass (rows without mass do not count), a 0-dim tensor."""
        return self.block_min.min()

    def set(self, index: torch.Tensor, mass: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Masses of rows; where ``index`` repeats the last write wins, and entries with ``keep`` False are dropped."""
        index, mass = index.to(self.mass.device), mass.to(self.mass)
        if keep is not None:
            index = torch.where(keep.to(index.device), index, self._discard)
        # Sort stably: the last entry of each run of equal rows is that row's last write.
        index, order = torch.sort(index, stable=True)
        last = torch.ones_like(index, dtype=torch.bool)
        last[:-1] = index[1:] != index[:-1]
        self._slots[torch.where(last, index, self._discard)] = mass[order]
        touched = index.clamp_max(self._discard - 1) // self.block  # recomputing a block twice is harmless
        rows = self.mass.view(-1, self.block)[touched]
        self.block_sum[touched] = rows.sum(1)
        self.block_min[touched] = torch.where(rows > 0, rows, float("inf")).min(1).values

    def remove(self, index: torch.Tensor) -> None:
        self.set(index, torch.zeros(index.numel(), dtype=torch.float64, device=self.mass.device))

    def get(self, index: torch.Tensor) -> torch.Tensor:
        return self.mass[index.to(self.mass.device)]

    def find(self, prefix_mass: torch.Tensor) -> torch.Tensor:
        """Rows whose cumulative mass range holds each prefix; never a zero-mass row while any has mass."""
        prefix = prefix_mass.to(self.mass).clamp_min(0)
        running = torch.cumsum(self.block_sum, 0)
        # Rounding can put a prefix at or past the total: clamp to the last block with mass.
        has_mass = self.block_sum > 0
        last_block = has_mass.numel() - 1 - torch.argmax(has_mass.flip(0).to(torch.int8))
        block = torch.minimum(torch.searchsorted(running, prefix, right=True), last_block)
        within = prefix - (running[block] - self.block_sum[block])
        rows = self.mass.view(-1, self.block)[block]
        inside = torch.searchsorted(torch.cumsum(rows, 1), within.unsqueeze(1), right=True).squeeze(1)
        last_in_block = self.block - 1 - torch.argmax(rows.flip(1).gt(0).to(torch.int8), 1)
        return block * self.block + torch.minimum(inside, last_in_block)

    def clear(self) -> None:
        self._slots.zero_()
        self.block_sum.zero_()
        self.block_min.fill_(float("inf"))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Per-row masses: the same state whatever structure (and device) holds them."""
        return {"mass": self.mass[: self.capacity]}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.clear()
        self.mass[: self.capacity].copy_(tensors["mass"])
        rows = self.mass.view(-1, self.block)
        self.block_sum.copy_(rows.sum(1))
        self.block_min.copy_(torch.where(rows > 0, rows, float("inf")).min(1).values)
