"""The one interface a sampler draws through: a table of rows that runs selection cores.

A gear sampler holds a selection core (its rule and state) and asks the
storage's :class:`Table` to run it. Two tables implement it:

- :class:`ShardTable` (here): one shard, local or shared between processes,
  of steps; :class:`EnvColumnsTable`, of ``[T, num_envs]`` steps (``ndim=2``).
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
from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import AnySelector, pick_exactly
from gear_torchrl.selection.checked_inputs import as_rows
from gear_torchrl.selection.markers import WindowMarkers
from gear_torchrl.selection.picked import Picked, SelectionIndex
from gear_torchrl.store.addressing import EnvColumns
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.windows import Windows

# Around a draw of that many rows: where a storage's rate limiter waits (``adapters/rate_gate.py``).
Gate = Callable[[int], AbstractContextManager[Any]]


class Table(ABC):
    """Rows a selection core picks from, and where its per-row state is kept current."""

    # Whether the table's cores follow writes themselves (a sharded store's owners do): then a sampler has no
    # new rows to note, nor TorchRL's first-use priorities to seed.
    follows_writes: bool = False

    @abstractmethod
    def select(
        self, selector: AnySelector, count: int, generator: torch.Generator | None, markers: WindowMarkers | None = None
    ) -> Picked:
        """``count`` picks of ``selector``'s rule, drawn with ``generator``.

        Its ``index`` is TorchRL's; for windows (or ``markers``) it carries the picks, so ``get`` of it,
        or of a copy, reads them back.
        """

    @abstractmethod
    def rows_of(self, index: Any) -> torch.Tensor:
        """The table's rows (int64 [N], -1 skips) that the storage's ``index`` names, as cores key them."""

    @abstractmethod
    def note_written(self, selector: AnySelector, index: Any) -> None:
        """TorchRL's writer wrote rows ``index``: ``selector``'s per-row state follows."""

    @abstractmethod
    def update(self, selector: AnySelector, index: Any, priority: Any, generation: Any = None) -> None:
        """Priorities of the rows the storage's ``index`` names, checked against the rows stored."""

    @abstractmethod
    def update_rows(self, selector: AnySelector, rows: torch.Tensor, priority: Any, generation: Any = None) -> None:
        """Priorities of the table's ``rows`` (as :meth:`rows_of` gives them), checked against the rows stored."""


class ShardTable(Table):
    """One shard of steps (``ndim=1``) as a table: its picks on ``device``, each draw inside ``gate``."""

    def __init__(self, shard: Shard, device: torch.device, gate: Gate) -> None:
        self.shard = shard
        self.device = device
        self._gate = gate
        # The rows picked last, in range by construction: a read of this very index skips checking them
        # (the check would wait for the GPU). The storage's ``get`` takes it.
        self.drawn: SelectionIndex | None = None

    def select(
        self, selector: AnySelector, count: int, generator: torch.Generator | None, markers: WindowMarkers | None = None
    ) -> Picked:
        shard = self.shard
        with self._gate(count * selector.spec.rows_per_pick), shard.picking():  # catches up with commits
            if shard.size == 0:
                raise EmptyStoreError("cannot sample from an empty storage: write some data first")
            selector.follow(shard)
            picked = pick_exactly(selector, shard, count, generator)
        if picked.window_len == 1 and markers is None:
            index = self.index_of(picked.starts)
            if not isinstance(index, torch.Tensor) or index.device == self.device:
                self.drawn = index
            picked.index = index
            return picked
        picked.markers = markers
        # On the storage's device already: TorchRL would otherwise move it (a copy, which keeps the sample too).
        picked.carried_by(self.window_index(picked).to(self.device))
        return picked

    # -- TorchRL's index: what a storage of this layout names rows by ------------------------
    def index_of(self, rows: torch.Tensor) -> SelectionIndex:
        """TorchRL's index of ring ``rows``: the rows themselves."""
        return rows

    def window_index(self, windows: Windows) -> torch.Tensor:
        """TorchRL's index of every window position, padding included, in window order: ring rows
        ``[W * window_len]``."""
        return _C.window_rows(windows.starts, windows.window_len, self.shard.capacity)

    def named_rows(self, index: Any) -> Any:
        """The ring rows TorchRL's ``index`` names (unchecked; -1 stays -1): the index itself."""
        return index

    def rows_of(self, index: Any) -> torch.Tensor:
        return as_rows(self.named_rows(index), self.shard.capacity)

    def note_written(self, selector: AnySelector, index: Any) -> None:
        rows = self.rows_of(index)
        selector.written(rows[rows >= 0], self.shard)

    def update(self, selector: AnySelector, index: Any, priority: Any, generation: Any = None) -> None:
        self.update_rows(selector, self.named_rows(index), priority, generation)

    def update_rows(self, selector: AnySelector, rows: Any, priority: Any, generation: Any = None) -> None:
        selector.update(rows, priority, generation, stored=self.shard.ring_rows)


class EnvColumnsTable(ShardTable):
    """One shard of ``[T, num_envs]`` steps (``ndim=2``): TorchRL names a step by its ``(t, e)`` coordinates."""

    @property
    def _columns(self) -> EnvColumns:
        addressing = self.shard.addressing
        assert isinstance(addressing, EnvColumns)  # what EnvColumnsStorage builds its shard with
        return addressing

    def index_of(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(t, e)`` of ring ``rows``, what TorchRL's samplers return for a 2-D storage."""
        envs = self._columns.num_envs
        return rows // envs, rows % envs

    def window_index(self, windows: Windows) -> torch.Tensor:
        """``[W * window_len, 2]`` coordinates ``(t, e)`` of every window position, padding included."""
        return torch.stack(self._columns.window_coordinates(windows), -1)

    def named_rows(self, index: Any) -> torch.Tensor:
        """Flat rows of ``(t, e)`` coordinates (a tuple of two index tensors, or an ``[N, 2]`` tensor); -1
        stays -1."""
        envs = self._columns.num_envs
        if isinstance(index, tuple) and len(index) == 2:
            t, e = (torch.as_tensor(i) for i in index)
        elif isinstance(index, torch.Tensor) and index.ndim >= 2 and index.shape[-1] == 2:
            t, e = index.unbind(-1)
        else:
            shown = tuple(index.shape) if isinstance(index, torch.Tensor) else type(index).__name__
            raise IndexError(
                f"an ndim=2 storage names single steps by (time, env) coordinates: a tuple of two "
                f"index tensors or an [N, 2] tensor, as TorchRL's writers and samplers give them; "
                f"got {shown}"
            )
        t, e = t.reshape(-1).to(torch.int64), e.reshape(-1).to(torch.int64)
        outside = (t >= 0) & ((e < 0) | (e >= envs))
        if bool(outside.any()):
            raise IndexError(f"env index {int(e[outside][0])} is out of range for {envs} envs")
        return torch.where(t < 0, -1, t * envs + e)
