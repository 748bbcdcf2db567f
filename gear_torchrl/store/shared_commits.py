"""A shared store's visibility: rows any process committed to a shared commit log.

A shard with this part lives in named shared memory that many processes write
and read at once. Columns live in shared segments (each column page-aligned,
so CUDA can register it), the commit protocol in a control segment (``commit_log``).
Every process keeps its own episode index: on ``refresh`` it replays the
commits published since its last look, in ring order, reading episode ends
from the stored flag columns. The ring, the gather, the samplers and the
addressing (steps of one stream, or ``[T, num_envs]`` steps, published with
the columns' layout) are those of every shard; only where rows come from
differs.

This module holds the store's handle, how a shard of it is built, and the part
itself (``SharedCommits``): the store's segments and their lifetime, the commit
protocol for writes (reserve, copy, commit), and snapshots and state. It answers
the rest of ``Visibility`` from parts of its own, one module each:

- ``SharedColumns`` (``store/shared_columns.py``): the columns' segments, as any
  process laid them out or added them;
- ``SeenCommits`` (``store/seen_commits.py``): the positions this process has
  replayed, the runs crashed writers left, what is readable and what changed;
- ``ReadSections`` (``store/read_sections.py``): opening, holding and closing
  this process's read section;
- ``NumberedReads`` (``store/numbered_reads.py``): indices from outside this
  library's samplers, which number the live rows;
- ``SharedRateCounters`` (``store/rate_counters.py``): a rate limiter's counts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from gear_torchrl.errors import EmptyStoreError
from gear_torchrl.store.addressing import Addressing, StepRows, addressing_of
from gear_torchrl.store.commit_log import DEFAULT_READER_TIMEOUT_S, CommitLog, control_bytes, reader_timeout_us
from gear_torchrl.store.indices import TORCHRL_INDEX, Index
from gear_torchrl.store.numbered_reads import NumberedReads
from gear_torchrl.store.rate_counters import SharedRateCounters
from gear_torchrl.store.read_sections import ReadSections
from gear_torchrl.store.ring import DEFAULT_END_KEYS, Ring, as_leaves
from gear_torchrl.store.seen_commits import SeenCommits
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.shared_columns import SharedColumns, refuse_objects
from gear_torchrl.store.shared_memory import Janitor, create_segment, new_store_id, segment_path
from gear_torchrl.store.table_spec import Data, Leaves, NestedKey
from gear_torchrl.store.visibility import Visibility
from gear_torchrl.store.windows import Windows


@dataclass(frozen=True)
class SharedStoreHandle:
    """What another process needs to attach to a shared store (small and picklable)."""

    store_id: str
    capacity: int
    end_keys: tuple[NestedKey, ...]
    traj_key: NestedKey | None
    ndim: int = 1  # TorchRL's: 2 holds [T, num_envs] steps


def shared_shard(
    capacity: int,
    *,
    handle: SharedStoreHandle | None = None,
    register_host: bool = False,
    out_device: torch.device | str | None = None,
    end_keys: Sequence[NestedKey] = DEFAULT_END_KEYS,
    traj_key: NestedKey | None = None,
    reader_timeout_s: float = DEFAULT_READER_TIMEOUT_S,
    addressing: type[Addressing] = StepRows,
) -> Shard:
    """A shard whose rows live in shared memory: a new store (``handle=None``) or the one ``handle`` names.

    The creating process owns the segments: they are removed when it calls
    ``close()`` or exits, however it exits. Attaching takes the capacity, keys
    and addressing from the handle.
    """
    if handle is not None:
        capacity, end_keys, traj_key = handle.capacity, handle.end_keys, handle.traj_key
        addressing = addressing_of(handle.ndim)
    return Shard(
        capacity,
        register_host=register_host,
        out_device=out_device,
        end_keys=end_keys,
        traj_key=traj_key,
        addressing=addressing,
        visibility=SharedCommits(handle, reader_timeout_s),
    )


def shared_part(shard: Shard) -> SharedCommits:
    """``shard``'s shared commit log (its segments, counters and handle); TypeError for a local shard."""
    if not isinstance(shard.visibility, SharedCommits):
        raise TypeError("this shard holds this process's writes only: it has no shared commit log")
    return shard.visibility


