"""Priority masses on a GPU: blocked prefix sums in plain tensor ops.

The sum tree's pointer chasing suits a CPU; on a GPU, a batch of draws is
cheaper as two searches: over the running sum of per-block masses, then
inside each drawn block. Block sums are recomputed exactly (never updated by
deltas, so no drift) for the blocks a write touches. Per call: O(batch · block)
work for draws and writes plus an O(blocks) running sum, without waiting for
the device: data-dependent sizes (``unique``, boolean masks) are avoided, and
the total and minimum stay 0-dim device tensors. That also lets a search or a
write replay as one CUDA graph (``cuda_graphs.py``) instead of dozens of launches.
The same code runs on the CPU, which is how the tests check it against the
trees without a GPU.
"""

from __future__ import annotations

import torch

from gear_torchrl.selection.cuda_graphs import GraphedCall
from gear_torchrl.selection.random_draws import uniform

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
        # Tensors above are only ever changed in place: the graphs hold their addresses.
        self._find = GraphedCall(self._find_rows)
        self._write = GraphedCall(self._write_masses)

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
        if index.numel() == 0:
            return
        index, mass = index.to(self.mass.device), mass.to(self.mass)
        if keep is None:
            self._write(index, mass)
        else:
            self._write(index, mass, keep.to(index.device))

    def _write_masses(self, index: torch.Tensor, mass: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        if keep is not None:
            index = torch.where(keep, index, self._discard)
        # Sort stably: the last entry of each run of equal rows is that row's last write.
        index, order = torch.sort(index, stable=True)
        last = torch.ones_like(index, dtype=torch.bool)
        last[:-1] = index[1:] != index[:-1]
        self._slots[torch.where(last, index, self._discard)] = mass[order]
        blocks = self.mass.view(-1, self.block)
        if index.numel() >= blocks.shape[0]:  # a bulk write: recompute every block once
            self._summarize(blocks, slice(None))
        else:
            touched = index.clamp_max(self._discard - 1) // self.block  # recomputing a block twice is harmless
            self._summarize(blocks[touched], touched)

    def _summarize(self, rows: torch.Tensor, blocks: torch.Tensor | slice) -> None:
        self.block_sum[blocks] = rows.sum(1)
        self.block_min[blocks] = torch.where(rows > 0, rows, float("inf")).min(1).values

    def remove(self, index: torch.Tensor) -> None:
        self.set(index, torch.zeros(index.numel(), dtype=torch.float64, device=self.mass.device))

    def get(self, index: torch.Tensor) -> torch.Tensor:
        return self.mass[index.to(self.mass.device)]

    def find(self, prefix_mass: torch.Tensor) -> torch.Tensor:
        """Rows whose cumulative mass range holds each prefix; never a zero-mass row while any has mass."""
        return self._find(prefix_mass.to(self.mass))

    def draw(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """``count`` rows in proportion to their masses, drawn from ``generator`` (on its own device)."""
        return self.find(uniform(count, generator, self.mass.device) * self.total)

    def _find_rows(self, prefix: torch.Tensor) -> torch.Tensor:
        # A prefix strictly below a running sum's end lands where that sum grows: on a row with mass.
        running = torch.cumsum(self.block_sum, 0)
        zero = running.new_zeros(1)
        prefix = torch.minimum(prefix.clamp_min(0), torch.nextafter(running[-1:], zero))
        block = torch.searchsorted(running, prefix, right=True)
        within = prefix - torch.cat([zero, running])[block]
        row_running = torch.cumsum(self.mass.view(-1, self.block)[block], 1)
        within = torch.minimum(within, torch.nextafter(row_running[:, -1], zero))
        inside = torch.searchsorted(row_running, within.unsqueeze(1), right=True).squeeze(1)
        return block * self.block + inside

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
        self._summarize(self.mass.view(-1, self.block), slice(None))
