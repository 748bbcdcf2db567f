"""Episode index of a ring of steps, kept current on every write.

Episodes are numbered by a serial that only grows; the live ones are
``[first_serial, next_serial)``, oldest first, and their rows tile the stored
rows in ring order (the lengths add up to the number of stored rows). Appends
cost O(rows written): the oldest steps are the ones a ring overwrites, so
eviction trims or drops the oldest episodes by their lengths alone, with no
per-row bookkeeping. Writes that are not appends (``write_at``,
``storage[i] = ...``) rebuild the index from the stored flags in one
vectorized pass.

Per-episode records live in arrays that grow with the number of live
episodes (slot ``serial % len(array)``), so the index costs nothing per row.

Readers that keep something per episode (a sampler's tree of window counts)
follow ``revision`` and ask ``changed_since`` for the slots to refresh, so
they stay O(changed episodes) per write instead of rescanning.
"""

from __future__ import annotations

import itertools
import os
import secrets
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
import torch

from gear_torchrl.errors import CheckpointError
from gear_torchrl.kernels import _C
from gear_torchrl.store.change_log import ChangeLog
from gear_torchrl.store.state_checks import checked_int, checked_tensor, field

_MIN_SLOTS = 64
_UIDS = itertools.count()
_PROCESS_TOKEN = secrets.token_hex(8)  # with the pid: no other process's index shares a uid

Uid = tuple[int, str, int]  # (pid, this process's token or the index's kind, counter): unique across processes
# An index's uid and how far a reader had caught up with it (its own kind of progress): hand it back as it is.
Position = tuple[Uid, object]


@dataclass
class EpisodeView:
    """Live episodes in logical (oldest-first) order."""

    serial: torch.Tensor  # int64 [E]
    start: torch.Tensor  # int64 [E], ring row of the first live step
    length: torch.Tensor  # int64 [E]
    closed: torch.Tensor  # bool [E]: ended by a done flag or a trajectory change
    dead: torch.Tensor  # bool [E]: rows a crashed writer left half-written; never sampled
    env: torch.Tensor | None = None  # int64 [E]: the env column of each (a [T, num_envs] store), else None


