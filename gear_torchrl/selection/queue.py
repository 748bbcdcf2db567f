"""A FIFO or LIFO queue: each written row picked once, then consumed (Reverb's queues).

Rows enter the queue when written, tagged with their write generation; a row
overwritten before it was consumed leaves a stale entry that is skipped, so
nothing is picked twice and no stale row is served.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from gear_torchrl.errors import CheckpointError
from gear_torchrl.selection.base import SelectionSpec, StatefulSelector
from gear_torchrl.selection.checked_inputs import as_rows
from gear_torchrl.selection.picked import Picked
from gear_torchrl.store.last_writes import last_write_positions
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.state_checks import (
    checked_int,
    checked_tensor,
    field,
    require_nonnegative,
    require_nothing_past,
)


def _last_writes(index: torch.Tensor) -> torch.Tensor:
    """Each row once, at its last write, in write order (a write larger than the ring repeats rows)."""
    if index.numel() < 2:
        return index
    return index[last_write_positions(index, int(index.max()) + 1)]


@dataclass(frozen=True)
class QueueSpec(SelectionSpec):
    """Each written row once, oldest first (``"fifo"``) or newest first (``"lifo"``)."""

    kind: ClassVar[str] = "queue"
    order: Literal["fifo", "lifo"] = "fifo"

    def check(self) -> None:
        if self.order not in ("fifo", "lifo"):
            raise ValueError(f"order must be 'fifo' or 'lifo', got {self.order!r}")

    def build(self, capacity: int) -> QueueSelector:
        return QueueSelector(self, capacity)


class QueueSelector(StatefulSelector[QueueSpec]):
    """Rows in write order (``"fifo"``) or newest first (``"lifo"``), each consumed once.

    Its mass is the rows still waiting: a batch across shards is split by them.
    """

    def __init__(self, spec: QueueSpec, capacity: int) -> None:
        self.spec = spec
        self.order = spec.order
        self.max_capacity = capacity
        self.clear()

    def clear(self) -> None:
        self._generation = torch.zeros(self.max_capacity, dtype=torch.int64)
        self._queued = torch.zeros(self.max_capacity, dtype=torch.bool)  # row has a live entry
        self._taken = torch.zeros(self.max_capacity, dtype=torch.bool)  # consumed, not rewritten or evicted since
        self._waiting = 0  # live entries
        self._rows = torch.empty(1024, dtype=torch.int64)  # entries [head, tail), oldest first
        self._gens = torch.empty(1024, dtype=torch.int64)
        self._head = self._tail = 0
        self._followed = (0, 0)

    # -- queue -----------------------------------------------------------------------
    def written(self, rows: torch.Tensor, shard: Shard | None) -> None:
        index = _last_writes(rows)
        self._waiting -= int(self._queued[index].sum())  # their older entries go stale
        self._generation[index] += 1
        self._queued[index] = True
        self._taken[index] = False
        self._waiting += int(self._queued[index].sum())
        self._push(index, self._generation[index])

    def forget(self, rows: torch.Tensor) -> None:
        """Rows evicted before they were consumed: their entries go stale."""
        self._waiting -= int(self._queued[rows].sum())
        self._queued[rows] = False
        self._taken[rows] = False
        self._generation[rows] += 1

    def _push(self, rows: torch.Tensor, gens: torch.Tensor) -> None:
        n = rows.numel()
        if self._tail + n > self._rows.numel():
            self._compact(extra=n)
        self._rows[self._tail : self._tail + n] = rows
        self._gens[self._tail : self._tail + n] = gens
        self._tail += n

    def _compact(self, extra: int, room_before: int = 0) -> None:
        live = slice(self._head, self._tail)
        keep = self._gens[live] == self._generation[self._rows[live]]
        rows, gens = self._rows[live][keep], self._gens[live][keep]
        size = max(1024, 2 * (rows.numel() + extra + room_before))
        self._rows, self._gens = torch.empty(size, dtype=torch.int64), torch.empty(size, dtype=torch.int64)
        at = slice(room_before, room_before + rows.numel())
        self._rows[at], self._gens[at] = rows, gens
        self._head, self._tail = room_before, room_before + rows.numel()

    def __len__(self) -> int:
        """Rows written and not consumed yet."""
        return self._waiting

    def give_back(self, rows: torch.Tensor) -> None:
        """Rows ``take`` returned that were not used, in the order taken: they are served first again.

        Rows rewritten or evicted since they were taken stay out (a rewritten one is queued as new).
        """
        rows = as_rows(rows, self.max_capacity)
        rows = rows[rows >= 0]
        rows = rows[self._taken[rows]]
        if rows.numel() == 0:
            return
        rows = _last_writes(rows)
        self._taken[rows] = False
        self._queued[rows] = True
        self._waiting += rows.numel()
        if self.order == "lifo":
            self._push(rows.flip(0), self._generation[rows.flip(0)])  # the tail is served first
            return
        n = rows.numel()
        if self._head < n:
            self._compact(extra=0, room_before=n)
        self._head -= n
        self._rows[self._head : self._head + n] = rows
        self._gens[self._head : self._head + n] = self._generation[rows]

    def mass(self, shard: Shard) -> float:
        return float(self._waiting)

    def pick(self, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
        """Up to ``count`` rows from the queue's end (fewer when fewer wait)."""
        rows = self.take(min(count, self._waiting))
        return Picked.row_picks(rows, float(self._waiting))

    def nothing_to_pick(self, shard: Shard | None, count: int, got: int) -> str:
        return f"queue: {got} rows wait to be consumed, asked for {count}"

    def take(self, batch_size: int) -> torch.Tensor:
        """Consume ``batch_size`` (at most ``len(self)``) rows from the queue's end.

        O(batch + stale entries skipped).
        """
        if batch_size == 0:
            return torch.empty(0, dtype=torch.int64)
        fifo = self.order == "fifo"
        taken: list[torch.Tensor] = []
        need, pos = batch_size, self._head if fifo else self._tail
        while need:
            span = max(2 * need, 64)
            lo, hi = (pos, min(pos + span, self._tail)) if fifo else (max(pos - span, self._head), pos)
            rows, gens = self._rows[lo:hi], self._gens[lo:hi]
            live = (gens == self._generation[rows]).nonzero().squeeze(1)
            live = live[:need] if fifo else live.flip(0)[:need]
            taken.append(rows[live])
            need -= live.numel()
            if fifo:
                pos = lo + int(live[-1]) + 1 if need == 0 else hi
            else:
                pos = lo + int(live[-1]) if need == 0 else lo
        if fifo:
            self._head = pos
        else:
            self._tail = pos
        index = torch.cat(taken)
        self._queued[index] = False
        self._taken[index] = True
        self._waiting -= batch_size
        return index

    def export_rows(self, rows: torch.Tensor) -> dict[str, Any]:
        """The waiting rows among ``rows``, in the order they will be served, as positions in ``rows``."""
        position = torch.full((self.max_capacity,), -1, dtype=torch.int64)
        position[rows] = torch.arange(rows.numel())
        live = slice(self._head, self._tail)
        entries, gens = self._rows[live], self._gens[live]
        waiting = entries[gens == self._generation[entries]]
        waiting = position[waiting]
        return {"waiting": waiting[waiting >= 0].clone()}

    def import_rows(self, state: dict[str, Any]) -> None:
        self.written(state["waiting"], None)

    def state_dict(self) -> dict[str, Any]:
        live = slice(self._head, self._tail)
        return {
            "generation": self._generation.clone(),
            "queued": self._queued.clone(),
            "waiting": self._waiting,
            "rows": self._rows[live].clone(),
            "gens": self._gens[live].clone(),
        }

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        """``state`` checked in full: every queued row has one live entry, none past the ``rows`` restored."""
        where = "the saved queue state"
        cap = self.max_capacity
        generation = checked_tensor(field(state, "generation", where), "generation", torch.int64, (cap,))
        queued = checked_tensor(field(state, "queued", where), "queued", torch.bool, (cap,))
        entries = checked_tensor(field(state, "rows", where), "rows", torch.int64)
        gens = checked_tensor(field(state, "gens", where), "gens", torch.int64, tuple(entries.shape))
        waiting = checked_int(field(state, "waiting", where), "waiting", hi=cap)
        require_nonnegative(generation, "generation")
        require_nonnegative(entries, "rows", at_most=cap - 1)
        require_nonnegative(gens, "gens")
        require_nothing_past(queued, rows, "queued")
        live = gens == generation[entries]
        if int(queued.sum()) != waiting or int(live.sum()) != waiting or not bool(queued[entries[live]].all()):
            raise CheckpointError(
                f"the saved queue is inconsistent: {waiting} rows wait, {int(queued.sum())} are "
                f"marked queued and {int(live.sum())} entries are live"
            )
        return {"generation": generation, "queued": queued, "waiting": waiting, "rows": entries, "gens": gens}

    def assign(self, state: dict[str, Any]) -> None:
        self._generation = state["generation"].clone()
        self._queued = state["queued"].clone()
        self._taken = torch.zeros_like(self._queued)  # picks before the checkpoint cannot come back
        self._waiting = state["waiting"]
        self._head = self._tail = 0
        self._rows, self._gens = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
        self._push(state["rows"], state["gens"])
