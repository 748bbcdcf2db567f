"""Windows: ``window_len`` consecutive ring rows from each start, with the range that holds data.

What the gather kernel reads, local or remote: rows are windows of length one.
A sample (``selection/picked.py``'s ``Picked``) is windows plus what its picks
carry, so the store reads a sample as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gear_torchrl.kernels import _C


@dataclass(eq=False)
class Windows:
    """``window_len`` ring rows from each start; positions outside ``[valid_begin, valid_end)`` are padding."""

    starts: torch.Tensor  # int64 [W], ring row of position 0 (may be negative: wraps)
    window_len: int
    valid_begin: torch.Tensor  # int64 [W]
    valid_end: torch.Tensor  # int64 [W]

    @classmethod
    def of_rows(cls, rows: torch.Tensor) -> Windows:
        """Rows as windows of length one."""
        rows = rows.reshape(-1).to(torch.int64)
        return cls(rows, 1, torch.zeros_like(rows), torch.ones_like(rows))

    @staticmethod
    def cat(parts: Sequence[Windows]) -> Windows:
        """``parts`` (of one length) end to end; one part as it is."""
        if len(parts) == 1:
            return parts[0]
        return Windows(
            torch.cat([p.starts for p in parts]),
            parts[0].window_len,
            torch.cat([p.valid_begin for p in parts]),
            torch.cat([p.valid_end for p in parts]),
        )

    def part(self, begin: int, end: int) -> Windows:
        """Windows ``begin`` to ``end``, viewing the same tensors (a share of a batch)."""
        return Windows(self.starts[begin:end], self.window_len, self.valid_begin[begin:end], self.valid_end[begin:end])

    def subset(self, keep: torch.Tensor) -> Windows:
        """The windows where ``keep`` is true (or at the positions it lists)."""
        return Windows(self.starts[keep], self.window_len, self.valid_begin[keep], self.valid_end[keep])

    def contiguous(self) -> Windows:
        """Its tensors contiguous (what goes on the wire)."""
        return Windows(
            self.starts.contiguous(), self.window_len, self.valid_begin.contiguous(), self.valid_end.contiguous()
        )

    @property
    def num_positions(self) -> int:
        return self.starts.numel() * self.window_len

    def rows(self, capacity: int) -> torch.Tensor:
        """Flat ring rows of every position, padding included: [W * window_len]."""
        return _C.window_rows(self.starts, self.window_len, capacity)

    def mask(self) -> torch.Tensor:
        """Which positions hold data (not padding): bool [W * window_len]."""
        return _C.window_mask(self.valid_begin, self.valid_end, self.window_len)