def episode_ends(flags: torch.Tensor | None, traj: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """Rows that end an episode: a done/truncated flag, or the next row's id differs."""
    ends = torch.zeros(num_rows, dtype=torch.bool) if flags is None else flags.reshape(num_rows, -1).any(-1).cpu()
    if traj is not None and num_rows > 1:
        traj = traj.reshape(num_rows, -1)[:, 0].cpu()
        ends[:-1] |= traj[1:] != traj[:-1]
    return ends


class Episodes(Protocol):
    """A shard's episodes as readers see them: one ``EpisodeIndex``, or an ``EnvEpisodes`` of env columns.

    Per-episode arrays are indexed by slot; ``changed_since`` names the slots to refresh.
    """

    @property
    def start(self) -> torch.Tensor: ...

    @property
    def length(self) -> torch.Tensor: ...

    @property
    def closed(self) -> torch.Tensor: ...

    @property
    def dead(self) -> torch.Tensor: ...

    @property
    def num_episodes(self) -> int: ...

    @property
    def position(self) -> Position: ...

    def changed_since(self, position: Position | None) -> torch.Tensor | None: ...

    def slot_is_live(self, slots: torch.Tensor) -> torch.Tensor: ...

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor: ...

    def locate(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def live(self) -> EpisodeView: ...

    def clear(self) -> None: ...

    def state(self) -> dict[str, Any]: ...

    def load(self, state: dict[str, Any]) -> None: ...


class EpisodeIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # Readers key their derived state on this: ids of dead objects get reused, and a counter alone
        # repeats in every process (a sampler pickled into a worker would trust a stranger's index).
        self.uid = (os.getpid(), _PROCESS_TOKEN, next(_UIDS))
        self.first_serial = 0
        self.next_serial = 0
        self.open_traj: int | None = None  # trajectory id of the open episode
        self.changes = ChangeLog()
        self._alloc(_MIN_SLOTS)

    def _alloc(self, slots: int) -> None:
        self.start = torch.zeros(slots, dtype=torch.int64)
        self.length = torch.zeros(slots, dtype=torch.int64)
        self.closed = torch.zeros(slots, dtype=torch.bool)
        self.dead = torch.zeros(slots, dtype=torch.bool)

    # -- change log --------------------------------------------------------------
    @property
    def revision(self) -> int:
        return self.changes.revision

    def _changed(self, slots: torch.Tensor | None) -> None:
        """Record that ``slots`` changed (None: everything, e.g. the slots were remapped)."""
        self.changes.record(slots)

    @property
    def position(self) -> tuple[Uid, int]:
        """What a reader records after catching up; hand it back to ``changed_since``."""
        return (self.uid, self.revision)

    def changed_since(self, position: Position | None) -> torch.Tensor | None:
        """Slots changed after ``position``; None when a reader must rebuild everything
        (it never looked, looked at another index, or the log has moved past it)."""
        if position is None or position[0] != self.uid:
            return None
        return self.changes.since(cast(int, position[1]))  # this index's own position: a revision

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Every ring row of the episodes in ``slots``, episode after episode."""
        length = self.length[slots]
        first_of_each = torch.repeat_interleave(torch.cumsum(length, 0) - length, length)
        offset = torch.arange(int(length.sum())) - first_of_each
        return (self.start[slots].repeat_interleave(length) + offset) % self.capacity

    def slot_is_live(self, slots: torch.Tensor) -> torch.Tensor:
        return (slots - self.first_serial) % self.start.numel() < self.num_episodes

    # -- queries ---------------------------------------------------------------
    @property
    def num_episodes(self) -> int:
        return self.next_serial - self.first_serial

    def _slots(self, first: int, last: int) -> torch.Tensor:
        return torch.arange(first, last, dtype=torch.int64) % self.start.numel()

    def slots_of(self, serial: torch.Tensor) -> torch.Tensor:
        """Where the live episodes with these serial numbers are held."""
        return serial % self.start.numel()

    def live(self) -> EpisodeView:
        slot = self._slots(self.first_serial, self.next_serial)
        serial = torch.arange(self.first_serial, self.next_serial, dtype=torch.int64)
        return EpisodeView(serial, self.start[slot], self.length[slot], self.closed[slot], self.dead[slot])

    def locate(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Episode slot and step offset of each ring row, and whether a live episode holds it.

        Live episodes tile the stored rows in ring order from the oldest one's
        start, so a binary search over their cumulative lengths finds a row's
        episode: O(log episodes) per row once per revision's O(episodes) table.
        """
        view, ends = self.located()
        if view.serial.numel() == 0:
            zeros = torch.zeros_like(rows)
            return zeros, zeros, torch.zeros(rows.shape, dtype=torch.bool)
        logical = (rows - view.start[0]) % self.capacity
        i = torch.searchsorted(ends, logical, right=True)
        found = i < ends.numel()
        i = i.clamp_max(ends.numel() - 1)
        offset = logical - (ends[i] - view.length[i])
        return view.serial[i] % self.start.numel(), offset, found

    def located(self) -> tuple[EpisodeView, torch.Tensor]:
        """What ``locate`` searches: the live episodes and their lengths' running sums (made once per
        revision)."""
        if getattr(self, "_located", (None,))[0] != self.revision:
            view = self.live()
            self._located = (self.revision, view, torch.cumsum(view.length, 0))
        return self._located[1], self._located[2]

    def _newest_slot(self) -> int:
        return (self.next_serial - 1) % self.start.numel()

    def _newest_open(self) -> bool:
        return self.num_episodes > 0 and not bool(self.closed[self._newest_slot()])

    # -- updates ---------------------------------------------------------------
    def append(
        self,
        rows: torch.Tensor,
        ends: torch.Tensor | None,
        evicted: int,
        traj_first: int | None = None,
        traj_last: int | None = None,
        dead: bool = False,
    ) -> None:
        """Record ``rows`` (consecutive ring rows) as the newest steps.

        ``ends`` flags the rows that end an episode (None for ``dead`` rows).
        ``evicted`` is how many stored steps these rows overwrite (the oldest
        ones). ``traj_first``/``traj_last`` are the trajectory ids of the
        first and last row, in trajectory-id mode. ``dead`` rows (a crashed
        writer's) form one closed episode that no sampler picks.
        """
        if dead:
            self.close_open()
            ends = torch.zeros(rows.numel(), dtype=torch.bool)
            ends[-1] = True
        if rows.numel() == 0:
            return
        assert ends is not None, "only dead rows come without end flags"
        if traj_first is not None and self.open_traj != traj_first:
            self.close_open()  # before eviction, so an emptied episode is dropped, not kept open
        self._record(rows, ends, evicted, dead)
        self.open_traj = traj_last

    def evict(self, k: int) -> None:
        """Drop the ``k`` oldest steps (another process is about to overwrite them)."""
        if k > 0:
            self._record(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.bool), k)

    def _record(self, rows: torch.Tensor, ends: torch.Tensor, evicted: int, dead: bool = False) -> None:
        """Drop the ``evicted`` oldest steps, then record ``rows`` as the newest. The rules are the
        kernel's, shared with the env columns of a ``[T, num_envs]`` store (``csrc/kernels/episodes.h``)."""
        ends = ends.cpu().reshape(-1, 1)
        # numpy: one small count costs a fraction of a torch reduction
        remapped = self._reserve(self.num_episodes + int(np.count_nonzero(ends.numpy()[:-1])) + (rows.numel() > 0))
        serials = torch.tensor([self.first_serial, self.next_serial], dtype=torch.int64)
        changed = _C.episodes_append(
            self.start.view(1, -1),
            self.length.view(1, -1),
            self.closed.view(1, -1),
            self.dead.view(1, -1),
            serials[:1],
            serials[1:],
            rows.cpu().contiguous(),
            ends,
            evicted,
            self.capacity,
            dead,
        )
        self.first_serial, self.next_serial = serials.tolist()
        self._changed(None if remapped else changed)  # remapped: every slot moved

    def _reserve(self, live: int) -> bool:
        """Grow the per-episode arrays so ``live`` episodes have distinct slots; True when they moved."""
        if live <= self.start.numel():
            return False
        view = self.live()
        slots = self.start.numel()
        while slots < live:
            slots *= 2
        self._alloc(slots)
        new = view.serial % slots
        self.start[new], self.length[new], self.closed[new] = view.start, view.length, view.closed
        self.dead[new] = view.dead
        return True

    def close_open(self) -> None:
        if self._newest_open():
            newest = self._newest_slot()
            self.closed[newest] = True
            if int(self.length[newest]) == 0:  # emptied by eviction (then it is the only live one): it leaves
                self.first_serial = self.next_serial
            self._changed(torch.tensor([newest]))

    def rebuild(self, order: torch.Tensor, ends: torch.Tensor, traj_last: int | None = None) -> None:
        """Recompute the index from scratch for rows ``order`` (oldest first)."""
        self.clear()
        self.append(order, ends, evicted=0, traj_last=traj_last)

    def clear(self) -> None:
        # Serials keep growing: a reference to an old episode never matches a new one.
        self.first_serial = self.next_serial
        self.open_traj = None
        self._changed(None)

    # -- persistence -----------------------------------------------------------
    def state(self) -> dict[str, Any]:
        view = self.live()
        return {
            "start": view.start,
            "length": view.length,
            "closed": view.closed,
            "first_serial": self.first_serial,
            "next_serial": self.next_serial,
            "open_traj": self.open_traj,
        }

    def load(self, state: dict[str, Any]) -> None:
        """Restore from ``state()`` (checked with ``check_state`` first)."""
        self.first_serial = int(state["first_serial"])
        self.next_serial = int(state["next_serial"])
        self.open_traj = None if state["open_traj"] is None else int(state["open_traj"])
        slots = _MIN_SLOTS
        while slots < self.num_episodes:
            slots *= 2
        self._alloc(slots)
        slot = self._slots(self.first_serial, self.next_serial)
        self.start[slot] = torch.as_tensor(state["start"], dtype=torch.int64)
        self.length[slot] = torch.as_tensor(state["length"], dtype=torch.int64)
        self.closed[slot] = torch.as_tensor(state["closed"], dtype=torch.bool)
        self._changed(None)


def check_state(state: Any, capacity: int, rows: int, oldest_row: int, tracked: bool) -> None:
    """Raise CheckpointError unless ``state`` (``EpisodeIndex.state()``) indexes ``rows`` stored rows.

    Live episodes tile the stored rows in ring order from ``oldest_row``: each
    starts where the previous one ends, lengths are non-negative and add up to
    ``rows``, and only the newest may still be open. Rows that are not single
    steps (``tracked`` False) may have no episodes at all.
    """
    where = "the saved episode index"
    first = checked_int(field(state, "first_serial", where), "the episode index's first_serial")
    nxt = checked_int(field(state, "next_serial", where), "the episode index's next_serial", lo=first)
    count = nxt - first
    start = checked_tensor(field(state, "start", where), "episode starts", torch.int64)
    length = checked_tensor(field(state, "length", where), "episode lengths", torch.int64, tuple(start.shape))
    closed = checked_tensor(field(state, "closed", where), "episode closed flags", torch.bool, tuple(start.shape))
    if start.shape != (count,):
        raise CheckpointError(
            f"the episode index's serials [{first}, {nxt}) number {count} episodes, but it saves {tuple(start.shape)}"
        )
    open_traj = field(state, "open_traj", where)
    if open_traj is not None:
        checked_int(open_traj, "the episode index's open_traj", lo=-(1 << 63))
    _check_lengths(length, rows, tracked)
    _check_tiling(start, length, capacity, oldest_row)
    if count > 1 and not bool(closed[:-1].all()):
        at = int((~closed[:-1]).nonzero()[0, 0])
        raise CheckpointError(f"episode {at} of {count} is open: only the newest episode can be")


def _check_lengths(length: torch.Tensor, rows: int, tracked: bool) -> None:
    if bool((length < 0).any()):
        at = int((length < 0).nonzero()[0, 0])
        raise CheckpointError(f"episode {at} has negative length {int(length[at])}")
    total = int(length.sum())
    if total != rows and (tracked or length.numel()):
        raise CheckpointError(f"episode lengths add up to {total} rows, but {rows} rows are stored")


def _check_tiling(start: torch.Tensor, length: torch.Tensor, capacity: int, oldest_row: int) -> None:
    """Non-empty episodes follow each other from ``oldest_row`` on, with no gap and no overlap."""
    outside = (start < 0) | (start >= capacity)
    if bool(outside.any()):
        at = int(outside.nonzero()[0, 0])
        raise CheckpointError(f"episode {at} starts at row {int(start[at])}, outside [0, {capacity})")
    held = (length > 0).nonzero().squeeze(1)
    if held.numel() == 0:
        return
    expected = torch.empty_like(held)
    expected[0] = oldest_row
    expected[1:] = (start[held[:-1]] + length[held[:-1]]) % capacity
    wrong = start[held] != expected
    if bool(wrong.any()):
        at = int(wrong.nonzero()[0, 0])
        raise CheckpointError(
            f"episode {int(held[at])} starts at row {int(start[held[at]])}, expected row "
            f"{int(expected[at])}: episodes overlap, leave a gap or are out of order"
        )
