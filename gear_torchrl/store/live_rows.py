"""The live rows of a shared store at one moment, numbered oldest first.

TorchRL's own samplers (``SamplerWithoutReplacement``, ``SliceSampler``) draw
indices in ``[0, len(storage))`` and read them back. In a shared store that
has wrapped, or where a crashed writer left rows, ring rows ``[0, len)`` are
not the readable ones; this view numbers exactly the readable, live rows
instead, so those samplers never meet a row that is being rewritten or was
left half-written. It maps to positions (rows ever reserved), not ring rows,
so a reader can tell a row that was overwritten since from one that was not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LiveRows:
    """Positions ``[lo, hi)`` less the ``dead`` runs (int64 ``[k, 2]`` of ``[first, end)``, sorted, inside)."""

    lo: int
    hi: int
    dead: np.ndarray

    def __len__(self) -> int:
        if len(self.dead) == 0:  # the usual case: numpy's reduction costs more than the rest of a draw
            return self.hi - self.lo
        return self.hi - self.lo - int((self.dead[:, 1] - self.dead[:, 0]).sum())

    def positions(self, offsets: torch.Tensor) -> torch.Tensor:
        """Positions of the live rows at ``offsets`` (int64 CPU, in ``[0, len)``; 0 is the oldest)."""
        if len(self.dead) == 0:
            return offsets + self.lo
        starts = torch.from_numpy(np.concatenate([[self.lo], self.dead[:, 1]]))
        ends = torch.from_numpy(np.concatenate([self.dead[:, 0], [self.hi]]))
        sizes = ends - starts
        before = torch.cumsum(sizes, 0) - sizes  # live rows ahead of each live run
        run = torch.searchsorted(before, offsets, right=True) - 1  # skips empty runs
        return starts[run] + offsets - before[run]


def dead_runs_array(runs: list[tuple[int, int]]) -> np.ndarray:
    return np.asarray(runs, dtype=np.int64).reshape(-1, 2)
