"""A cap on how often a row is picked, around another rule (Reverb's max_times_sampled).

After ``max_times`` picks a row leaves the inner rule's draw until it is
written again. The cap is exact within a pick too: draws past a row's cap
are drawn again. Over many shards each owner counts its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gear_torchrl.selection.around import AroundSpec, excluding_core, update_kept
from gear_torchrl.selection.base import AnySelector, StatefulSelector
from gear_torchrl.selection.checked_inputs import as_rows
from gear_torchrl.selection.picked import Picked
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.state_checks import checked_tensor, field, require_nonnegative

_MAX_ROUNDS = 32


def rank_among_equals(index: torch.Tensor) -> torch.Tensor:
    """For each entry, how many equal entries come before it."""
    order = torch.argsort(index, stable=True)
    ordered = index[order]
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    position = torch.arange(index.numel())
    group_start = torch.cummax(torch.where(starts, position, 0), 0).values
    rank = torch.empty_like(index)
    rank[order] = position - group_start
    return rank


def _cannot_cap(what: str) -> TypeError:
    return TypeError(
        f"a {what} cannot leave rows out of its draws, so it cannot be capped; cap priorities "
        "(alpha=0 draws uniformly) or top-k"
    )


@dataclass(frozen=True)
class CappedSpec(AroundSpec):
    """Another rule whose rows leave the draw after ``max_times`` picks, until written again."""

    kind: ClassVar[str] = "capped"
    max_times: int

    def describe(self) -> str:
        return f"{self.inner.describe()} capped at max_times_sampled={self.max_times}"

    def check(self) -> None:
        if self.max_times < 1:
            raise ValueError(f"max_times must be >= 1, got {self.max_times}")
        if not self.inner.can_exclude:
            raise _cannot_cap(type(self.inner).__name__)

    def build(self, capacity: int) -> CappedSelector:
        return CappedSelector(self, capacity)


class CappedSelector(StatefulSelector[CappedSpec]):
    """Counts of picks per row, over the inner rule, which leaves a row out once its count reaches the cap."""

    def __init__(self, spec: CappedSpec, capacity: int, inner: AnySelector | None = None) -> None:
        self.spec = spec
        self.capacity = capacity
        inner = inner if inner is not None else spec.inner.build(capacity)
        self.inner = excluding_core(inner, _cannot_cap(f"{inner.spec.kind} selection"))
        self.count = torch.zeros(capacity, dtype=torch.int64)
        self._followed = (0, 0)

    def clear(self) -> None:
        self.count.zero_()
        self._followed = (0, 0)
        self.inner.clear()

    def written(self, rows: torch.Tensor, shard: Shard | None) -> None:
        self.count[rows] = 0
        self.inner.written(rows, shard)

    def forget(self, rows: torch.Tensor) -> None:
        self.inner.forget(rows)

    def mass(self, shard: Shard) -> float:
        return self.inner.mass(shard)

    def pick(self, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
        """Rounds of the inner rule's picks, keeping those under the cap, until ``count`` or none are left."""
        parts: list[Picked] = []
        need = count
        for _ in range(_MAX_ROUNDS):
            if need == 0:
                break
            picked = self.inner.pick(shard, need, generator)
            if picked.starts.numel() == 0:
                break
            accepted = self._accept(picked.starts)
            parts.append(picked.subset(accepted))
            need -= int(accepted.sum())
        if not parts:
            return self.inner.pick(shard, 0, generator)
        if shard is None:  # a store that cannot select: no other shard to weigh this one against
            return Picked.concat(parts, mass=parts[-1].mass)
        return Picked.concat(parts, mass=self.inner.mass(shard))

    def nothing_to_pick(self, shard: Shard | None, count: int, got: int) -> str:
        return f"cannot draw {count - got} more rows: the others reached max_times_sampled={self.spec.max_times}"

    def _accept(self, rows: torch.Tensor) -> torch.Tensor:
        accepted = self.count[rows] + rank_among_equals(rows) < self.spec.max_times
        taken = rows[accepted]
        self.count.index_add_(0, taken, torch.ones_like(taken))
        exhausted = taken[self.count[taken] >= self.spec.max_times].unique()
        if exhausted.numel():
            self.inner.exclude(exhausted)
        return accepted

    def update(self, rows: Any, priority: Any, generation: Any = None, stored: int | None = None) -> None:
        """Forwarded, except for rows that reached the cap (they stay out of the draw)."""
        rows = as_rows(rows, self.capacity)
        keep = (rows < 0) | (self.count[rows.clamp_min(0)] < self.spec.max_times)
        update_kept(self.inner, rows, keep, priority, generation, stored)

    def give_back(self, rows: torch.Tensor) -> None:
        """Picks not used do not count against the cap (rows excluded by them come back only when rewritten)."""

    # -- state -----------------------------------------------------------------------
    def export_rows(self, rows: torch.Tensor) -> dict[str, Any]:
        return {"count": self.count[rows].clone(), "inner": self.inner.export_rows(rows)}

    def import_rows(self, state: dict[str, Any]) -> None:
        self.count[: state["count"].numel()] = state["count"]
        self.inner.import_rows(state["inner"])

    def caught_up(self, shard: Shard) -> None:
        super().caught_up(shard)
        self.inner.caught_up(shard)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count.clone(), "sampler": self.inner.state_dict()}

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        """The counts (in ``[0, max_times]``) and the inner rule's state, both checked."""
        where = "the saved MaxTimesSampled state"
        count = checked_tensor(field(state, "count", where), "count", torch.int64, (self.capacity,))
        require_nonnegative(count, "count", at_most=self.spec.max_times)
        return {"count": count, "sampler": self.inner.checked_state_dict(field(state, "sampler", where), rows)}

    def assign(self, state: dict[str, Any]) -> None:
        self.count.copy_(state["count"])
        self.inner.assign(state["sampler"])
