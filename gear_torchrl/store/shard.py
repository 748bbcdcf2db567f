"""One shard: a ring of rows, one contiguous buffer per column, built from two parts.

The shard knows tensors, not TorchRL. Its addressing (``store/addressing.py``)
says what a row is, its visibility (``store/visibility.py``) which rows are
committed and readable and how writes get there; the ring (``store/ring.py``:
its layout, copies and gathers) is the same for every combination, and the
shard is that ring read through its visibility. Every write is validated in
full (spec, indices) before the first byte changes, so a rejected write
leaves the shard as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Unpack, cast

import torch

from gear_torchrl.errors import EmptyStoreError
from gear_torchrl.kernels import gather
from gear_torchrl.store.indices import Index
from gear_torchrl.store.own_writes import OwnWrites
from gear_torchrl.store.ring import Ring, RingOptions, as_leaves
from gear_torchrl.store.table_spec import Data, Leaves, NestedKey, TableSpec
from gear_torchrl.store.visibility import Visibility
from gear_torchrl.store.windows import Windows

# Given windows, their batch's gathered columns (by key) and validity mask: keys to add or replace.
Markers = Callable[["Windows", dict[NestedKey, torch.Tensor], torch.Tensor], dict[NestedKey, torch.Tensor]]


class Shard(Ring):
    """Columns in a ring (``Ring``: its addressing part, layout, copies and gathers), read through a
    visibility part.

    ``end_keys`` (any that exist) mark the last step of an episode; with
    ``traj_key`` set, an episode also ends where that id changes. Without a
    ``visibility``, the rows are this process's own writes (``OwnWrites``).
    """

    def __init__(self, capacity: int, *, visibility: Visibility | None = None, **ring: Unpack[RingOptions]) -> None:
        super().__init__(capacity, **ring)
        self.visibility = visibility if visibility is not None else OwnWrites()  # what is committed and readable
        self.visibility.bind(self)

    def __setstate__(self, state: dict) -> None:
        """A copy (pickled, deep-copied) has its visibility refer to it (``Visibility.point_back``)."""
        self.__dict__.update(state)
        self.visibility.point_back(self)

    @property
    def size(self) -> int:
        """Readable rows."""
        return self.visibility.size

    @property
    def head(self) -> int:
        """The ring row the next append writes."""
        return self.visibility.head

    @property
    def rows_inserted(self) -> int:
        """Rows appended so far (every process's, in a shared store)."""
        return self.visibility.rows_inserted

    # -- writes: the visibility's protocol ---------------------------------------------
    def write(self, index: Index, data: Data, *, append: bool, lead: torch.Size | None = None) -> torch.Tensor:
        """Write rows; ``append`` moves the ring's cursor and length like TorchRL's writers.

        ``lead``: the data's leading dims that hold its rows, when more than one (an
        ``ndim=2`` store's ``[T, E]`` steps, rows ``index`` in row-major order).
        Returns the rows written.
        """
        return self.visibility.write(index, data, append=append, lead=lead)

    def commit(self, leaves: Leaves) -> torch.Tensor:
        """Append checked rows (``validated``) as one unit whose last row ends an episode.

        This is how a :class:`TrajectoryWriter` hands over an episode or a chunk of one.
        """
        return self.visibility.commit(leaves)

    def validated(
        self,
        data: Data,
        single: bool,
        spec: TableSpec | None = None,
        *,
        complete: bool = True,
        lead: torch.Size | None = None,
    ) -> Leaves:
        """``data`` as checked rows (``Leaves``, with a row dim even when ``single``); raises before any change.

        The spec is ``spec``, else the shard's (unless emptied: it takes any layout then), else
        the data's own. ``complete``: the write appends whole rows, so it must carry every stored
        key (one left out would leave the new rows holding an older step's values), except
        TorchRL's ``"index"``, which its writers store only sometimes: that one is filled
        with the rows' own positions, what TorchRL stores there.
        """
        spec = spec or (None if self.visibility.takes_any_layout else self.table)
        return as_leaves(data, single, spec, complete=complete, lead=lead)

    def set_size(self, size: int) -> None:
        """Make rows ``[0, size)`` readable (TorchRL writers set ``_len`` after ``write_at``)."""
        self.visibility.set_size(size)

    def fill_unwritten(self) -> None:
        """Zero every slot no write reached: a write through ``slice_views(all_slots=True)`` may land anywhere."""
        self.visibility.fill_to(self.capacity)

    def clear(self) -> None:
        """Forget all rows; the spec and buffers stay, like TorchRL's ``_empty``."""
        self.visibility.clear()

    def state(self) -> dict:
        """The readable rows as a local shard's state: everything needed to restore them; tensors are views."""
        return self.visibility.state()

    def load_state(self, state: dict) -> None:
        """Restore from ``state()``; checks everything (``checked_state``) before changing anything."""
        self.visibility.load_state(state)

    def take_rows(self, leaves: Leaves, size: int, head: int, ends: torch.Tensor | None = None) -> None:
        """Hold ``leaves`` (checked rows, ``validated``) as rows ``[0, leaves.n)`` in place, without copying
        them: ``size`` readable, the next append at ``head`` (the oldest row once the ring is full). The
        episode index is derived from their flags, and ``ends`` (bool over the rows oldest first: episode
        ends no flag marks, such as a shared store's commits).

        For a new local scratch shard whose ``state()`` is then loaded elsewhere: this is how another
        storage's slots (a TorchRL checkpoint's mapped files, a state dict) become a shard state with one
        copy, not two.
        """
        if self.table is not None:
            raise RuntimeError("take_rows gives rows to a new shard; this one holds rows already")
        if not isinstance(self.visibility, OwnWrites):
            raise TypeError("take_rows builds a local scratch shard; a shared one takes rows by commits")
        self.visibility.take_rows(leaves, size, head, ends)

    # -- reads ------------------------------------------------------------------------
    # A sampler picks rows inside ``picking()`` and the storage then reads them under
    # ``reading()``. What these do is the visibility's: nothing for this process's own
    # writes; a shared store's catch up with other processes' commits and hold
    # evictions back until the read is done.
    def picking(self) -> AbstractContextManager[None]:
        return self.visibility.picking()

    def reading(self) -> AbstractContextManager[None]:
        """Around a gather of rows picked earlier (see ``picking``)."""
        return self.visibility.reading()

    def refresh(self) -> None:
        """Catch up with rows other processes committed."""
        self.visibility.refresh()

    def release(self) -> None:
        """End the read section ``picking`` opened, for rows read by other means (a remote learner)."""
        self.visibility.release()

    def rows_changed_since(self, position: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """Rows commits overwrote and added since ``position`` (start from ``(0, 0)``).

        Returns ``(gone, new, position)``. Samplers that keep per-row state
        (priorities) follow the store with it. In a local shard these are the
        TrajectoryWriter's commits: TorchRL's writer reports its own writes. A
        shared shard reports every process's commits, less rows left by crashed writers.
        """
        return self.visibility.rows_changed_since(position)

    def rows_in_write_order(self) -> torch.Tensor:
        """The readable ring rows, oldest first (call inside ``picking``): the same for a local shard and a
        shared one (there: every process's commits), so a rule that weighs recency reads the order here."""
        return self.visibility.rows_in_write_order()

    def readable_rows(self) -> int:
        """How many rows a reader finds now."""
        return self.visibility.readable_rows()

    @property
    def ring_rows(self) -> int:
        """Read indices are ring rows in ``[0, ring_rows)``."""
        return self.visibility.ring_rows

    def check_readable_windows(self, windows: Windows) -> None:
        """``check_readable`` of the windows' valid positions (starts in range)."""
        self.visibility.check_readable_windows(windows)

    def read(self, index: Index, *, in_range: bool = False) -> Data:
        """Rows at ``index`` (int, slice, sequence, array or tensor of any shape), on ``out_device``.

        ``in_range``: ``index`` is a tensor of ring rows in ``[0, ring_rows)``, readable (drawn by this
        store in the open read section): read as they are. Any other index is the visibility's to map
        (a shared store numbers its live rows) and check (``Visibility.ring_index``) first.
        """
        if not in_range:
            return self.visibility.read(index)
        return self.visibility.read_rows(cast(torch.Tensor, index))

    @property
    def slice_views_possible(self) -> bool:
        """Whether ``slice_views`` can hand out the rows themselves (CPU rows read on the CPU, writable
        in place: other processes read a shared store's rows, so a slice of it is a copy)."""
        return self.out_device == self.device and self.hot is None and self.visibility.in_place_writes

    def slice_views(self, index: Any, all_slots: bool = False) -> Data | None:
        """Rows ``[0, size)`` (every slot, with ``all_slots``), shaped as the addressing lays them out
        (``[size]`` or ``[T, num_envs]``), at a basic ``index`` (slices, ints) as views of the columns,
        or None where a view cannot be had.

        What TorchRL's ``rb.set_`` / ``update_`` write into reaches the rows, as with
        ``LazyTensorStorage``; call ``after_inplace_write`` once written.
        """
        parts = index if isinstance(index, tuple) else (index,)
        if (
            not self.slice_views_possible
            or self.table is None
            or any(isinstance(p, slice) and (p.step or 1) < 1 for p in parts)
        ):
            return None
        rows = self.capacity if all_slots else self.size
        grid = self.addressing.grid(rows)
        lead = torch.empty(grid, device="meta")[index].shape
        views = [c[:rows].view(*grid, *c.shape[1:])[index] for c in self.columns]
        objects = [o[:rows].reshape(grid)[index] for o in self.objects]
        return self.table.unflatten(views, lead, device=self.out_device, objects=objects)

    def after_inplace_write(self) -> None:
        """Rows changed in place (``slice_views``, a column): episode ends and hot copies may be stale."""
        if self.hot is not None:
            self.hot.forget()
        self.visibility.after_inplace_write()

    def read_windows(self, windows: Windows, markers: Markers | None = None) -> Data:
        """Windows as a flat batch of ``W * window_len`` rows on ``out_device``, padding zero-filled.

        ``markers`` adds keys derived from the gathered columns (a window sampler's trajectory markers).
        """
        plan = self.addressing.gather_plan(windows)
        with self.reading():
            if self.table is None or self.size == 0:
                raise EmptyStoreError("cannot read from an empty storage: write some data first")
            self.visibility.claim_gather(windows.starts.numel() * windows.window_len)
            flat, mask = gather.gather_windows(
                self.columns,
                plan.starts,
                plan.window_len,
                self.out_device,
                plan.valid_begin,
                plan.valid_end,
                hot=self._hot_rows(),
            )
            self.rows_read += flat[0].shape[0]
        # Windows are read where episodes are delimited by named flag columns: never a plain tensor's table.
        extra = None if markers is None else markers(windows, dict(zip(self.table.names, flat)), mask)
        objects = None
        if self.objects:  # padding positions hold no row: None, as a row never written
            at = torch.where(mask.cpu(), plan.rows(self.capacity), -1)
            objects = self._objects_at(at, at.shape)
        return self.table.unflatten(
            flat, torch.Size([flat[0].shape[0]]), device=self.out_device, extra=extra, objects=objects
        )

    def close(self) -> None:
        """Let go of what the rows live in beyond this process (a shared store's segments)."""
        self.visibility.close()
