"""Which of several writes to the same place survives: the last one."""

from __future__ import annotations

import torch


def last_write_positions(keys: torch.Tensor, bound: int) -> torch.Tensor:
    """Positions in ``keys`` (CPU ints in ``[0, bound)``) of each key's last occurrence, in write order."""
    positions = torch.arange(keys.numel(), dtype=torch.int64)
    last = torch.full((bound,), -1, dtype=torch.int64).scatter_reduce(0, keys, positions, "amax")
    return last[last >= 0].sort().values
