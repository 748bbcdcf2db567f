"""A process's read sections over a shared store: opened to catch up, held while rows are read, closed.

A sampler picks rows inside a read section and the storage gathers them under
the same one: opening it (``open``) snapshots the commit log, holding writers'
evictions of what it sees back until it closes (``store/commit_log.py``), maps
columns other processes added and replays the news into this process's view
(``store/seen_commits.py``). Writers wait for an open section at most the reader
timeout plus what its gather claims for its size (``claim_gather``); one held
longer is revoked, and closing it then raises ReadRevokedError.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from gear_torchrl.errors import ReadRevokedError
from gear_torchrl.store.commit_log import CommitLog, ReadSnapshot
from gear_torchrl.store.ring import Ring
from gear_torchrl.store.seen_commits import SeenCommits
from gear_torchrl.store.shared_columns import SharedColumns

_SLOW_GATHER_BYTES_PER_S = 0.5e9  # what a read may claim to need, per byte, on top of the reader timeout


class ReadSections:
    """This process's read section over one shared store: whether one is open, and what opens and closes it."""

    def __init__(self, ring: Ring, log: CommitLog, columns: SharedColumns, seen: SeenCommits) -> None:
        # What the section reads, and what reads through it (NumberedReads) reads too:
        self.ring = ring  # the shard's ring (a weak reference, as its visibility part holds it)
        self.log = log
        self.seen = seen
        self._columns = columns
        self.snapshot: ReadSnapshot | None = None  # set while a read section is open
        self.hold = False  # the read in progress leaves its section open (a scan's: ``NumberedReads``)
        self._seen_version: tuple[int, ...] | None = None  # the commit log's version at the last open

    @property
    def is_open(self) -> bool:
        """Whether this process holds a read section (opened by ``open``, not closed since)."""
        return self.snapshot is not None

    def has_news(self) -> bool:
        """Whether anything a reader sees changed since the last ``open`` (read without the lock)."""
        return self.log.version() != self._seen_version

    def open(self) -> None:
        """Open a read section and replay what was published since the last one."""
        self._seen_version = self.log.version()  # before the snapshot: a change after it shows as news
        snapshot = self.log.begin_read()
        self.snapshot = snapshot
        self._columns.map_new()
        self.seen.catch_up(snapshot)

    def close(self, quietly: bool = False) -> None:
        """Close the read section; ``quietly``: nothing was read under it, so a revocation does not matter."""
        self.snapshot = None
        try:
            self.log.end_read()
        except ReadRevokedError:
            if not quietly:
                raise

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Around a gather: in the open section (one is opened if none is), closed after unless ``hold``."""
        if self.snapshot is None:
            self.open()
        try:
            yield
            if self.ring.out_device.type == "cuda":
                torch.cuda.current_stream(self.ring.out_device).synchronize()  # the kernel reads host rows
        finally:
            if not self.hold:
                self.close()

    def claim_gather(self, num_rows: int) -> None:
        """Writers wait for this read the reader timeout plus what gathering ``num_rows`` takes.

        Counted at a pessimistic 0.5 GB/s: a large read (a scan of the whole store)
        is not revoked for being large, and a small one adds next to nothing.
        """
        assert self.ring.table is not None, "rows are read from a shard that holds columns"
        self.log.readers.claim_longer(num_rows * self.ring.table.row_bytes / _SLOW_GATHER_BYTES_PER_S)
