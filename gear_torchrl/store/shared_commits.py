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

Each commit is a segment of its own: its last time step ends an episode unless
a trajectory key says the next commit continues it, since the next rows in
the ring may be another process's.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from gear_torchrl.errors import EmptyStoreError, ReadRevokedError, SpecMismatchError
from gear_torchrl.kernels import _C
from gear_torchrl.store.addressing import Addressing, StepRows, addressing_of
from gear_torchrl.store.commit_log import (
    DEFAULT_READER_TIMEOUT_S,
    CommitLog,
    ReadSnapshot,
    control_bytes,
    reader_timeout_us,
)
from gear_torchrl.store.indices import TORCHRL_INDEX, Index, as_index_tensor
from gear_torchrl.store.live_rows import LiveRows, dead_runs_array
from gear_torchrl.store.rate_counters import SharedRateCounters
from gear_torchrl.store.ring import DEFAULT_END_KEYS, Ring
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.shared_memory import (
    Janitor,
    create_segment,
    map_tensor,
    new_store_id,
    page_round,
    segment_path,
)
from gear_torchrl.store.table_spec import Data, Leaves, NestedKey, TableSpec, key_name
from gear_torchrl.store.visibility import Visibility
from gear_torchrl.store.windows import Windows

logger = logging.getLogger(__name__)

# SliceSampler reads ``storage[index]`` for its markers, then the buffer reads the batch.
_SCAN_INDEX_READS = 2
_SLOW_GATHER_BYTES_PER_S = 0.5e9  # what a read may claim to need, per byte, on top of the reader timeout
_NO_ROWS = torch.empty(0, dtype=torch.int64)  # what rows_changed_since returns when nothing changed (never written to)


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
    return Shard(capacity, register_host=register_host, out_device=out_device, end_keys=end_keys,
                 traj_key=traj_key, addressing=addressing, visibility=SharedCommits(handle, reader_timeout_s))


def shared_part(shard: Shard) -> SharedCommits:
    """``shard``'s shared commit log (its segments, counters and handle); TypeError for a local shard."""
    if not isinstance(shard.visibility, SharedCommits):
        raise TypeError("this shard holds this process's writes only: it has no shared commit log")
    return shard.visibility


