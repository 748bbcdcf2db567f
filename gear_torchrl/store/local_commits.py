"""The rows a TrajectoryWriter commits into a local store, for samplers that keep per-row state.

TorchRL's writer tells a buffer's sampler about every write it makes
(``mark_update``). A TrajectoryWriter commits into the shard directly, so
nothing would tell the sampler: a prioritized sampler would never give those
rows a priority. The shard records each commit here, and samplers catch up
through ``rows_changed_since`` exactly as they follow a shared store's commit log.
"""

from __future__ import annotations

import torch

from gear_torchrl.store.last_writes import last_write_positions

_NONE = torch.empty(0, dtype=torch.int64)


class CommitRecord:
    """Numbered commits (rows overwritten, rows written), the newest ``capacity`` rows' worth."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.number = 0  # of the newest commit
        self._commits: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._rows = 0

    def add(self, rows: torch.Tensor, size_before: int) -> None:
        """A commit wrote ``rows``; those below ``size_before`` (or all, in a full ring) held data."""
        overwritten = rows if size_before >= self.capacity else rows[rows < size_before]
        self.number += 1
        self._commits.append((self.number, overwritten, rows))
        self._rows += rows.numel()
        # Newer commits that wrote a whole ring of rows overwrote everything the oldest one did.
        while self._rows - self._commits[0][2].numel() >= self.capacity:
            self._rows -= self._commits.pop(0)[2].numel()

    def since(self, position: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """``(gone, new, position)``: rows overwritten and written by commits after ``position``."""
        later = [c for c in self._commits if c[0] > position[0]]
        if not later:
            return _NONE, _NONE, (self.number, 0)
        gone = torch.cat([c[1] for c in later]).unique()
        new = torch.cat([c[2] for c in later])
        return gone, new[last_write_positions(new, self.capacity)], (self.number, 0)

    def clear(self) -> None:
        """Forget the commits (a restored checkpoint); numbering goes on, so followers see nothing stale."""
        self._commits.clear()
        self._rows = 0
