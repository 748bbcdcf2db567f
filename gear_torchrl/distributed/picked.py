"""What an owner's selection sends back: one shard's share of a batch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


# The per-pick values an owner may send, and their dtypes (the wire carries bytes only).
EXTRA_DTYPES = {"mass": torch.float64, "score": torch.float64, "generation": torch.int64}


@dataclass
class Picked:
    """One shard's share of a batch, as windows of ring rows (rows: windows of length one)."""

    starts: torch.Tensor
    seq_len: int
    valid_begin: torch.Tensor
    valid_end: torch.Tensor
    mass: float  # the shard's total mass after picking: what the learner splits the next batch by
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # per pick, named in EXTRA_DTYPES
    scalars: dict[str, float] = field(default_factory=dict)

    @classmethod
    def rows(cls, rows: torch.Tensor, mass: float, **kw: Any) -> Picked:
        return cls(rows, 1, torch.zeros_like(rows), torch.ones_like(rows), mass, **kw)
