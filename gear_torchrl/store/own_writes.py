"""A local shard's visibility: the rows this process wrote, readable as soon as written.

Rows are addressed exactly as TorchRL storages address them: row ``i`` of
``[0, size)``; appends move a cursor around the ring, and any other write
(``storage[i] = ...``, ``set_size``) is allowed, as in ``LazyTensorStorage``.
Nothing is shared, so reads need no section and every row below ``size`` is readable.
"""

from __future__ import annotations

import numpy as np
import torch

from gear_torchrl.errors import EmptyStoreError
from gear_torchrl.store.addressing import StepRows
from gear_torchrl.store.indices import TORCHRL_INDEX, Index, as_index_tensor
from gear_torchrl.store.last_writes import last_write_positions
from gear_torchrl.store.local_commits import CommitRecord
from gear_torchrl.store.ring import Ring, as_leaves
from gear_torchrl.store.table_spec import Data, Leaves
from gear_torchrl.store.visibility import Visibility


class OwnWrites(Visibility):
    """Rows ``[0, size)`` of the ring, with the append cursor at ``head``.

    Reads take ``Visibility``'s defaults: no section, every row below ``size`` readable.
    """

    in_place_writes = True

    def bind(self, shard: Ring) -> None:
        super().bind(shard)
        self.capacity = shard.capacity
        self._size = 0  # rows [0, size) are readable
        self._head = 0  # next row an append writes
        self.written = 0  # rows [0, written) have ever been written
        self._inserted = 0
        self.commits = CommitRecord(self.capacity)  # what TrajectoryWriters wrote, for samplers to follow

    # -- what is readable --------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._size

    @property
    def head(self) -> int:
        return self._head

    @property
    def rows_inserted(self) -> int:
        return self._inserted

    @property
    def ring_rows(self) -> int:
        return self._size

    def readable_rows(self) -> int:
        return self._size

    def rows_in_write_order(self) -> torch.Tensor:
        """Readable ring rows, oldest first."""
        if self._size < self.capacity:
            return torch.arange(self._size, dtype=torch.int64)
        return (torch.arange(self.capacity, dtype=torch.int64) + self._head) % self.capacity

    @property
    def takes_any_layout(self) -> bool:
        """Emptied (``clear``): like LazyTensorStorage, the next write may bring other keys."""
        return self.written == 0

    # -- writes --------------------------------------------------------------------------
    # The rule for keys (docs/decisions.md, "Columns"): an append at the cursor (TorchRL's
    # writers, TrajectoryWriter) replaces whole rows, so it must carry every stored key;
    # any other write (``storage[i] = ...``, ``write_at``, ``rb.write_all``) changes only the
    # keys it carries in the rows it names. Either may bring keys the store lacks: they
    # become new columns, which read zeros (None for non-tensor leaves) in rows written before.
    def write(self, index: Index, data: Data, *, append: bool, lead: torch.Size | None) -> torch.Tensor:
        single = isinstance(index, (int, np.integer))
        rows = as_index_tensor([index] if single else index, self.capacity, "write")
        at_cursor = append and self._continues_ring(rows)
        spec = None if self.takes_any_layout else self.shard.table  # emptied: the data's own (``Shard.validated``)
        leaves = as_leaves(data, single, spec, complete=at_cursor, lead=lead)
        if rows.numel() != leaves.n:
            raise IndexError(f"{rows.numel()} write indices for {leaves.n} rows of data")
        if leaves.n == 0:
            return rows
        return self._write_columns(leaves, rows, append, at_cursor)

    def commit(self, leaves: Leaves) -> torch.Tensor:
        addressing = self.shard.addressing
        assert isinstance(addressing, StepRows), "a TrajectoryWriter refuses [T, num_envs] stores"
        rows = (torch.arange(leaves.n, dtype=torch.int64) + self._head) % self.capacity
        size_before = self._size
        rows = self._write_columns(leaves, rows, append=True, at_cursor=self._continues_ring(rows))
        if self.shard.tracks_episodes:
            addressing.episodes.close_open()
        self.commits.add(rows, size_before)
        return rows

    def _continues_ring(self, rows: torch.Tensor) -> bool:
        """Whether writing ``rows`` appends at the cursor: the ring's next rows, in order."""
        consistent = self._size == self.capacity or self._head == self._size
        return rows.numel() > 0 and consistent and _is_ring_run(rows, self._head, self.capacity)

    def _write_columns(self, leaves: Leaves, rows: torch.Tensor, append: bool, at_cursor: bool) -> torch.Tensor:
        """``at_cursor``: an append of the ring's next rows (``_continues_ring``), which moves the cursor."""
        # -- everything is checked: from here on the write happens --
        shard = self.shard
        n = rows.numel()
        if not (at_cursor and self._head + n <= self.capacity and shard.hot is None):
            leaves = leaves.flat()  # only one run of rows is written straight from rows of several dims
        if shard.table is None or (leaves.spec != shard.table and self.takes_any_layout):
            shard.allocate(leaves.spec)
        elif leaves.spec != shard.table:
            shard.grow(leaves.spec, self.written)
        values, columns, objects = leaves.values, leaves.columns, leaves.objects
        if at_cursor and leaves.missing:  # only TorchRL's "index" (``validated``): the rows' own positions
            values = [*values, shard.addressing.torchrl_positions(rows)]
            columns = (*columns, leaves.spec.position(TORCHRL_INDEX))
        by_column = shard.by_column(values, columns)
        size_before = self._size
        if at_cursor:
            ends = shard.ends(by_column, n) if shard.tracks_episodes else None
            dropped_ends = None
            if n > self.capacity:  # only the last `capacity` rows survive
                keep = slice(n - self.capacity, n)
                dropped_ends = None if ends is None else ends[: n - self.capacity]
                rows, values, objects = rows[keep], [v[keep] for v in values], [o[keep] for o in objects]
                by_column = shard.by_column(values, columns)
                ends = None if ends is None else ends[keep]
        else:
            latest = _last_writes(rows, self.capacity)
            if latest is not None:
                rows, values = rows[latest], [v[latest.to(v.device)] for v in values]
                objects = [o[latest.numpy()] for o in objects]
            self.fill_to(int(rows.max()) + 1)

        shard.copy_in(rows, values, columns, contiguous=at_cursor)
        shard.copy_objects(rows, objects, leaves.object_columns)
        self._inserted += n
        self.written = max(self.written, int(rows.max()) + 1)
        if append:  # a cursor away from the head overwrites rows: only rows past the end add to the size
            grown = self._size + n if at_cursor else max(self._size, int(rows.max()) + 1)
            self._size = min(grown, self.capacity)
            self._head = (int(rows[-1]) + 1) % self.capacity
        if not shard.tracks_episodes:
            return rows
        if at_cursor:
            assert ends is not None, "computed above for a shard that tracks episodes"
            shard.addressing.append(
                rows,
                ends,
                shard.traj_ids(by_column, rows.numel()),
                dropped_ends,
                evicted=max(0, size_before + rows.numel() - self.capacity),
            )
        else:
            self.rebuild_episodes()
        return rows

    def set_size(self, size: int) -> None:
        if not 0 <= size <= self.capacity:
            raise ValueError(f"size {size} is outside [0, {self.capacity}]")
        if size and self.shard.table is None:
            raise ValueError(f"cannot make {size} rows readable: nothing was written yet (no columns exist)")
        self.fill_to(size)
        if size != self._size:
            self._size = size
            if self.shard.tracks_episodes:
                self.rebuild_episodes()

    def fill_to(self, end: int) -> None:
        """Zero rows ``[written, end)``: a write past them, or a length over them, must not expose
        memory no write ever filled. Appends never leave such a gap, so they never pay for this."""
        if end <= self.written or self.shard.table is None:
            return
        for column in self.shard.columns:
            column[self.written : end].zero_()
        for objects in self.shard.objects:
            objects[self.written : end] = None
        self.written = end

    def clear(self) -> None:
        """Forget all rows; the spec and buffers stay, like TorchRL's ``_empty``."""
        self._size = 0
        self._head = 0
        self.written = 0
        self.shard.episodes.clear()
        self.commits.clear()
        for objects in self.shard.objects:  # let go of the rows' objects (tensor columns keep their bytes)
            objects.fill(None)

    def after_inplace_write(self) -> None:
        if self.shard.tracks_episodes:
            self.rebuild_episodes()

    def rebuild_episodes(self, ends: torch.Tensor | None = None) -> None:
        """Re-derive the episode index from the stored flags (after a write that was not an append);
        ``ends`` (over rows oldest first) marks further episode ends."""
        order = self.rows_in_write_order()
        if order.numel() == 0:
            self.shard.episodes.clear()
            return
        flagged, traj = self.shard.stored_ends(order)
        self.shard.addressing.rebuild(order, flagged if ends is None else flagged | ends, traj)

    # -- reads: nothing else writes here, so no section is needed (``Visibility``'s defaults) ---
    def uniform_rows(self, n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
        if self._size == 0:
            raise EmptyStoreError("cannot sample from an empty storage: write some data first")
        return torch.randint(0, self._size, (n,), generator=generator, device=device)

    def read(self, index: Index) -> Data:
        return self.read_rows(self.ring_index(index))  # ring rows are what it numbers

    def rows_changed_since(self, position: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """The TrajectoryWriter's commits: TorchRL's writer reports its own writes to the sampler."""
        return self.commits.since(position)

    # -- state and lifetime ------------------------------------------------------------------
    def state(self) -> dict:
        """Everything needed to restore the shard exactly; tensors are views, not copies.

        The columns hold every row ever written and every readable row, so a
        loader can require ``size`` to be within the rows saved.
        """
        shard = self.shard
        laid_out = shard.table is not None
        saved = max(self.written, self._size) if laid_out else 0
        return shard.ring_state(saved, self._size if laid_out else 0, self._head if laid_out else 0)

    def load_state(self, state: dict) -> None:
        """Restore from ``state()``; checks everything (``Ring.checked_state``) before changing anything."""
        spec, columns, objects = self.shard.checked_state(state)
        self.shard.load_ring(state, spec, columns, objects)
        self._size = int(state["size"])
        self._head = int(state["head"])
        self.written = columns[0].shape[0] if columns else 0
        self.shard.episodes.load(state["episodes"])
        self.commits.clear()

    def take_rows(self, leaves: Leaves, size: int, head: int, ends: torch.Tensor | None = None) -> None:
        """See ``Shard.take_rows``."""
        self.shard.adopt_rows(leaves)
        self._size, self._head, self.written = size, head, leaves.n
        if self.shard.tracks_episodes:
            self.rebuild_episodes(ends)


def _is_ring_run(rows: torch.Tensor, head: int, capacity: int) -> bool:
    """Whether ``rows`` are ``head, head+1, ...`` around the ring."""
    if int(rows[0]) != head:
        return False
    if rows.numel() == 1:
        return True
    expected = (torch.arange(rows.numel(), dtype=torch.int64) + head) % capacity
    return torch.equal(rows, expected)


def _last_writes(rows: torch.Tensor, capacity: int) -> torch.Tensor | None:
    """Positions to keep when rows are written twice in one call (the last write wins), or None."""
    n = rows.numel()
    if n <= capacity and (n < 2 or torch.unique(rows).numel() == n):
        return None
    return last_write_positions(rows, capacity)
