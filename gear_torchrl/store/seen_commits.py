"""What one process has seen of a shared store's commits: positions ``[lo, hi)``, and the runs crashed writers left.

Every process keeps its own episode index over a shared store. On each refresh
it replays the records published since its last look (``catch_up``), in ring
order, reading episode ends from the stored flag columns, and evicts what
writers have evicted since. This part holds the positions that index covers,
which of them a writer that died left half-written, and answers from them what
is readable, what changed for samplers that follow the store, and which rows
are live (``store/live_rows.py``).

Each commit is a segment of its own: its last time step ends an episode unless
a trajectory key says the next commit continues it, since the next rows in
the ring may be another process's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch

from gear_torchrl.kernels import _C
from gear_torchrl.store.commit_log import ReadSnapshot
from gear_torchrl.store.live_rows import LiveRows, dead_runs_array
from gear_torchrl.store.ring import Ring
from gear_torchrl.store.windows import Windows

logger = logging.getLogger("gear_torchrl.store.shared_commits")  # a shared store's warnings, whichever part finds them

_NO_ROWS = torch.empty(0, dtype=torch.int64)  # what rows_changed_since returns when nothing changed (never written to)


class SeenCommits:
    """Positions ``[lo, hi)`` of a shared store that this process's episode index (its ring's) holds."""

    def __init__(self, ring: Ring) -> None:
        self._ring = ring  # the shard's ring (a weak reference, as its visibility part holds it)
        self.capacity = ring.capacity
        self.lo = 0  # oldest position in this process's episode index
        self.hi = 0  # published end this process has replayed
        self.dead_runs: list[tuple[int, int]] = []  # [first, end) positions crashed writers left, in [lo, hi)

    @property
    def positions(self) -> tuple[int, int]:
        """The positions ``[lo, hi)`` this process's episode index covers (as of its last refresh)."""
        return self.lo, self.hi

    def catch_up(self, snapshot: ReadSnapshot) -> None:
        """Replay what ``snapshot`` (a read section's, the columns mapped) says was published and evicted."""
        ring = self._ring
        if snapshot.lost:
            logger.warning(
                "this process fell more than the control segment's record table behind; "
                "rows committed before the oldest record still held are not sampled by it"
            )
            ring.episodes.clear()
            self.lo = self.hi = int(snapshot.records[0, 0]) if len(snapshot.records) else snapshot.published_end
        lo = max(snapshot.evicted_end - self.capacity, snapshot.floor, 0)
        step = ring.addressing.rows_per_step
        lo = -(-lo // step) * step  # whole time steps (evictions run a block ahead)
        for position, end, dead, record_ends in _runs(snapshot.records):
            self._evict_to(min(lo, position))
            first = max(position, lo)
            if first >= end:  # evicted before this process saw it
                ring.episodes.clear()
                self.lo = end
            else:
                if self.lo == self.hi:
                    self.lo = first
                self._replay(first, end, dead, record_ends)
            self.hi = end
        self._evict_to(lo)

    def _replay(self, first: int, end: int, dead: bool, record_ends: np.ndarray) -> None:
        """Append positions ``[first, end)``: dead rows, or committed records ending at ``record_ends``."""
        ring = self._ring
        rows = torch.arange(first, end, dtype=torch.int64) % self.capacity
        if dead:
            ring.addressing.append_dead(rows)
            self.dead_runs.append((first, end))
            return
        ends, traj = ring.stored_ends(rows)
        if traj is None:  # the next commit in the ring may be another writer's: its last time step ends episodes
            step = ring.addressing.rows_per_step
            last = (record_ends[record_ends > first] - first) // step - 1
            ends.view(-1, step)[torch.from_numpy(last)] = True
        ring.addressing.append(rows, ends, traj, None, evicted=0)

    def _evict_to(self, position: int) -> None:
        k = min(position, self.hi) - self.lo
        if k > 0:
            self._ring.addressing.evict(k)
            self.lo += k
        self.dead_runs = [(max(a, self.lo), b) for a, b in self.dead_runs if b > self.lo]

    # -- what is readable ----------------------------------------------------------------------
    def live_rows(self) -> LiveRows:
        """The positions seen, less the runs crashed writers left (what outside indices number)."""
        return LiveRows(self.lo, self.hi, dead_runs_array(self.dead_runs))

    def dead(self, rows: torch.Tensor) -> torch.Tensor:
        """Which of ``rows`` (readable ring rows) a writer that died left half-written."""
        runs = dead_runs_array(self.dead_runs)
        position = (self.hi - 1 - (self.hi - 1 - rows.reshape(-1).cpu()) % self.capacity).numpy()
        run = np.searchsorted(runs[:, 0], position, side="right") - 1
        return torch.from_numpy((run >= 0) & (position < runs[np.maximum(run, 0), 1])).reshape(rows.shape)

    def check_readable(self, rows: torch.Tensor) -> None:
        """Raise IndexError if any of ``rows`` (ring rows in range) was evicted, is being rewritten, or was left
        half-written by a writer that died."""
        rows = rows.reshape(-1).cpu()
        if rows.numel() == 0:
            return
        position = self.hi - 1 - (self.hi - 1 - rows) % self.capacity  # newest position of each ring row
        stale = position < self.lo
        if bool(stale.any()):
            raise IndexError(f"row {int(rows[stale][0])} is not readable: it was evicted or is being rewritten")
        if self.dead_runs:
            dead = self.dead(rows)
            if bool(dead.any()):
                raise IndexError(f"row {int(rows[dead][0])} was left half-written by a writer that died")

    def check_readable_windows(self, windows: Windows) -> None:
        """``check_readable`` of the windows' valid positions."""
        # The readable rows are the ring interval of positions [lo, hi): one C++ pass, no row list.
        plan = self._ring.addressing.gather_plan(windows)  # runs of ring rows
        row = _C.first_row_outside(
            plan.starts,
            plan.valid_begin,
            plan.valid_end,
            plan.window_len,
            self.capacity,
            self.lo % self.capacity,
            self.hi - self.lo,
        )
        if row >= 0:
            raise IndexError(f"row {row} is not readable: it was evicted or is being rewritten")
        if self.dead_runs:
            self.check_readable(plan.rows(self.capacity)[windows.mask()])  # names the half-written row

    def rows_changed_since(self, position: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """``(gone, new, position)``: ring rows evicted and committed since ``position`` (``positions`` then),
        less rows crashed writers left."""
        old_lo, old_hi = position
        if old_lo == self.lo and old_hi == self.hi:  # nothing committed or evicted since: a pick's usual case
            return _NO_ROWS, _NO_ROWS, position
        gone_end = min(self.lo, old_hi)  # old rows now evicted; a ring row needs clearing once
        gone = torch.arange(max(old_lo, gone_end - self.capacity), max(old_lo, gone_end), dtype=torch.int64)
        gone %= self.capacity
        new = torch.arange(max(old_hi, self.lo), self.hi, dtype=torch.int64) % self.capacity
        if new.numel() and self.dead_runs:
            dead = self.dead(new)
            gone, new = torch.cat([gone, new[dead]]), new[~dead]
        return gone, new, (self.lo, self.hi)


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
