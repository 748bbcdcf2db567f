"""What every gear sampler shares: it asks its storage to select with its selection core.

The core (``gear_torchrl/selection``) holds the rule and its state; the
storage's table (``selection/table.py``) runs it, over its own shard
(``GearStorage``) or by sending the core's spec to every shard's owner
(``ShardedGearStorage``). A sampler adds
only TorchRL's side: the buffer's generator, its info keys, its state files.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrl.data.replay_buffers.storages import Storage

from gear_torchrl.adapters.storage_draws import DrawsThroughStorage
from gear_torchrl.adapters.table_storage import TableStorage
from gear_torchrl.selection.base import AnySelector, SelectionSpec, StatefulSelector, pick_exactly
from gear_torchrl.selection.checked_inputs import as_rows
from gear_torchrl.selection.markers import WindowMarkers
from gear_torchrl.selection.picked import Picked


def select(
    storage: Storage,
    selector: AnySelector,
    count: int,
    generator: torch.Generator | None,
    markers: WindowMarkers | None = None,
) -> Picked:
    """``count`` picks of ``selector``'s rule: run by the storage's table, or over a storage without one."""
    if isinstance(storage, TableStorage):
        return storage.table.select(selector, count, generator, markers)
    return select_over_rows(storage, selector, count, generator)


def select_over_rows(storage: Storage, selector: AnySelector, count: int, generator: torch.Generator | None) -> Picked:
    """A row rule over a storage without a table (TorchRL's own): its rows are ``0..len-1``."""
    if selector.spec.rows_per_pick != 1 or not selector.keeps_row_state:
        raise TypeError(
            f"a {selector.spec.kind} selection needs a GearStorage or ShardedGearStorage (it reads "
            f"the store's episodes or keeps no per-row state), got {type(storage).__name__}"
        )
    if len(storage) == 0:
        raise RuntimeError("cannot sample from an empty storage: write some data first")
    picked = pick_exactly(selector, None, count, generator)
    picked.index = picked.starts
    return picked


class SelectsThroughStorage(DrawsThroughStorage):
    """Mixin for a TorchRL ``Sampler`` whose rule is ``self.selector``, run by the storage's table
    (:func:`select`); what it adds is TorchRL's side of per-row state: writes and priorities."""

    selector: AnySelector
    _rng: torch.Generator | None = None

    @property
    def rule(self) -> AnySelector:
        """The core the storage runs: the selector, or a rule around it (a staleness bound)."""
        return self.selector

    def mark_update(self, index: Any, *, storage: Storage | None = None) -> None:
        """Rows were (over)written through TorchRL's writer: the rule's per-row state follows."""
        if not self.rule.keeps_row_state:
            return
        if isinstance(storage, TableStorage):
            storage.table.note_written(self.rule, index)
        else:
            rows = as_rows(index, self.selector_capacity)
            self.rule.written(rows[rows >= 0], None)

    def _update(self, storage: Storage | None, index: Any, priority: Any, generation: Any = None) -> None:
        """Priorities through the storage's table (checked against its rows; routed to owners), else to the
        core."""
        if isinstance(storage, TableStorage):
            storage.table.update(self.rule, index, priority, generation)
        else:
            self.rule.update(index, priority, generation)

    @property
    def selector_capacity(self) -> int:
        """Rows the rule keeps state for; asked only of rules that keep per-row state, which each say."""
        raise NotImplementedError(f"{type(self).__name__} keeps per-row state and must say for how many rows")

    def _empty(self) -> None:
        self.rule.clear()


class FollowsEpisodes(SelectsThroughStorage):
    """Mixin for a sampler whose rule is derived wholly from the storage's episode index (windows, packs):
    nothing to note at writes, nothing to save; a load or an empty store starts its core anew."""

    def mark_update(self, index: Any, *, storage: Any = None) -> None:
        """Nothing to do: the rule follows the storage's episode index."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._empty()

    def dumps(self, path: Any) -> None:
        """Nothing to save: the core's tree is rebuilt from the storage's episode index."""

    def loads(self, path: Any) -> None:
        self._empty()


class SavesCoreState(SelectsThroughStorage):
    """Mixin for a sampler whose state is its core's (queues, top-k): what ``StateDictFile`` saves and loads."""

    selector: StatefulSelector[SelectionSpec]

    def state_dict(self) -> dict[str, Any]:
        return self.selector.state_dict()

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        return self.selector.checked_state_dict(state, rows)

    def _assign(self, state: dict[str, Any]) -> None:
        self.selector.assign(state)
