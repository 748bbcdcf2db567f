"""The one interface a sampler draws through: a table of rows that runs selection cores.

A gear sampler holds a selection core (its rule and state) and asks the
storage's :class:`Table` to run it. Two tables implement it:

- :class:`ShardTable` (here): one shard, local or shared between processes,
  of steps or of ``[T, num_envs]`` steps (the shard's addressing says which).
- ``ShardedTable`` (``distributed/sharded_table.py``): many shards, each
  owner running the same core class over its own shard.

TorchRL's storages (``adapters/storage.py``, ``adapters/sharded_storage.py``)
hold a table and add only TorchRL's contract; a table speaks the storage's
index (what TorchRL's samplers return for it) and its rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from gear_torchrl.errors import EmptyStoreError
from gear_torchrl.selection.base import SelectionSpec, Selector, pick_exactly
from gear_torchrl.selection.checked_inputs import as_rows
from gear_torchrl.selection.markers import WindowMarkers
from gear_torchrl.selection.picked import Picked, SelectionIndex
from gear_torchrl.store.shard import Shard

# Around a draw of that many rows: where a storage's rate limiter waits (``adapters/rate_gate.py``).
Gate = Callable[[int], AbstractContextManager[Any]]


class Table(ABC):
    """Rows a selection core picks from, and where its per-row state is kept current."""

    # Whether the table's cores follow writes themselves (a sharded store's owners do): then a sampler has no
    # new rows to note, nor TorchRL's first-use priorities to seed.
    follows_writes: bool = False

    @abstractmethod
    def select(
        self,
        selector: Selector[SelectionSpec],
        count: int,
        generator: torch.Generator | None = None,
        markers: WindowMarkers | None = None,
    ) -> Picked:
        """``count`` picks of ``selector``'s rule, drawn with ``generator``.

        Its ``index`` is TorchRL's; for windows (or ``markers``) it carries the picks, so ``get`` of it,
        or of a copy, reads them back.
        """

    @abstractmethod
    def rows_of(self, index: Any) -> torch.Tensor:
        """The table's rows (int64 [N], -1 skips) that the storage's ``index`` names, as cores key them."""

    @abstractmethod
    def note_written(self, selector: Selector[SelectionSpec], index: Any) -> None:
        """TorchRL's writer wrote rows ``index``: ``selector``'s per-row state follows."""

    @abstractmethod
    def update(self, selector: Selector[SelectionSpec], index: Any, priority: Any, generation: Any = None) -> None:
        """Priorities of the rows the storage's ``index`` names, checked against the rows stored."""

    @abstractmethod
    def update_rows(
        self, selector: Selector[SelectionSpec], rows: torch.Tensor, priority: Any, generation: Any = None
    ) -> None:
        """Priorities of the table's ``rows`` (as :meth:`rows_of` gives them), checked against the rows stored."""

    @abstractmethod
    def give_back(self, selector: Selector[SelectionSpec], index: Any) -> None:
        """Picks that were not used (a batch cut short): rules that consume rows take them back."""


class ShardTable(Table):
    """One shard as a table: its picks on ``device``, each draw inside ``gate``."""

    def __init__(self, shard: Shard, device: torch.device, gate: Gate) -> None:
        self.shard = shard
        self.device = device
        self._gate = gate
        # The rows picked last, in range by construction: a read of this very index skips checking them
        # (the check would wait for the GPU). The storage's ``get`` takes it.
        self.drawn: SelectionIndex | None = None

    def select(
        self,
        selector: Selector[SelectionSpec],
        count: int,
        generator: torch.Generator | None = None,
        markers: WindowMarkers | None = None,
    ) -> Picked:
        shard = self.shard
        with self._gate(count * selector.spec.rows_per_pick), shard.picking():  # catches up with commits
            if shard.size == 0:
                raise EmptyStoreError("cannot sample from an empty storage: write some data first")
            selector.follow(shard)
            picked = pick_exactly(selector, shard, count, generator)
        addressing = shard.addressing
        if picked.window_len == 1 and markers is None:
            index = addressing.index_of(picked.starts)
            if not isinstance(index, torch.Tensor) or index.device == self.device:
                self.drawn = index
            picked.index = index
            return picked
        picked.markers = markers
        # On the storage's device already: TorchRL would otherwise move it (a copy, which keeps the sample too).
        picked.carried_by(addressing.window_index(picked.windows).to(self.device))
        return picked

    def rows_of(self, index: Any) -> torch.Tensor:
        return as_rows(self.shard.addressing.rows_of(index), self.shard.capacity)

    def note_written(self, selector: Selector[SelectionSpec], index: Any) -> None:
        rows = self.rows_of(index)
        selector.written(rows[rows >= 0], self.shard)

    def update(self, selector: Selector[SelectionSpec], index: Any, priority: Any, generation: Any = None) -> None:
        self.update_rows(selector, self.shard.addressing.rows_of(index), priority, generation)

    def update_rows(self, selector: Selector[SelectionSpec], rows: Any, priority: Any, generation: Any = None) -> None:
        selector.update(rows, priority, generation, stored=self.shard.ring_rows)

    def give_back(self, selector: Selector[SelectionSpec], index: Any) -> None:
        selector.give_back(self.rows_of(index))