class SharedCommits(Visibility):
    """The shared commit log a shard's rows are read through (``shared_shard`` builds such a shard)."""

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
        self.rates = SharedRateCounters(segment_path(self.store_id, "rates"), create=self.is_owner,
                                        check_open=self.log.check_open)
        self._lo = 0  # oldest position in this process's episode index
        self._hi = 0  # published end this process has replayed
        self._snapshot: ReadSnapshot | None = None  # set while a read section is open
        self._dead_runs: list[tuple[int, int]] = []  # [first, end) positions crashed writers left, in [lo, hi)
        self._numbered: int | None = None  # the last ``len``: indices from outside number the newest that many
        self._scan: LiveRows | None = None  # a slice read's rows: what indices number during its sample
        self._scan_held = False  # the scan's read section is still open
        self._scan_reads = 0  # index reads its sample still makes
        self._hold_section = False  # the read in progress leaves its section open
        self._closed = False
        self.segment: torch.Tensor | None = None  # the first columns' segment (bytes), once laid out
        self._segments: list[torch.Tensor] = []  # every columns' segment, mapped
        self._placement: list[tuple[int, int]] = []  # (segment, byte offset) of each column
        self._layout_version = 0  # of the layout mapped here (0: none yet)
        self._seen_version: tuple[int, ...] | None = None  # the commit log's version at the last refresh
        self._map_data()

    @property
    def handle(self) -> SharedStoreHandle:
        shard = self.shard
        return SharedStoreHandle(self.store_id, self.capacity, shard.end_keys, shard.traj_key, shard.addressing.ndim)

    # -- the columns' segments ---------------------------------------------------------------
    # The first write lays its columns out in segment "data"; a later write that brings new
    # keys lays those out in a segment of its own ("data1", "data2", ...), zero-filled, so
    # every row written before reads zeros there. The control segment holds the layout:
    # the spec, where each column lives and the addressing's layout (its number of env
    # columns). Each process maps what was added on its next access (``_map_data``: one
    # integer read when nothing changed).
    def _map_data(self) -> None:
        """Map the columns some process laid out or added since this process last looked."""
        if self.log.layout_version == self._layout_version:
            return
        version, layout = self.log.read_layout()
        if layout is None:
            return
        self.shard.addressing.load_state(layout)  # first: a write laid out for another number of envs is refused
        for index in range(len(self._segments), len(layout["segments"])):
            self._segments.append(map_tensor(segment_path(self.store_id, _segment_name(index))))
        self.segment = self._segments[0]
        spec = TableSpec.from_json(layout["spec"])
        columns = [self._segments[k][o: o + self.capacity * c.row_bytes].view(c.dtype).view(self.capacity, *c.row_shape)
                   for (k, o), c in zip(layout["placement"], spec.columns)]
        if self.shard.table is None:
            self.shard.adopt(spec, columns)
        else:
            self.shard.add_columns(spec, columns[len(self.shard.columns):])
        self._layout_version, self._placement = version, [tuple(p) for p in layout["placement"]]

    def _lay_out(self, spec: TableSpec) -> bool:
        """Publish ``spec`` (the store's plus new keys) with its new columns in a new zero-filled segment.

        False when another process changed the layout first (map it, merge, try again).
        """
        _refuse_objects(spec)
        index = len(self._segments)
        offsets, total = [], 0
        for c in spec.columns[len(self.shard.columns):]:
            offsets.append(total)
            total += page_round(max(1, self.capacity * c.row_bytes))
        path = segment_path(self.store_id, _segment_name(index))

        def create() -> None:
            path.unlink(missing_ok=True)  # left by a process that died laying it out (never published)
            create_segment(path, total)

        sizes = [int(t.numel()) for t in self._segments]
        layout = {"spec": spec.to_json(), "segments": [*sizes, total],
                  "placement": [*map(list, self._placement), *([index, o] for o in offsets)],
                  **self.shard.addressing.state()}
        published = self.log.publish_layout(layout, self._layout_version, create, lambda: path.unlink(missing_ok=True))
        self._map_data()
        return published

    def _placed(self, leaves: Leaves) -> Leaves:
        """``leaves`` addressed to the store's columns, after laying out the keys the store lacks."""
        while True:
            self._map_data()
            spec = leaves.spec if self.shard.table is None else self.shard.table.merged(leaves.spec)
            if spec is self.shard.table or self._lay_out(spec):
                assert self.shard.table is not None, "laid out by now, by this process or another"
                return leaves.placed_in(self.shard.table)

    # -- writes: reserve, copy, commit ---------------------------------------------------
    def write(self, index: Index, data: Data, *, append: bool, lead: torch.Size | None) -> torch.Tensor:
        """Append ``data`` as one commit; ``index`` (a writer's cursor) only gives the row count."""
        if not append:
            raise NotImplementedError(
                "a shared GearStorage takes appends only (extend, add, TrajectoryWriter): an in-place "
                "write (write_at, storage[i] = ...) could change rows another process is reading")
        self._map_data()  # check against the layout other processes may have grown since
        single = isinstance(index, (int, np.integer))
        leaves = self.shard.as_leaves(data, single, self.shard.table, lead=lead)  # never any layout: the store's
        return self.commit(leaves.flat())

    def commit(self, leaves: Leaves) -> torch.Tensor:
        """Write checked rows (``validated``) as one unit, readable all at once.

        Keys the store lacks become new columns first. Columns another process added
        after ``leaves`` were checked read zeros in these rows, as in every row written before.
        """
        leaves = self._placed(leaves)
        values, columns, n = leaves.values, leaves.columns, leaves.n
        if n > self.capacity:  # only the newest `capacity` rows would survive
            values, n = [v[n - self.capacity:] for v in values], self.capacity
        reservation = self.log.reserve(n)
        rows = (torch.arange(n, dtype=torch.int64) + reservation.position) % self.capacity
        if leaves.missing:  # only TorchRL's "index" (``validated``): the rows' own positions
            values = [*values, self.shard.addressing.torchrl_positions(rows)]
            columns = (*columns, leaves.spec.position(TORCHRL_INDEX))
        try:
            self._map_data()  # columns added since: these rows may hold an older lap's bytes there
            if len(columns) < len(self.shard.columns):
                spec = self.shard.table
                assert spec is not None, "laid out by ``_placed``"
                unwritten = [i for i in range(len(self.shard.columns)) if i not in columns]
                values = [*values, *(torch.zeros((n, *spec.columns[i].row_shape), dtype=spec.columns[i].dtype)
                                     for i in unwritten)]
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

    def fill_to(self, end: int) -> None:
        pass  # the segments are created zero-filled: no row ever exposes memory nothing filled

    def clear(self) -> None:
        self.log.empty()

    def after_inplace_write(self) -> None:
        raise NotImplementedError("a shared GearStorage takes appends only: its rows are not written in place")

    # -- reads -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self._hi - self._lo

    @property
    def seen_positions(self) -> tuple[int, int]:
        """The positions ``[lo, hi)`` this process's episode index covers (as of its last refresh)."""
        return self._lo, self._hi

    @property
    def head(self) -> int:
        return self._hi % self.capacity

    @property
    def rows_inserted(self) -> int:
        """Rows every process committed (the control segment counts them)."""
        return self.log.inserts

    # -- indices from outside this library's samplers: live rows, oldest first --------------
    def readable_rows(self) -> int:
        """``len``: the live rows, other processes' commits caught up (during a scan's sample, the scan's)."""
        if self._scan is not None and self._scan_held and not self.log.revoked():
            return len(self._scan)
        self._drop_scan()
        if self._snapshot is None and self.log.version() != self._seen_version:  # catch up, in a section of its own
            self.refresh()
            self._end_read()
        self._numbered = len(self._live_rows())
        return self._numbered

    @property
    def takes_any_layout(self) -> bool:
        return False  # the layout lives in the control segment, fixed by the first write of any process

    @property
    def in_place_writes(self) -> bool:
        return False  # other processes read these rows: a slice is a copy, and writes in place are refused

    def _live_rows(self) -> LiveRows:
        return LiveRows(self._lo, self._hi, dead_runs_array(self._dead_runs))

    def read(self, index: Index) -> Data:
        """Ring rows picked in this read section (this library's samplers), or live rows oldest first.

        An index from outside (TorchRL's samplers, ``rb[i]``) numbers the live rows, ``[0, len)``
        (``store/live_rows.py``): never a row being rewritten or left by a crash. A slice
        (SliceSampler's ``storage[:]``, its scan) keeps that numbering, and its read section,
        for the two index reads of SliceSampler's sample (its markers, then the batch), so
        the windows computed from the scan read the very rows it saw and writers wait
        (at most the reader timeout) rather than overwrite them. A row overwritten since
        it was numbered is an IndexError, never another row's data.
        """
        if self._snapshot is not None and not self._scan_held:  # ring rows, picked in this read section
            with self.reading():  # ends the section, however the checks go
                return self.read_rows(self.ring_index(index))
        if isinstance(index, slice) or (isinstance(index, tuple) and isinstance(index[0], slice)):
            self._drop_scan()
            self.refresh()
            self._scan, self._scan_reads = self._live_rows(), _SCAN_INDEX_READS
            return self._read_held(index, self._scan)
        return self._read_numbered(index)

    def _read_numbered(self, index: Index) -> Data:
        scan = self._scan
        if scan is None:
            if self._snapshot is None:
                self.refresh()
            return self._read_held(index, None)
        if self.log.revoked():  # held too long: rows may have moved, look again
            self._end_read(quietly=True)
            self.refresh()
        self._scan_reads -= 1
        if self._scan_reads == 0:
            self._scan = None
        return self._read_held(index, scan)

    def _read_held(self, index: Index, scan: LiveRows | None) -> Data:
        """Read what ``index`` numbers; the section stays open while the scan ``scan`` expects reads."""
        try:
            offsets, positions = self._numbered_positions(index, scan)
            gone = positions < self._lo
            if bool(gone.any()):
                raise IndexError(f"read index {int(offsets.reshape(-1)[gone][0])} names a row that was overwritten "
                                 "since it was numbered (writers lapped the store meanwhile); sample again")
            rows = (positions % self.capacity).reshape(offsets.shape)
            self._hold_section = self._scan_held = self._scan is not None
            batch = self.read_rows(rows.reshape(()) if isinstance(index, (int, np.integer)) else rows)
            if self._scan_held:
                self.log.raise_if_revoked()
            return batch
        except BaseException:
            self._drop_scan()
            if self._snapshot is not None:
                self._end_read()
            raise
        finally:
            self._hold_section = False

    def _numbered_positions(self, index: Index, scan: LiveRows | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``index`` checked against the count it was drawn from, and the positions it names.

        Without a scan, indices number the newest ``len`` live rows, now: a row evicted
        since ``len`` was counted is never named, as evictions take the oldest. When more
        were evicted than committed meanwhile, the oldest indices wrap to the newest rows:
        under writers that lap the store, an index names a live row, not a fixed one.
        """
        if scan is not None:
            offsets = self._scan_offsets(index, len(scan))
            return offsets, scan.positions(offsets.reshape(-1).cpu())
        live = self._live_rows()
        if len(live) == 0:
            raise EmptyStoreError("cannot read from an empty storage: no process has committed rows yet")
        count = len(live) if self._numbered is None else self._numbered
        offsets = as_index_tensor(index, count, "read")
        return offsets, live.positions(torch.remainder(offsets.reshape(-1) + (len(live) - count), len(live)))

    def _scan_offsets(self, index: Index, live: int) -> torch.Tensor:
        """The live rows a scan's ``index`` names: a slice (and more) into ``[T, num_envs]`` steps for env
        columns; rows of ``[0, live)`` otherwise (the steps a scan's later reads name are flat already)."""
        if self.shard.num_envs is not None and isinstance(index, (slice, tuple)):
            return torch.arange(live, dtype=torch.int64).view(self.shard.addressing.grid(live))[index]
        return as_index_tensor(index, live, "read")

    def _drop_scan(self) -> None:
        """Forget a scan's numbering, and end the read section it held (nothing was read under it since)."""
        self._scan = None
        if self._scan_held:
            self._scan_held = False
            self._end_read(quietly=True)

    def uniform_rows(self, n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
        """``n`` live rows, uniformly: rows crashed writers left are never drawn, whatever their share."""
        live = self._live_rows()
        if len(live) == 0:
            raise EmptyStoreError("cannot sample from an empty storage: no process has committed rows yet")
        offsets = torch.randint(0, len(live), (n,), generator=generator)
        return (live.positions(offsets) % self.capacity).to(device)

    def _dead(self, rows: torch.Tensor) -> torch.Tensor:
        """Which of ``rows`` (readable ring rows) a writer that died left half-written."""
        runs = dead_runs_array(self._dead_runs)
        position = (self._hi - 1 - (self._hi - 1 - rows.reshape(-1).cpu()) % self.capacity).numpy()
        run = np.searchsorted(runs[:, 0], position, side="right") - 1
        return torch.from_numpy((run >= 0) & (position < runs[np.maximum(run, 0), 1])).reshape(rows.shape)

    @property
    def _has_dead(self) -> bool:
        return bool(self._dead_runs)

    @property
    def ring_rows(self) -> int:
        return min(self._hi, self.capacity)

    @contextmanager
    def picking(self) -> Iterator[None]:
        self._drop_scan()
        self.refresh()
        try:
            yield
        except BaseException:
            self._end_read()
            raise

    @contextmanager
    def reading(self) -> Iterator[None]:
        if self._snapshot is None:
            self.refresh()
        try:
            yield
            if self.shard.out_device.type == "cuda":
                torch.cuda.current_stream(self.shard.out_device).synchronize()  # the kernel reads host rows
        finally:
            if not self._hold_section:
                self._end_read()

    def release(self) -> None:
        self._end_read()

    def column_offsets(self) -> list[int] | None:
        """Byte offset of each column in the first segment (what one-sided readers address);
        None once columns were added in segments of their own (one-sided reads cover one region)."""
        self._map_data()
        if any(segment for segment, _ in self._placement):
            return None
        return [offset for _, offset in self._placement]

    @property
    def mapped_layout_version(self) -> int:
        """The layout version whose columns this process has mapped (``mapped_columns`` maps the newest)."""
        return self._layout_version

    def mapped_columns(self) -> list[torch.Tensor]:
        """The columns, mapped if a writer has published them since this process attached."""
        self._map_data()
        return self.shard.columns

    def _end_read(self, quietly: bool = False) -> None:
        """Close the read section; ``quietly``: nothing was read under it, so a revocation does not matter."""
        self._snapshot = None
        try:
            self.log.end_read()
        except ReadRevokedError:
            if not quietly:
                raise

    def claim_gather(self, num_rows: int) -> None:
        """Writers wait for this read the reader timeout plus what gathering ``num_rows`` takes.

        Counted at a pessimistic 0.5 GB/s: a large read (a scan of the whole store)
        is not revoked for being large, and a small one adds next to nothing.
        """
        assert self.shard.table is not None, "rows are read from a shard that holds columns"
        self.log.claim_longer(num_rows * self.shard.table.row_bytes / _SLOW_GATHER_BYTES_PER_S)

    def check_readable(self, rows: torch.Tensor) -> None:
        rows = rows.reshape(-1).cpu()
        if rows.numel() == 0:
            return
        position = self._hi - 1 - (self._hi - 1 - rows) % self.capacity  # newest position of each ring row
        stale = position < self._lo
        if bool(stale.any()):
            raise IndexError(f"row {int(rows[stale][0])} is not readable: it was evicted or is being rewritten")
        if self._has_dead:
            dead = self._dead(rows)
            if bool(dead.any()):
                raise IndexError(f"row {int(rows[dead][0])} was left half-written by a writer that died")

    def check_readable_windows(self, windows: Windows) -> None:
        # The readable rows are the ring interval of positions [lo, hi): one C++ pass, no row list.
        plan = self.shard.addressing.gather_plan(windows)  # runs of ring rows
        row = _C.first_row_outside(plan.starts, plan.valid_begin, plan.valid_end, plan.seq_len,
                                   self.capacity, self._lo % self.capacity, self._hi - self._lo)
        if row >= 0:
            raise IndexError(f"row {row} is not readable: it was evicted or is being rewritten")
        if self._has_dead:
            self.check_readable(plan.rows(self.capacity)[windows.mask()])  # names the half-written row

    def refresh(self) -> None:
        """Open a read section and replay what was published since the last one."""
        self._seen_version = self.log.version()  # before the snapshot: a change after it shows as news
        snapshot = self.log.begin_read()
        self._snapshot = snapshot
        self._map_data()
        if snapshot.lost:
            logger.warning("this process fell more than the control segment's record table behind; "
                           "rows committed before the oldest record still held are not sampled by it")
            self.shard.episodes.clear()
            self._lo = self._hi = int(snapshot.records[0, 0]) if len(snapshot.records) else snapshot.published_end
        lo = max(snapshot.evicted_end - self.capacity, snapshot.floor, 0)
        step = self.shard.addressing.rows_per_step
        lo = -(-lo // step) * step  # whole time steps (evictions run a block ahead)
        for position, end, dead, record_ends in _runs(snapshot.records):
            self._evict_to(min(lo, position))
            first = max(position, lo)
            if first >= end:  # evicted before this process saw it
                self.shard.episodes.clear()
                self._lo = end
            else:
                if self._lo == self._hi:
                    self._lo = first
                self._replay(first, end, dead, record_ends)
            self._hi = end
        self._evict_to(lo)

    def _replay(self, first: int, end: int, dead: bool, record_ends: np.ndarray) -> None:
        """Append positions ``[first, end)``: dead rows, or committed records ending at ``record_ends``."""
        rows = torch.arange(first, end, dtype=torch.int64) % self.capacity
        if dead:
            self.shard.addressing.append_dead(rows)
            self._dead_runs.append((first, end))
            return
        ends, traj = self.shard.stored_ends(rows)
        if traj is None:  # the next commit in the ring may be another writer's: its last time step ends episodes
            step = self.shard.addressing.rows_per_step
            last = (record_ends[record_ends > first] - first) // step - 1
            ends.view(-1, step)[torch.from_numpy(last)] = True
        self.shard.addressing.append(rows, ends, traj, None, evicted=0)

    def rows_changed_since(self, position: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        old_lo, old_hi = position
        if old_lo == self._lo and old_hi == self._hi:  # nothing committed or evicted since: a pick's usual case
            return _NO_ROWS, _NO_ROWS, position
        gone_end = min(self._lo, old_hi)  # old rows now evicted; a ring row needs clearing once
        gone = torch.arange(max(old_lo, gone_end - self.capacity), max(old_lo, gone_end), dtype=torch.int64)
        gone %= self.capacity
        new = torch.arange(max(old_hi, self._lo), self._hi, dtype=torch.int64) % self.capacity
        if new.numel() and self._has_dead:
            dead = self._dead(new)
            gone, new = torch.cat([gone, new[dead]]), new[~dead]
        return gone, new, (self._lo, self._hi)

    def _evict_to(self, position: int) -> None:
        k = min(position, self._hi) - self._lo
        if k > 0:
            self.shard.addressing.evict(k)
            self._lo += k
        self._dead_runs = [(max(a, self._lo), b) for a, b in self._dead_runs if b > self._lo]

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
            live = self._live_rows()
            rows = live.positions(torch.arange(len(live), dtype=torch.int64)) % self.capacity  # oldest first
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
        _refuse_objects(spec)
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


def _runs(records: np.ndarray) -> Iterator[tuple[int, int, bool, np.ndarray]]:
    """Consecutive records grouped into runs of committed ones and single dead ones.

    Yields ``(first position, end position, dead, end position of each record)``,
    so a reader replays a burst of commits with one gather of their flags.
    """
    i, k = 0, len(records)
    while i < k:
        j = i + 1
        if not records[i, 2]:
            while j < k and not records[j, 2]:
                j += 1
        ends = records[i:j, 0] + records[i:j, 1]
        yield int(records[i, 0]), int(ends[-1]), bool(records[i, 2]), ends
        i = j


def _refuse_objects(spec: TableSpec) -> None:
    if spec.objects:
        raise SpecMismatchError(
            f"non-tensor leaves {sorted(key_name(k) for k in spec.objects)} cannot live in a shared GearStorage: "
            "other processes map its rows as raw bytes, and Python objects have none. Keep them in a local "
            "store, or encode them as tensors (ids, fixed-length bytes)")


def _segment_name(index: int) -> str:
    """Segment ``index`` of the columns: the first write's is "data", each later addition "data<k>"."""
    return "data" if index == 0 else f"data{index}"
