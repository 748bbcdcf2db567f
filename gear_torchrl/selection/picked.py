"""What a selection core returns: picks on one shard, as windows of ring rows (rows: windows of length one)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# The per-pick values a core may return, and their dtypes (the wire carries bytes only).
EXTRA_DTYPES = {"mass": torch.float64, "score": torch.float64, "generation": torch.int64}


@dataclass
class Picked:
    """One shard's share of a batch."""

    starts: torch.Tensor  # int64 [P], ring row of each pick's first position
    seq_len: int
    valid_begin: torch.Tensor
    valid_end: torch.Tensor
    mass: float | torch.Tensor  # the shard's total mass after picking: what the next batch is split by
    # (from a core on a GPU, a 0-dim tensor there: a float would wait for the device)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per pick, named in EXTRA_DTYPES
    scalars: dict[str, Any] = field(default_factory=dict)  # e.g. min_mass (a float, or a device scalar locally)

    @classmethod
    def rows(cls, rows: torch.Tensor, mass: float | torch.Tensor, **kw: Any) -> Picked:
        return cls(rows, 1, torch.zeros_like(rows), torch.ones_like(rows), mass, **kw)

    @property
    def count(self) -> int:
        return self.starts.numel()

    def subset(self, keep: torch.Tensor) -> Picked:
        """The picks where ``keep`` is true."""
        return Picked(self.starts[keep], self.seq_len, self.valid_begin[keep], self.valid_end[keep], self.mass,
                      {k: v[keep] for k, v in self.extra.items()}, dict(self.scalars))

    @staticmethod
    def concat(parts: list[Picked], mass: float | torch.Tensor) -> Picked:
        """Picks of several rounds on one shard, in order; scalars are the last round's."""
        if len(parts) == 1:
            parts[0].mass = mass
            return parts[0]
        cat = lambda name: torch.cat([getattr(p, name) for p in parts])
        extra = {k: torch.cat([p.extra[k] for p in parts]) for k in parts[0].extra}
        return Picked(cat("starts"), parts[0].seq_len, cat("valid_begin"), cat("valid_end"), mass, extra,
                      dict(parts[-1].scalars))
