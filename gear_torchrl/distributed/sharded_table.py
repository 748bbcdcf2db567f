"""Many shards as one table (``selection/table.py``): a learner's picks across every shard's owner.

Each owner runs the same core class as a local table would, over its own shard, for
the spec the learner sends; the rows come back read with the picks. Row names are
global ids (``global_ids.py``), and the owners' cores follow their shards' writes.
"""

from __future__ import annotations

from typing import Any

import torch

from gear_torchrl.distributed.shard_set import ShardSet
from gear_torchrl.selection.base import AnySelector
from gear_torchrl.selection.checked_inputs import integer_rows
from gear_torchrl.selection.markers import WindowMarkers
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.table import Gate, Table


class ShardedTable(Table):
    """The shards of ``shards``, each draw inside ``gate``."""

    follows_writes = True  # each owner's cores follow its shard's commits

    def __init__(self, shards: ShardSet, gate: Gate) -> None:
        self.shards = shards
        self._gate = gate
        self.rows_sampled = 0  # rows this process drew (a storage's stats)

    def select(
        self, selector: AnySelector, count: int, generator: torch.Generator | None, markers: WindowMarkers | None = None
    ) -> Picked:
        """``count`` picks across the shards, their rows read already: the index is global row ids carrying
        the batch, so ``get`` of it costs nothing."""
        if count <= 0:
            raise ValueError(f"select at least one row or window, got {count}")
        with self._gate(count * selector.spec.rows_per_pick):
            picks = self.shards.pick(selector.spec, count, generator)
        assert picks is not None  # None answers a count of 0
        self.rows_sampled += picks.index.numel()
        # One batch across shards: their masses stay with the split (``ShardBatches``).
        picked = Picked.of(
            picks.windows,
            0.0,
            extra=picks.extra,
            scalars=picks.scalars,
            markers=markers,
            columns=picks.columns,
            table=picks.spec,
        )
        picked.carried_by(picks.index)
        return picked

    def rows_of(self, index: Any) -> torch.Tensor:
        """Global ids, as given: their owners check them."""
        return integer_rows(index).reshape(-1).as_subclass(torch.Tensor)

    def note_written(self, selector: AnySelector, index: Any) -> None:
        """Nothing to do: each owner's cores follow its shard's commits."""

    def update(self, selector: AnySelector, index: Any, priority: Any, generation: Any = None) -> None:
        """Priorities for global row ids, routed to the owners of the rows."""
        self.shards.update(selector.spec, torch.as_tensor(index).as_subclass(torch.Tensor), priority, generation)

    def update_rows(self, selector: AnySelector, rows: torch.Tensor, priority: Any, generation: Any = None) -> None:
        self.update(selector, rows, priority, generation)