class SharedCommits(Visibility):
    """The shared commit log a shard's rows are read through (``shared_shard`` builds such a shard).

    It holds the store's segments (``log``: the control segment, ``rates``: a rate limiter's
    counts, ``columns``: the columns' segments) and what this process has seen of the commits
    (``seen``), and keeps its read section and the numbering of outside indices in parts of
    their own (``ReadSections``, ``NumberedReads``).
    """

    in_place_writes = False  # other processes read these rows: a slice is a copy, and writes in place are refused

    def __init__(self, handle: SharedStoreHandle | None, reader_timeout_s: float = DEFAULT_READER_TIMEOUT_S) -> None:
        if handle is None:
            reader_timeout_us(reader_timeout_s)  # refuse a bad value before any segment exists
        self._attach_to = handle
        self._reader_timeout_s = reader_timeout_s

    def bind(self, shard: Ring) -> None:
        """Create the store's segments (no handle) or attach to them."""
        super().bind(shard)
        handle = self._attach_to
        self.capacity = shard.capacity
        self.is_owner = handle is None
        self._janitor: Janitor | None = None
        if handle is None:
            self.store_id = new_store_id()
            self._janitor = Janitor(self.store_id)
            path = segment_path(self.store_id, "control")
            create_segment(path, control_bytes())
            self.log = CommitLog(path, create_capacity=self.capacity, reader_timeout_s=self._reader_timeout_s)
        else:
            self.store_id = handle.store_id
            self.log = CommitLog(segment_path(self.store_id, "control"))
            self.log.check_open()
        self.rates = SharedRateCounters(
            segment_path(self.store_id, "rates"), create=self.is_owner, check_open=self.log.check_open
        )
        ring = self.shard  # the parts hold the shard weakly too, as this part does
        self.columns = SharedColumns(ring, self.log, self.store_id)  # the columns' segments, as mapped here
        self.seen = SeenCommits(ring)  # the positions this process has replayed
        self._sections = ReadSections(ring, self.log, self.columns, self.seen)
        self._numbering = NumberedReads(self._sections)
        self._closed = False
        self.columns.map_new()

    @property
    def handle(self) -> SharedStoreHandle:
        shard = self.shard
        return SharedStoreHandle(self.store_id, self.capacity, shard.end_keys, shard.traj_key, shard.addressing.ndim)

    @property
    def mapped_layout_version(self) -> int:
        """The layout version whose columns this process has mapped (``mapped_columns`` maps the newest)."""
        return self.columns.layout_version

    def mapped_columns(self) -> list[torch.Tensor]:
        """The columns, mapped if a writer has published them since this process attached."""
        return self.columns.mapped()

    # -- writes: reserve, copy, commit ---------------------------------------------------
    def write(self, index: Index, data: Data, *, append: bool, lead: torch.Size | None) -> torch.Tensor:
        """Append ``data`` as one commit; ``index`` (a writer's cursor) only gives the row count."""
        if not append:
            raise NotImplementedError(
                "a shared GearStorage takes appends only (extend, add, TrajectoryWriter): an in-place "
                "write (write_at, storage[i] = ...) could change rows another process is reading"
            )
        self.columns.map_new()  # check against the layout other processes may have grown since
        single = isinstance(index, (int, np.integer))
        leaves = as_leaves(data, single, self.shard.table, lead=lead)  # never any layout: the store's
        return self.commit(leaves.flat())

    def commit(self, leaves: Leaves) -> torch.Tensor:
        """Write checked rows (``validated``) as one unit, readable all at once.

        Keys the store lacks become new columns first. Columns another process added
        after ``leaves`` were checked read zeros in these rows, as in every row written before.
        """
        leaves = self.columns.placed(leaves)
        values, columns, n = leaves.values, leaves.columns, leaves.n
        if n > self.capacity:  # only the newest `capacity` rows would survive
            values, n = [v[n - self.capacity :] for v in values], self.capacity
        reservation = self.log.reserve(n)
        rows = (torch.arange(n, dtype=torch.int64) + reservation.position) % self.capacity
        if leaves.missing:  # only TorchRL's "index" (``validated``): the rows' own positions
            values = [*values, self.shard.addressing.torchrl_positions(rows)]
            columns = (*columns, leaves.spec.position(TORCHRL_INDEX))
        try:
            self.columns.map_new()  # columns added since: these rows may hold an older lap's bytes there
            if len(columns) < len(self.shard.columns):
                spec = self.shard.table
                assert spec is not None, "laid out by ``SharedColumns.placed``"
                unwritten = [i for i in range(len(self.shard.columns)) if i not in columns]
                values = [
                    *values,
                    *(torch.zeros((n, *spec.columns[i].row_shape), dtype=spec.columns[i].dtype) for i in unwritten),
                ]
                columns = (*columns, *unwritten)
            self.log.await_readers(reservation)
            self.shard.copy_in(rows, values, columns, contiguous=True)
        except BaseException:
            self.log.commit(reservation, dead=True)
            raise
        self.log.commit(reservation)
        return rows

    def set_size(self, size: int) -> None:
        raise NotImplementedError("a shared GearStorage's length follows its commits; it cannot be set")

    # ``fill_to`` is Visibility's: the segments are created zero-filled, so no row ever exposes memory
    # nothing filled.
    def clear(self) -> None:
        self.log.empty()

    def after_inplace_write(self) -> None:
        raise NotImplementedError("a shared GearStorage takes appends only: its rows are not written in place")

    # -- reads -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        seen = self.seen
        return seen.hi - seen.lo

    @property
    def seen_positions(self) -> tuple[int, int]:
        """The positions ``[lo, hi)`` this process's episode index covers (as of its last refresh)."""
        return self.seen.positions

    @property
    def head(self) -> int:
        return self.seen.hi % self.capacity

    @property
    def rows_inserted(self) -> int:
        """Rows every process committed (the control segment counts them)."""
        return self.log.inserts

    @property
    def ring_rows(self) -> int:
        return min(self.seen.hi, self.capacity)

    def readable_rows(self) -> int:
        """``len``: the live rows, other processes' commits caught up (during a scan's sample, the scan's)."""
        return self._numbering.count()

    def read(self, index: Index) -> Data:
        """Ring rows picked in this read section (this library's samplers), or live rows oldest first.

        An index from outside (TorchRL's samplers, ``rb[i]``) numbers the live rows, ``[0, len)``
        (``store/numbered_reads.py``): never a row being rewritten or left by a crash, and a slice
        keeps that numbering, and its read section, for the rest of SliceSampler's sample.
        """
        if self._sections.is_open and not self._numbering.scan_held:  # ring rows, picked in this read section
            with self.reading():  # ends the section, however the checks go
                return self.read_rows(self.ring_index(index))
        return self._numbering.read(index, self.read_rows)

    def uniform_rows(self, n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
        """``n`` live rows, uniformly: rows crashed writers left are never drawn, whatever their share."""
        live = self.seen.live_rows()
        if len(live) == 0:
            raise EmptyStoreError("cannot sample from an empty storage: no process has committed rows yet")
        offsets = torch.randint(0, len(live), (n,), generator=generator)
        return (live.positions(offsets) % self.capacity).to(device)

    def rows_in_write_order(self) -> torch.Tensor:
        """Live rows (every process's commits, less rows crashed writers left), oldest commit first."""
        live = self.seen.live_rows()
        return live.positions(torch.arange(len(live), dtype=torch.int64)) % self.capacity

    @contextmanager
    def picking(self) -> Iterator[None]:
        self._numbering.drop_scan()
        self.refresh()
        try:
            yield
        except BaseException:
            self._sections.close()
            raise

    def reading(self) -> AbstractContextManager[None]:
        return self._sections.reading()

    def release(self) -> None:
        self._sections.close()

    def refresh(self) -> None:
        """Open a read section and replay what was published since the last one."""
        self._sections.open()

    def claim_gather(self, num_rows: int) -> None:
        """Writers wait for this read the reader timeout plus what gathering ``num_rows`` takes
        (``ReadSections.claim_gather``)."""
        self._sections.claim_gather(num_rows)

    def check_readable(self, rows: torch.Tensor) -> None:
        self.seen.check_readable(rows)

    def check_readable_windows(self, windows: Windows) -> None:
        self.seen.check_readable_windows(windows)

    def rows_changed_since(self, position: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        return self.seen.rows_changed_since(position)

    # -- snapshots and state ---------------------------------------------------------------
    def state(self) -> dict:
        """The readable episodes as a local shard's state: compacted, oldest first, at rows ``0..n-1``.

        A consistent snapshot taken while other processes keep committing (a read
        section holds eviction back while the rows are copied). Rows a crashed
        writer left are not saved. A local or a new shared storage loads it.
        """
        return self.snapshot()[0]

    def snapshot(self) -> tuple[dict, torch.Tensor]:
        """``state()`` and the ring row each saved row came from (what per-row state elsewhere follows)."""
        with self.picking():  # ends the read section itself if anything here raises
            rows = self.rows_in_write_order()
            ends = torch.isin(rows, self.shard.addressing.closed_ends())  # commits end episodes the flags do not
            mapped = self.mapped_columns()  # another process may have laid the columns out since we attached
            if self.shard.table is not None:
                self.claim_gather(rows.numel())  # the whole store: writers wait that long on top, no longer
            columns = [c[rows] for c in mapped] if self.shard.table is not None else []
        self.release()
        shard = self.shard
        copy = Shard(self.capacity, end_keys=shard.end_keys, traj_key=shard.traj_key, addressing=type(shard.addressing))
        copy.addressing.load_state(shard.addressing.state())
        if shard.table is not None:
            copy.take_rows(Leaves.whole(shard.table, columns), rows.numel(), rows.numel() % self.capacity, ends=ends)
        return copy.state(), rows

    def load_state(self, state: dict) -> None:
        """Commit a saved shard's episodes into this empty shared store, oldest first, one commit each.

        Every commit ends its episode, so an episode that was still open when saved
        is closed here.
        """
        if self.rows_inserted or self.readable_rows():
            raise ValueError("a checkpoint loads into an empty shared store only: this one already holds rows")
        spec, columns, _ = self.shard.checked_state(state)
        if spec is None or not columns:
            return
        refuse_objects(spec)
        saved = type(self.shard.addressing)(self.capacity)  # the saved episode index, to cut commits where it ends
        saved.load_state(state)
        saved.episodes.load(state["episodes"])
        size, head = int(state["size"]), int(state["head"])
        rows = (torch.arange(size, dtype=torch.int64) + (head if size == self.capacity else 0)) % self.capacity
        step = saved.rows_per_step
        ends_every_env = torch.isin(rows, saved.closed_ends()).view(-1, step).all(1)
        cuts = ((torch.nonzero(ends_every_env).reshape(-1) + 1) * step).tolist()
        self.shard.addressing.load_state(state)  # published with the columns' layout by the first commit
        for commit_rows in torch.tensor_split(rows, [c for c in cuts if c < size]):
            self.commit(Leaves.whole(spec, [c[commit_rows] for c in columns]))

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Detach; the owner also removes the segments (attached processes then fail clearly)."""
        if self._closed:
            return
        self._closed = True
        if self.is_owner:
            self.log.mark_closed()
        self.log.close()
        self.rates.close()
        if self._janitor is not None:
            self._janitor.release()
