"""The control segment of a shared store: who may write which rows, and what is readable.

Rows are numbered by *position*, a 64-bit count of rows ever reserved (ring
row = position % capacity). Writers in any process:

1. ``reserve(n)`` under the lock: take positions ``[R, R + n)`` and append a
   reservation record. Rows older than ``R + n - capacity`` are evicted now,
   before anyone overwrites them.
2. Wait for the readers that began before that eviction to finish (a grace
   period; only when the reservation evicts rows).
3. Copy the rows, outside the lock, in parallel with other writers.
4. ``commit(record)`` under the lock: the record is done, and the published
   end advances over every leading record that is done.

Readers ``begin_read()`` under the lock: a snapshot of the reserved and
published ends and the records published since their last look, and a
reader slot stamped with the current epoch that holds back writers' grace
periods until ``end_read()``. A reader therefore sees whole records only,
never a row being written.

The grace period is bounded (``reader_timeout_s``, set by the owner for every
process): a reader that overstays (stopped, debugged, paused) loses its claim.
The writer bumps the slot's revocation count and goes on; the reader finds the
count changed at ``end_read`` and raises :class:`ReadRevokedError` instead of
returning rows that may have been overwritten under it. A writer that dies holding a reservation is
found by the next publish (its pid is gone) and its record is marked dead:
published, never sampled, overwritten on the next lap of the ring.

The lock is ``flock`` on the control segment plus a thread lock: the kernel
drops a dead process's ``flock``, so no crash can leave the store locked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gear_torchrl.errors import StoreClosedError
from gear_torchrl.kernels import _C
from gear_torchrl.store.control_layout import SPEC_BYTES, PublishedLayout
from gear_torchrl.store.processes import pid_exists, process_alive
from gear_torchrl.store.reader_slots import ReaderSlots
from gear_torchrl.store.shared_memory import PAGE, SegmentLock, map_segment, page_round

MAGIC = 0x47454152_54524C31  # "GEARTRL1"
# The header's words, a reader slot's and the store's states are defined once, in the extension that reads
# them too (csrc/net/control_words.h, as ``_C.control``).
_W = _C.control
_H_MAGIC, _H_CAPACITY, _H_OWNER, _H_STATE = _W.H_MAGIC, _W.H_CAPACITY, _W.H_OWNER, _W.H_STATE
_H_RESERVED, _H_PUBLISHED, _H_NEXT_SEQ = _W.H_RESERVED, _W.H_PUBLISHED, _W.H_NEXT_SEQ
_H_PUBLISHED_SEQ, _H_EPOCH, _H_INSERTS = _W.H_PUBLISHED_SEQ, _W.H_EPOCH, _W.H_INSERTS
_H_SPEC_LEN, _H_RECORDS, _H_READERS, _H_FLOOR = _W.H_SPEC_LEN, _W.H_RECORDS, _W.H_READERS, _W.H_FLOOR
_H_EVICTED, _H_EVICT_EPOCH = _W.H_EVICTED, _W.H_EVICT_EPOCH  # rows below EVICTED - capacity are gone, since that epoch
_H_READER_TIMEOUT_US = _W.H_READER_TIMEOUT_US  # how long a writer waits for a reader before revoking its read
_H_LAYOUT_VERSION = _W.H_LAYOUT_VERSION  # bumped each time the columns' layout grows (0: none yet)
_H_DEAD_END = _W.H_DEAD_END  # the end of the newest run a dead writer left: readable rows above it are all whole
_EVICT_BLOCKS = 64  # the ring evicts 1/64 of itself at a time
_HEADER_SLOTS = PAGE // 8

OPEN, CLOSED, OWNER_DIED = _W.OPEN, _W.CLOSED, _W.OWNER_DIED
RESERVED, COMMITTED, DEAD = 1, 2, 3

RECORDS = 1 << 16  # commits a reader may lag behind before it loses track of the oldest rows
READER_SLOTS = 256  # processes reading one store at once
_SLOT_WORDS = _W.SLOT_WORDS  # a reader slot's words (store/reader_slots.py)
DEFAULT_READER_TIMEOUT_S = 1.0  # on top of what each read claims for its size (claim_gather)


@dataclass(frozen=True)
class Reservation:
    seq: int
    position: int  # first position reserved
    num_rows: int
    epoch: int  # readers that began before this epoch must finish before the copy
    evicts: bool


@dataclass(frozen=True)
class ReadSnapshot:
    evicted_end: int  # positions below evicted_end - capacity are gone
    published_end: int
    floor: int  # positions below it were emptied
    # Records published since the reader's last look: int64 [k, 3] of (position, rows, dead).
    records: np.ndarray
    # Records that left the table before this reader saw them (it lags by more than the table).
    lost: bool


def eviction_block(capacity: int) -> int:
    """Rows an eviction takes ahead of the writer that triggers it."""
    return max(1, capacity // _EVICT_BLOCKS)


def reader_timeout_us(seconds: float) -> int:
    """The reader timeout as the control segment keeps it; raises ValueError unless positive."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"reader_timeout must be a positive number of seconds, got {seconds!r}")
    return max(1, int(seconds * 1e6))


