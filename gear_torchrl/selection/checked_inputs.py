"""Indices and priorities checked before any selection state changes.

Every check that can fail runs before the first write, so a refused update
leaves trees, queues and counts exactly as they were.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch


class IndexDtypeError(IndexError, TypeError):
    """Indices that are not integers: a float would be truncated to another row, a bool read as row 0 or 1."""


class Checked(NamedTuple):
    """An update's indices and priorities on the selector's device, and what checking them learned."""

    rows: torch.Tensor
    priority: torch.Tensor | None
    skips: bool  # some index is -1
    max_priority: float  # 0.0 without priorities


def shaped_priority(priority: Any, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``priority`` as ``count`` float64 values (one value stands for all)."""
    priority = torch.as_tensor(priority).detach().to(device, torch.float64).reshape(-1)
    if priority.numel() == 1 and count != 1:
        priority = priority.expand(count)
    if priority.numel() != count:
        raise ValueError(f"got {priority.numel()} priorities for {count} indices")
    return priority


def _bad_priorities(priority: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(priority) | (priority < 0)


def _refuse_bad_priority(priority: torch.Tensor, bad: torch.Tensor) -> None:
    refuse_priority_at(priority, int(bad.nonzero()[0, 0]))


def integer_rows(index: Any) -> torch.Tensor:
    rows = torch.as_tensor(index)
    if rows.dtype == torch.bool or rows.is_floating_point() or rows.is_complex():
        raise IndexDtypeError(f"priority indices must be integers, got {rows.dtype}")
    return rows.to(torch.int64)


def validated(
    index: Any, priority: Any, capacity: int, device: torch.device | str = "cpu", stored: int | None = None
) -> Checked:
    """Indices (and priorities) on ``device``, checked with a single wait for it.

    Index -1 means "skip", as TorchRL's ``MaxValueWriter`` uses it. Indices must
    be below ``capacity`` and, when known, below the ``stored`` rows: a priority
    there would be drawn, and the read would fail. A NaN, an infinity or a
    negative value shows in the priorities' minimum or maximum.
    """
    index = integer_rows(index).reshape(-1).to(device)
    if priority is not None:
        priority = shaped_priority(priority, index.numel(), device)
    if index.numel() == 0:
        return Checked(index, priority, False, 0.0)
    facts = torch.stack(torch.aminmax(index)).to(torch.float64)
    if priority is not None:
        facts = torch.cat([facts, torch.stack(torch.aminmax(priority))])
    lo, hi, *extremes = facts.tolist()
    refuse_out_of_range(int(lo), int(hi), capacity, stored)
    if extremes and not (extremes[0] >= 0 and extremes[1] < math.inf):
        _refuse_bad_priority(priority, _bad_priorities(priority))
    return Checked(index, priority, lo < 0, extremes[1] if extremes else 0.0)


def row_bound(capacity: int, stored: int | None) -> int:
    """What an update's rows must stay below: the stored rows where known, else the capacity."""
    return capacity if stored is None or stored >= capacity else stored


def refuse_out_of_range(lo: int, hi: int, capacity: int, stored: int | None) -> None:
    """An IndexError naming the first row outside ``[-1, bound)``, given an update's smallest and largest."""
    bound = row_bound(capacity, stored)
    if lo < -1 or hi >= bound:
        rows = "rows" if bound == capacity else "stored rows"
        raise IndexError(f"priority index {lo if lo < -1 else hi} is out of range for {bound} {rows}")


def refuse_priority_at(priority: torch.Tensor, pos: int) -> None:
    """The ValueError for the priority at ``pos``, which is not finite and non-negative."""
    raise ValueError(f"priorities must be finite and non-negative; got {float(priority[pos])} at position {pos}")


class NativeUpdate(NamedTuple):
    """An update as one extension call takes it (``_C.priority_update`` and ``_C.priority_window_update``):
    int64 rows, float64 priorities and the drawn generations (or None) on the CPU, shapes checked."""

    rows: torch.Tensor
    priority: torch.Tensor
    drawn: torch.Tensor | None

    @classmethod
    def of(cls, rows: Any, priority: Any, generation: Any) -> NativeUpdate:
        index = integer_rows(rows).reshape(-1).cpu()
        return cls(index, shaped_priority(priority, index.numel()), as_generation(generation, index.numel()))

    def landed(self, facts: tuple[bool, int, int, int, float], capacity: int, stored: int | None) -> float:
        """The largest priority that landed, from the extension's facts; the error naming the first bad entry
        where its checks refused the update (nothing changed then)."""
        applied, lo, hi, bad, landed_max = facts
        if not applied:
            refuse_out_of_range(lo, hi, capacity, stored)
            refuse_priority_at(self.priority, bad)
        return landed_max


def as_rows(index: Any, capacity: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Checked int64 rows in ``[-1, capacity)``."""
    return validated(index, None, capacity, device).rows


def as_priority(priority: Any, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Checked finite, non-negative float64 priorities, ``count`` of them."""
    priority = shaped_priority(priority, count, device)
    bad = _bad_priorities(priority)
    if bool(bad.any()):
        _refuse_bad_priority(priority, bad)
    return priority


def as_generation(generation: Any, count: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Checked int64 write generations, ``count`` of them (None stays None)."""
    if generation is None:
        return None
    generation = torch.as_tensor(generation, dtype=torch.int64).reshape(-1).to(device)
    if generation.numel() != count:
        raise ValueError(f"got {generation.numel()} generations for {count} indices")
    return generation


def seeds_defaults(index: Any, priority: Any, default: float) -> bool:
    """Whether this is TorchRL's ``_initialize_prioritized_sampler``: rows 0..n-1 at the default priority."""
    index, priority = torch.as_tensor(index).reshape(-1), torch.as_tensor(priority).reshape(-1)
    return (
        index.numel() > 0
        and bool((index == torch.arange(index.numel(), device=index.device)).all())
        and bool((priority == default).all())
    )
