"""Priority masses on a GPU: blocked prefix sums in plain tensor ops.

The sum tree's pointer chasing suits a CPU; on a GPU, a batch of draws is
cheaper as two searches: over the running sum of per-block masses, then
inside each drawn block. Block sums are recomputed exactly (never updated by
deltas, so no drift) for the blocks a write touches. Per call: O(batch · block)
work for draws and writes plus an O(blocks) running sum, all in a few kernels.
The same code runs on the CPU, which is how the tests check it against the
trees without a GPU.
"""
from __future__ import annotations

import torch

BLOCK = 256


def _last_write_wins(index: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    unique, inverse = torch.unique(index, return_inverse=True)
    position = torch.arange(index.numel(), device=index.device)
    last = torch.full((unique.numel(),), -1, dtype=torch.int64, device=index.device)
    last = last.scatter_reduce(0, inverse, position, "amax")
    return unique, values[last]


class BlockPrefixSums:
    """Per-row masses with batched set, prefix search, total and minimum, on any device."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu", block: int = BLOCK) -> None:
        self.capacity = capacity
        self.block = block
        blocks = -(-capacity // block)
        self.mass = torch.zeros(blocks * block, dtype=torch.float64, device=device)
        self.block_sum = torch.zeros(blocks, dtype=torch.float64, device=device)
        self.block_min = torch.full((blocks,), float("inf"), dtype=torch.float64, device=device)

    @property
    def total(self) -> float:
        return float(self.block_sum.sum())

    @property
    def minimum(self) -> float:
        """Smallest positive mass (rows without mass do not count)."""
        return float(self.block_min.min())

    def set(self, index: torch.Tensor, mass: torch.Tensor) -> None:
        index, mass = _last_write_wins(index.to(self.mass.device), mass.to(self.mass))
        self.mass[index] = mass
        touched = torch.unique(index // self.block)
        rows = self.mass.view(-1, self.block)[touched]
        self.block_sum[touched] = rows.sum(1)
        self.block_min[touched] = torch.where(rows > 0, rows, float("inf")).min(1).values

    def remove(self, index: torch.Tensor) -> None:
        self.set(index, torch.zeros(index.numel(), dtype=torch.float64, device=self.mass.device))

    def get(self, index: torch.Tensor) -> torch.Tensor:
        return self.mass[index.to(self.mass.device)]

    def find(self, prefix_mass: torch.Tensor) -> torch.Tensor:
        """Rows whose cumulative mass range holds each prefix; never a zero-mass row."""
        prefix = prefix_mass.to(self.mass).clamp_min(0)
        running = torch.cumsum(self.block_sum, 0)
        block = torch.searchsorted(running, prefix, right=True)
        # rounding can put a prefix at or past the total: take the last block with mass
        last = int(torch.nonzero(self.block_sum > 0).max()) if bool((self.block_sum > 0).any()) else 0
        block = block.clamp_max(last)
        within = prefix - (running[block] - self.block_sum[block])
        rows = self.mass.view(-1, self.block)[block]
        inside = torch.searchsorted(torch.cumsum(rows, 1), within.unsqueeze(1), right=True).squeeze(1)
        last_in_block = self.block - 1 - torch.argmax(rows.flip(1).gt(0).to(torch.int8), 1)
        return block * self.block + torch.minimum(inside, last_in_block)

    def clear(self) -> None:
        self.mass.zero_()
        self.block_sum.zero_()
        self.block_min.fill_(float("inf"))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Per-row masses: the same state whatever structure (and device) holds them."""
        return {"mass": self.mass[: self.capacity]}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.mass.zero_()
        self.mass[: self.capacity].copy_(tensors["mass"])
        rows = self.mass.view(-1, self.block)
        self.block_sum.copy_(rows.sum(1))
        self.block_min.copy_(torch.where(rows > 0, rows, float("inf")).min(1).values)