def control_bytes(num_records: int = RECORDS, num_readers: int = READER_SLOTS) -> int:
    return page_round(8 * (_HEADER_SLOTS + 4 * num_records + _SLOT_WORDS * num_readers) + SPEC_BYTES)


class CommitLog:
    """One process's view of a store's control segment: the header's words and the records, with the
    writers' and readers' protocol over them.

    The segment's other regions are parts of their own: the reader slots (``readers``,
    ``store/reader_slots.py``) and the columns' layout (``layout``, ``store/control_layout.py``).
    """

    def __init__(
        self,
        path: Path,
        *,
        create_capacity: int | None = None,
        num_records: int = RECORDS,
        num_readers: int = READER_SLOTS,
        reader_timeout_s: float = DEFAULT_READER_TIMEOUT_S,
    ) -> None:
        self.path = path
        self._map = map_segment(path)
        words = np.frombuffer(self._map, dtype=np.int64)
        self._h = words[:_HEADER_SLOTS]
        if create_capacity is not None:
            self._h[_H_CAPACITY] = create_capacity
            self._h[_H_OWNER] = os.getpid()
            self._h[_H_RECORDS] = num_records
            self._h[_H_READERS] = num_readers
            self._h[_H_EPOCH] = 1
            self._h[_H_READER_TIMEOUT_US] = reader_timeout_us(reader_timeout_s)
            self._h[_H_MAGIC] = MAGIC
        elif self._h[_H_MAGIC] != MAGIC:
            raise StoreClosedError(f"{path} is not a gear_torchrl control segment (or was not finished)")
        k, s = int(self._h[_H_RECORDS]), int(self._h[_H_READERS])
        self.capacity = int(self._h[_H_CAPACITY])
        self.owner_pid = int(self._h[_H_OWNER])
        self._records = words[_HEADER_SLOTS : _HEADER_SLOTS + 4 * k].reshape(k, 4)
        readers = words[_HEADER_SLOTS + 4 * k : _HEADER_SLOTS + 4 * k + _SLOT_WORDS * s].reshape(s, _SLOT_WORDS)
        spec_at = 8 * (_HEADER_SLOTS + 4 * k + _SLOT_WORDS * s)
        self._lock = SegmentLock(path)
        self.readers = ReaderSlots(readers, self._h, self._lock)  # who reads, since which epoch
        self.layout = PublishedLayout(self._h, memoryview(self._map)[spec_at : spec_at + SPEC_BYTES], self._lock)
        self._seen_seq = 0  # records before this one are in this reader's view

    # -- locking and liveness --------------------------------------------------------
    def _locked(self) -> SegmentLock:
        return self._lock

    def check_open(self) -> None:
        state = int(self._h[_H_STATE])
        # The janitor marks the state when the owner ends; the signal-0 probe covers a janitor
        # killed with it (a zombie owner passes it, but its janitor has marked the state by then).
        if state == OPEN and pid_exists(self.owner_pid):
            return
        if state == CLOSED:
            raise StoreClosedError("the shared store was closed by its owner")
        raise StoreClosedError(f"the shared store's owner (pid {self.owner_pid}) died; its data is gone")

    def mark_closed(self) -> None:
        self._h[_H_STATE] = CLOSED

    # -- writers ------------------------------------------------------------------------
    def reserve(self, num_rows: int) -> Reservation:
        if not 0 < num_rows <= self.capacity:
            raise ValueError(f"a commit must hold 1 to {self.capacity} rows (the ring's size), got {num_rows}")
        with self._locked():
            self.check_open()
            seq = int(self._h[_H_NEXT_SEQ])
            k = self._records.shape[0]
            if seq - int(self._h[_H_PUBLISHED_SEQ]) >= k:
                self._publish()
                if seq - int(self._h[_H_PUBLISHED_SEQ]) >= k:
                    raise RuntimeError(f"{k} commits are in flight at once; the control segment holds no more")
            position = int(self._h[_H_RESERVED])
            end = position + num_rows
            self._records[seq % k] = (position, num_rows, os.getpid(), RESERVED)
            self._h[_H_RESERVED] = end
            self._h[_H_NEXT_SEQ] = seq + 1
            evicts = end > self.capacity
            if evicts and end > int(self._h[_H_EVICTED]):
                self._evict_block(end)
            return Reservation(seq, position, num_rows, int(self._h[_H_EVICT_EPOCH]), evicts)

    def _evict_block(self, end: int) -> None:
        """Make the oldest rows unreadable a block ahead of ``end`` (lock held).

        Writers then wait for readers once per block, not once per commit: the
        reservations inside the block find their rows evicted already, at an
        epoch whose older readers the first of them waited for.
        """
        block = eviction_block(self.capacity)
        self._h[_H_EVICTED] = min(end + block, end + self.capacity - 1)
        self._h[_H_EPOCH] += 1
        self._h[_H_EVICT_EPOCH] = self._h[_H_EPOCH]

    def await_readers(self, reservation: Reservation) -> None:
        """Wait until no reader that began before the reservation's eviction is still reading.

        A reader still there after the reader timeout loses its claim (``ReaderSlots.wait_for``):
        no reader, stopped or slow, holds writers back for longer.
        """
        if reservation.evicts:
            self.readers.wait_for(reservation.epoch, self.check_open)

    def commit(self, reservation: Reservation, *, dead: bool = False) -> None:
        """Publish a reservation; its rows count as inserts."""
        with self._locked():
            k = self._records.shape[0]
            self._records[reservation.seq % k, 3] = DEAD if dead else COMMITTED
            if dead:
                self._mark_dead_end(reservation.position + reservation.num_rows)
            else:
                self._h[_H_INSERTS] += reservation.num_rows
            self._publish()

    def _publish(self) -> None:
        """Advance the published end over leading records that are done (lock held)."""
        k = self._records.shape[0]
        seq, end = int(self._h[_H_PUBLISHED_SEQ]), int(self._h[_H_NEXT_SEQ])
        while seq < end:
            record = self._records[seq % k]
            if record[3] == RESERVED:
                if process_alive(int(record[2])):
                    break
                record[3] = DEAD  # its writer died mid-copy
                self._mark_dead_end(int(record[0] + record[1]))
            seq += 1
        if seq != int(self._h[_H_PUBLISHED_SEQ]):
            last = self._records[(seq - 1) % k]
            self._h[_H_PUBLISHED] = last[0] + last[1]
            self._h[_H_PUBLISHED_SEQ] = seq

    def _mark_dead_end(self, end: int) -> None:
        self._h[_H_DEAD_END] = max(int(self._h[_H_DEAD_END]), end)

    # -- readers --------------------------------------------------------------------------
    def begin_read(self) -> ReadSnapshot:
        """Snapshot what is readable and hold back evictions of it until ``end_read``."""
        with self._locked():
            self.check_open()
            self._publish()  # also finds writers that died holding the head reservation
            self.readers.begin(int(self._h[_H_EPOCH]))  # an open section keeps its older epoch
            published_seq = int(self._h[_H_PUBLISHED_SEQ])
            k = self._records.shape[0]
            first = max(self._seen_seq, published_seq - k)
            seqs = np.arange(first, published_seq) % k
            records = self._records[seqs][:, [0, 1, 3]].copy()
            records[:, 2] = records[:, 2] == DEAD
            snapshot = ReadSnapshot(
                self._evicted_end(),
                int(self._h[_H_PUBLISHED]),
                int(self._h[_H_FLOOR]),
                records,
                lost=first > self._seen_seq,
            )
            self._seen_seq = published_seq
            return snapshot

    def version(self) -> tuple[int, ...]:
        """What a reader's view depends on (publishes, reservations, evictions, empties), read without
        the lock: equal to the value before a ``begin_read`` means nothing a reader sees changed since."""
        h = self._h
        return int(h[_H_PUBLISHED_SEQ]), int(h[_H_RESERVED]), int(h[_H_EVICTED]), int(h[_H_FLOOR])

    def end_read(self) -> None:
        """Close the read section; raises ReadRevokedError if a writer took it back meanwhile
        (``ReaderSlots.end``)."""
        self.readers.end()

    def claim_longer(self, seconds: float) -> None:
        """Let writers wait ``seconds`` more than the reader timeout for the open read section
        (``ReaderSlots.claim_longer``)."""
        self.readers.claim_longer(seconds)

    def native_words(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The header and this process's reader slot, for the extension's reader (``csrc/net/owner.cpp``):
        it follows ``begin_read`` and ``end_read`` without the lock, and leaves rows a dead writer left,
        and everything else unusual, to this class."""
        with self._locked():
            own = self.readers.own_words()
        return torch.from_numpy(self._h), torch.from_numpy(own)

    @property
    def reading(self) -> bool:
        """Whether this process's read section is open."""
        return self.readers.reading

    @property
    def seen_seq(self) -> int:
        """The records this reader has seen (its next ``begin_read`` starts there)."""
        return self._seen_seq

    @property
    def num_records(self) -> int:
        return int(self._records.shape[0])

    def records_unseen(self) -> int:
        """Records published since this reader last looked (read without the lock)."""
        return int(self._h[_H_PUBLISHED_SEQ]) - self._seen_seq

    @property
    def inserts(self) -> int:
        """Rows every process committed (for ``stats``)."""
        return int(self._h[_H_INSERTS])

    @property
    def reserved_end(self) -> int:
        """Rows ever reserved (read without the lock)."""
        return int(self._h[_H_RESERVED])

    def _evicted_end(self) -> int:
        """Positions below this minus the capacity are gone (reserved over, or evicted ahead)."""
        return max(int(self._h[_H_RESERVED]), int(self._h[_H_EVICTED]))

    def empty(self) -> None:
        """Every row written or being written so far stops being readable."""
        with self._locked():
            self.check_open()
            self._h[_H_FLOOR] = self._h[_H_RESERVED]

    def close(self) -> None:
        """Unmap; the segment itself belongs to the janitor."""
        self.readers.close()
        self._lock.close()
        del self._h, self._records
        self.layout.close()
        self._map.close()
