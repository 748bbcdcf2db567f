"""A shard's visibility part: which rows of its ring are committed and readable, and how writes get there.

A shard is a ring of columns built from two parts, as Reverb's ``Table`` holds
its selectors and limiter: an addressing (``store/addressing.py``: what a row
is) and a visibility (this module: what a reader sees). The ring, its gathers
and the samplers above are the same whatever the parts; only these calls differ.
A visibility part knows its shard as the ring (``store/ring.py``) it reads and
writes, not as the shard, which is built from it:

- ``OwnWrites`` (``store/own_writes.py``): the rows this process wrote, readable as
  soon as written; any write (appends, in-place writes, ``set_size``) is allowed.
- ``SharedCommits`` (``store/shared_commits.py``): rows any process committed to
  a shared commit log; appends only, read in sections that hold eviction back.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import ClassVar, cast

import torch

from gear_torchrl.errors import EmptyStoreError
from gear_torchrl.store.indices import Index, as_index_tensor
from gear_torchrl.store.ring import Ring
from gear_torchrl.store.table_spec import Data, Leaves
from gear_torchrl.store.windows import Windows


class Visibility(ABC):
    """The calls through which a shard's readers and writers meet its rows.

    The abstract members are what every part answers in its own way. The others
    have a concrete default: what a part whose rows only this process writes does
    (nothing: no section to open, nothing committed elsewhere, every row below
    ``size`` readable, nothing to let go of). A part overrides those it needs.
    """

    shard: Ring  # the shard, as the ring this part reads and writes
    in_place_writes: ClassVar[bool]
    """Whether stored rows may be written in place (views of the columns, ``set_size``): each part says."""

    def bind(self, shard: Ring) -> None:
        """Become ``shard``'s visibility (its ring and addressing are set up by then)."""
        self.point_back(shard)

    def point_back(self, shard: Ring) -> None:
        """Refer to ``shard``, weakly: the shard owns its parts, so a shard its users let go of is
        freed at once, its columns with it, not whenever the cycle collector runs."""
        self.shard = cast(Ring, weakref.proxy(shard))

    def __getstate__(self) -> dict:
        """A copy (pickled with its shard) leaves the reference back out: the copied shard points it back."""
        return {k: v for k, v in self.__dict__.items() if k != "shard"}

    # -- what is readable --------------------------------------------------------------
    @property
    @abstractmethod
    def size(self) -> int:
        """Readable rows (``len`` of the storage)."""

    @property
    @abstractmethod
    def head(self) -> int:
        """The ring row the next append writes."""

    @property
    @abstractmethod
    def rows_inserted(self) -> int:
        """Rows appended so far (by every process, where several write)."""

    @property
    @abstractmethod
    def ring_rows(self) -> int:
        """Read indices this store draws are ring rows in ``[0, ring_rows)``."""

    @abstractmethod
    def readable_rows(self) -> int:
        """How many rows an index from outside this library's samplers numbers now."""

    @property
    def takes_any_layout(self) -> bool:
        """Whether the next write may bring other keys than the stored ones (an emptied local store).

        Default: no, the layout the first write laid out only grows (by keys later writes bring).
        """
        return False

    # -- writes --------------------------------------------------------------------------
    @abstractmethod
    def write(self, index: Index, data: Data, *, append: bool, lead: torch.Size | None) -> torch.Tensor:
        """Write ``data`` at ``index`` (see ``Shard.write``); returns the ring rows written."""

    @abstractmethod
    def commit(self, leaves: Leaves) -> torch.Tensor:
        """Append checked rows as one unit whose last row ends an episode (a TrajectoryWriter's)."""

    @abstractmethod
    def set_size(self, size: int) -> None:
        """Make rows ``[0, size)`` readable (TorchRL writers set ``_len``)."""

    def fill_to(self, end: int) -> None:
        """Zero rows below ``end`` no write reached, so no read exposes memory nothing filled.

        Default: nothing to do, for rows that live in memory created zero-filled (a shared store's segments).
        """
        return None

    @abstractmethod
    def clear(self) -> None:
        """Forget every row (the layout stays)."""

    @abstractmethod
    def after_inplace_write(self) -> None:
        """Stored rows were written in place: derive what follows from them again (episode ends)."""

    # -- reads -----------------------------------------------------------------------------
    # A sampler picks rows inside ``picking()``, then the storage reads them under
    # ``reading()``: nothing may change between the two.
    # The defaults are those of rows nothing else writes: no section is needed, so these do nothing.
    def picking(self) -> AbstractContextManager[None]:
        """Around picking rows: what is readable is fixed until they are read. Default: nothing to hold."""
        return nullcontext()

    def reading(self) -> AbstractContextManager[None]:
        """Around a gather of rows picked earlier. Default: nothing to hold."""
        return nullcontext()

    def release(self) -> None:
        """End the read section ``picking`` opened, for rows read by other means (a remote learner).
        Default: no section was opened."""
        return None

    def refresh(self) -> None:
        """Open a read section and catch up with rows committed elsewhere. Default: none are."""
        return None

    def claim_gather(self, num_rows: int) -> None:
        """About to gather ``num_rows`` rows in the open read section. Default: no writer waits for it."""
        return None

    def check_readable(self, rows: torch.Tensor) -> None:
        """Raise IndexError if any of ``rows`` (ring rows in range) holds no readable data.
        Default: every row below ``size`` holds data."""
        return None

    def check_readable_windows(self, windows: Windows) -> None:
        """``check_readable`` of the windows' valid positions. Default: as ``check_readable``, all are."""
        return None

    @abstractmethod
    def uniform_rows(self, n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
        """``n`` readable ring rows drawn uniformly with replacement (inside ``picking``)."""

    @abstractmethod
    def rows_in_write_order(self) -> torch.Tensor:
        """The readable ring rows, oldest write first (inside ``picking``): what a rule of recency reads."""

    @abstractmethod
    def read(self, index: Index) -> Data:
        """Rows at an index from outside this library's samplers (``storage[i]``, TorchRL's samplers):
        what it numbers, checked, read as ring rows (``ring_index``, then ``read_rows``)."""

    def ring_index(self, index: Index) -> torch.Tensor:
        """``index`` as ring rows of ``[0, ring_rows)`` (negatives count from the end), each checked
        readable: what ``read_rows`` takes. Raises IndexError naming the first bad one."""
        shard = self.shard
        if shard.table is None or self.size == 0:
            raise EmptyStoreError("cannot read from an empty storage: write some data first")
        index_device = shard.out_device if shard.out_device.type == "cuda" else None
        rows = as_index_tensor(index, self.ring_rows, "read", device=index_device)
        self.check_readable(rows)
        return rows

    def read_rows(self, rows: torch.Tensor) -> Data:
        """The data at ring ``rows`` (a tensor of any shape, in ``[0, ring_rows)``, readable: drawn by
        this store in the open read section, or checked by ``ring_index``), gathered under ``reading``."""
        shard = self.shard
        with self.reading():
            if shard.table is None or self.size == 0:
                raise EmptyStoreError("cannot read from an empty storage: write some data first")
            self.claim_gather(rows.numel())
            flat = shard.gather_rows(rows)
        return shard.rows_data(shard.table, rows, flat)

    @abstractmethod
    def rows_changed_since(self, position: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """``(gone, new, position)``: ring rows commits overwrote and added since ``position`` (first ``(0, 0)``)."""

    # -- state and lifetime ------------------------------------------------------------------
    @abstractmethod
    def state(self) -> dict:
        """The readable rows as a local shard's state (``Shard.state``)."""

    @abstractmethod
    def load_state(self, state: dict) -> None:
        """Restore a ``state()``, checked in full before anything changes."""

    def close(self) -> None:
        """Let go of what the rows live in beyond this process's memory. Default: they live in none."""
        return None
