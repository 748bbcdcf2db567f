"""What rules around another rule share (a cap, staleness): the inner rule, which must leave rows out of its draw.

The rule around it decides which rows leave (``exclude``); the inner rule keeps
drawing, weighing shards and merging picks across them as it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gear_torchrl.selection.base import AnySelector, SelectionSpec
from gear_torchrl.selection.priorities import PrioritySelector, ProportionalSpec
from gear_torchrl.selection.topk import TopKSelector

# The cores that can leave rows out of their draws until the rows are written again.
ExcludingCore = PrioritySelector[ProportionalSpec] | TopKSelector


@dataclass(frozen=True)
class AroundSpec(SelectionSpec):
    """A rule around ``inner``, whose rows it leaves out of the draw."""

    inner: SelectionSpec

    @property
    def merges_best(self) -> bool:  # type: ignore[override]  # a property: the inner rule decides
        return self.inner.merges_best


def excluding_core(inner: AnySelector, refusal: TypeError) -> ExcludingCore:
    """``inner``, a core that can exclude rows; else ``refusal`` is raised."""
    if not isinstance(inner, (PrioritySelector, TopKSelector)):
        raise refusal
    return inner


def update_kept(
    inner: ExcludingCore,
    rows: torch.Tensor,
    keep: torch.Tensor,
    priority: Any,
    generation: Any,
    stored: int | None,
) -> None:
    """Forward to ``inner`` the priority updates of ``rows`` that ``keep`` marks (the others stay out of the draw)."""
    priority = torch.as_tensor(priority)
    if priority.numel() > 1:
        priority = priority.reshape(-1)[keep]
    if generation is not None:
        generation = torch.as_tensor(generation).reshape(-1)[keep]
    inner.update(rows[keep], priority, generation, stored=stored)
