"""Reads of a shared store at indices from outside this library's samplers: they number the live rows.

TorchRL's samplers and ``rb[i]`` index a storage ``[0, len)``. Over a shared
store those indices number the live rows, oldest first (``store/live_rows.py``):
never a row being rewritten or left by a crash. ``len`` counts them, and indices
drawn from that count name the newest that many rows when read. A slice
(SliceSampler's ``storage[:]``, its scan) keeps its numbering, and its read
section, for the two index reads of SliceSampler's sample (its markers, then the
batch), so the windows computed from the scan read the very rows it saw and
writers wait (at most the reader timeout) rather than overwrite them. A row
overwritten since it was numbered is an IndexError, never another row's data.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gear_torchrl.errors import EmptyStoreError
from gear_torchrl.store.indices import Index, as_index_tensor
from gear_torchrl.store.live_rows import LiveRows
from gear_torchrl.store.read_sections import ReadSections
from gear_torchrl.store.table_spec import Data

# SliceSampler reads ``storage[index]`` for its markers, then the buffer reads the batch.
_SCAN_INDEX_READS = 2


class NumberedReads:
    """The numbering outside indices were drawn from (the last ``len``, or a scan's), and reads through it."""

    def __init__(self, sections: ReadSections) -> None:
        self._sections = sections  # the read section it reads in: the shard's ring, commit log and positions
        self._numbered: int | None = None  # the last ``len``: indices from outside number the newest that many
        self._scan: LiveRows | None = None  # a slice read's rows: what indices number during its sample
        self.scan_held = False  # the scan's read section is still open
        self._scan_reads = 0  # index reads its sample still makes

    def count(self) -> int:
        """``len``: the live rows, other processes' commits caught up (during a scan's sample, the scan's)."""
        if self._scan is not None and self.scan_held and not self._sections.log.readers.revoked():
            return len(self._scan)
        self.drop_scan()
        sections = self._sections
        if not sections.is_open and sections.has_news():  # catch up, in a section of its own
            sections.open()
            sections.close()
        self._numbered = len(self._sections.seen.live_rows())
        return self._numbered

    def read(self, index: Index, read_rows: Callable[[torch.Tensor], Data]) -> Data:
        """The rows ``index`` numbers, gathered by ``read_rows`` (the visibility's); a slice starts a scan."""
        if isinstance(index, slice) or (isinstance(index, tuple) and isinstance(index[0], slice)):
            self.drop_scan()
            self._sections.open()
            self._scan, self._scan_reads = self._sections.seen.live_rows(), _SCAN_INDEX_READS
            return self._read_held(index, self._scan, read_rows)
        scan = self._scan
        if scan is None:
            if not self._sections.is_open:
                self._sections.open()
            return self._read_held(index, None, read_rows)
        if self._sections.log.readers.revoked():  # held too long: rows may have moved, look again
            self._sections.close(quietly=True)
            self._sections.open()
        self._scan_reads -= 1
        if self._scan_reads == 0:
            self._scan = None
        return self._read_held(index, scan, read_rows)

    def _read_held(self, index: Index, scan: LiveRows | None, read_rows: Callable[[torch.Tensor], Data]) -> Data:
        """Read what ``index`` numbers; the section stays open while the scan ``scan`` expects reads."""
        sections = self._sections
        try:
            offsets, positions = self._numbered_positions(index, scan)
            gone = positions < self._sections.seen.lo
            if bool(gone.any()):
                raise IndexError(
                    f"read index {int(offsets.reshape(-1)[gone][0])} names a row that was overwritten "
                    "since it was numbered (writers lapped the store meanwhile); sample again"
                )
            rows = (positions % self._sections.seen.capacity).reshape(offsets.shape)
            sections.hold = self.scan_held = self._scan is not None
            batch = read_rows(rows.reshape(()) if isinstance(index, (int, np.integer)) else rows)
            if self.scan_held:
                self._sections.log.readers.raise_if_revoked()
            return batch
        except BaseException:
            self.drop_scan()
            if sections.is_open:
                sections.close()
            raise
        finally:
            sections.hold = False

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
        live = self._sections.seen.live_rows()
        if len(live) == 0:
            raise EmptyStoreError("cannot read from an empty storage: no process has committed rows yet")
        count = len(live) if self._numbered is None else self._numbered
        offsets = as_index_tensor(index, count, "read")
        return offsets, live.positions(torch.remainder(offsets.reshape(-1) + (len(live) - count), len(live)))

    def _scan_offsets(self, index: Index, live: int) -> torch.Tensor:
        """The live rows a scan's ``index`` names: a slice (and more) into ``[T, num_envs]`` steps for env
        columns; rows of ``[0, live)`` otherwise (the steps a scan's later reads name are flat already)."""
        if self._sections.ring.num_envs is not None and isinstance(index, (slice, tuple)):
            return torch.arange(live, dtype=torch.int64).view(self._sections.ring.addressing.grid(live))[index]
        return as_index_tensor(index, live, "read")

    def drop_scan(self) -> None:
        """Forget a scan's numbering, and end the read section it held (nothing was read under it since)."""
        self._scan = None
        if self.scan_held:
            self.scan_held = False
            self._sections.close(quietly=True)
