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
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
import torch

from gear_torchrl.errors import CheckpointError
from gear_torchrl.store.state_checks import checked_int, checked_tensor, field

_MIN_SLOTS = 64
_UIDS = itertools.count()
_PROCESS_TOKEN = secrets.token_hex(8)  # with the pid: no other process's index shares a uid
_LOG_SLOTS = 1 << 16  # change-log budget; past it readers rebuild from scratch

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
    def has_dead(self) -> bool: ...

    @property
    def num_episodes(self) -> int: ...

    @property
    def position(self) -> Position: ...

    def changed_since(self, position: Position | None) -> torch.Tensor | None: ...

    def slot_is_live(self, slots: torch.Tensor) -> torch.Tensor: ...

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
        self.revision = 0
        self._log: deque[tuple[int, torch.Tensor]] = deque()  # (revision, changed slots), oldest first
        self._log_slots = 0  # slots the log holds: kept as a count, so a write costs O(1) however long the log
        self._log_floor = 0  # changes before this revision are no longer in the log
        self._alloc(_MIN_SLOTS)

    def _alloc(self, slots: int) -> None:
        self.start = torch.zeros(slots, dtype=torch.int64)
        self.length = torch.zeros(slots, dtype=torch.int64)
        self.closed = torch.zeros(slots, dtype=torch.bool)
        self.dead = torch.zeros(slots, dtype=torch.bool)

    # -- change log --------------------------------------------------------------
    def _changed(self, slots: torch.Tensor | None) -> None:
        """Record that ``slots`` changed (None: everything, e.g. the slots were remapped)."""
        self.revision += 1
        if slots is None:
            self._log.clear()
            self._log_slots = 0
            self._log_floor = self.revision
            return
        self._log.append((self.revision, slots))
        self._log_slots += slots.numel()
        while self._log_slots > _LOG_SLOTS:
            revision, dropped = self._log.popleft()
            self._log_slots -= dropped.numel()
            self._log_floor = revision

    @property
    def position(self) -> tuple[Uid, int]:
        """What a reader records after catching up; hand it back to ``changed_since``."""
        return (self.uid, self.revision)

    def changed_since(self, position: Position | None) -> torch.Tensor | None:
        """Slots changed after ``position``; None when a reader must rebuild everything
        (it never looked, looked at another index, or the log has moved past it)."""
        if position is None or position[0] != self.uid:
            return None
        seen = cast(int, position[1])  # this index's own position: a revision
        if seen < self._log_floor:
            return None
        parts = []
        for revision, slots in reversed(self._log):  # newest first: a reader that keeps up reads a few
            if revision <= seen:
                break
            parts.append(slots)
        return torch.cat(parts).unique() if parts else torch.empty(0, dtype=torch.int64)

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
        if getattr(self, "_located", (None,))[0] != self.revision:
            view = self.live()
            self._located = (self.revision, view, torch.cumsum(view.length, 0))
        _, view, ends = self._located
        if view.serial.numel() == 0:
            zeros = torch.zeros_like(rows)
            return zeros, zeros, torch.zeros(rows.shape, dtype=torch.bool)
        logical = (rows - view.start[0]) % self.capacity
        i = torch.searchsorted(ends, logical, right=True)
        found = i < ends.numel()
        i = i.clamp_max(ends.numel() - 1)
        offset = logical - (ends[i] - view.length[i])
        return view.serial[i] % self.start.numel(), offset, found

    def _newest_slot(self) -> int:
        return (self.next_serial - 1) % self.start.numel()

    def _newest_open(self) -> bool:
        return self.num_episodes > 0 and not bool(self.closed[self._newest_slot()])

    # -- updates ---------------------------------------------------------------
    def append(self, rows: torch.Tensor, ends: torch.Tensor | None, evicted: int,
               traj_first: int | None = None, traj_last: int | None = None, dead: bool = False) -> None:
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
        n = rows.numel()
        if n == 0:
            return
        assert ends is not None, "only dead rows come without end flags"
        if traj_first is not None and self.open_traj != traj_first:
            self.close_open()  # before eviction, so an emptied episode is dropped, not kept open
        first_before, slots_before = self.first_serial, self.start.numel()
        self._evict(evicted)
        if n == 1 and not dead:  # one step (rb.add): the same bookkeeping in Python ints
            self._append_one(int(rows[0]), bool(ends[0]), first_before, slots_before, traj_last)
            return
        continuing = self._newest_open()
        # Small arrays, many calls (one per write, per env column for ndim=2): numpy on the
        # tensors' memory costs a fraction of torch's per-op overhead.
        ends_np, rows_np = ends.cpu().numpy(), rows.cpu().numpy()  # (a GPU store's flags come from the GPU)
        end_at = np.flatnonzero(ends_np[:-1])  # rows that end an episode before the last row
        first_pos = np.concatenate(([0], end_at + 1))
        last_pos = np.concatenate((end_at, [n - 1]))
        counts = last_pos - first_pos + 1
        base = self.next_serial - 1 if continuing else self.next_serial
        new_last = base + end_at.size
        self._reserve(new_last + 1 - self.first_serial)
        size = self.start.numel()
        start, length, closed, dead_flags = (t.numpy() for t in (self.start, self.length, self.closed, self.dead))
        slots = np.arange(base, new_last + 1) % size
        if continuing:
            slot0 = slots[0]
            if length[slot0] == 0:
                start[slot0] = rows_np[0]
            length[slot0] += counts[0]
            closed[slot0] = ends_np[last_pos[0]]
            slots, first_pos, last_pos, counts = slots[1:], first_pos[1:], last_pos[1:], counts[1:]
        start[slots] = rows_np[first_pos]
        length[slots] = counts
        closed[slots] = ends_np[last_pos]
        dead_flags[slots] = dead
        self.next_serial = new_last + 1
        self.open_traj = traj_last
        if size != slots_before:
            self._changed(None)  # _reserve remapped every slot
        else:
            changed = np.concatenate((np.arange(first_before, self.first_serial + 1),
                                      np.arange(base, self.next_serial))) % size
            self._changed(torch.from_numpy(changed))

    def _append_one(self, row: int, end: bool, first_before: int, slots_before: int, traj: int | None) -> None:
        """``append`` of a single live row (after eviction), without tensor arithmetic on one element."""
        if self._newest_open():
            base = self.next_serial - 1
            slot = self._newest_slot()
            if int(self.length[slot]) == 0:
                self.start[slot] = row
            self.length[slot] += 1
        else:
            base = self.next_serial
            self._reserve(base + 1 - self.first_serial)
            slot = base % self.start.numel()
            self.start[slot] = row
            self.length[slot] = 1
            self.dead[slot] = False
            self.next_serial = base + 1
        self.closed[slot] = end
        self.open_traj = traj
        if self.start.numel() != slots_before:
            self._changed(None)  # _reserve remapped every slot
        else:
            slots = self.start.numel()  # the dropped or trimmed oldest episodes, and this one
            self._changed(torch.tensor([*(i % slots for i in range(first_before, self.first_serial + 1)), slot]))

    def evict(self, k: int) -> None:
        """Drop the ``k`` oldest steps (another process is about to overwrite them)."""
        first_before = self.first_serial
        self._evict(k)
        if k > 0:
            self._changed(self._slots(first_before, min(self.first_serial + 1, self.next_serial)))

    @property
    def has_dead(self) -> bool:
        # Asked on every remote read: recomputed only when the index changed.
        key = (self.revision, self.first_serial, self.next_serial, id(self.dead))
        if getattr(self, "_dead_known", (None,))[0] != key:
            dead = self.num_episodes > 0 and bool(self.dead[self._slots(self.first_serial, self.next_serial)].any())
            self._dead_known = (key, dead)
        return self._dead_known[1]

    def _evict(self, k: int) -> None:
        """Drop the ``k`` oldest steps: whole oldest episodes, then the head of the next."""
        if k <= 0:
            return
        m = min(k, self.num_episodes)
        size = self.start.numel()
        length = self.length.numpy()
        cum = np.cumsum(length[np.arange(self.first_serial, self.first_serial + m) % size])
        whole = int(np.searchsorted(cum, k, side="right"))
        if whole == self.num_episodes and self._newest_open():
            # Every stored step goes, the open episode's too: it stays live, empty,
            # and the rows being written continue it.
            length[self._newest_slot()] = 0
            self.first_serial = self.next_serial - 1
            return
        trim = k - (int(cum[whole - 1]) if whole else 0)
        self.first_serial += whole
        if trim:
            slot = self.first_serial % size
            self.start[slot] = (self.start[slot] + trim) % self.capacity
            length[slot] -= trim

    def _reserve(self, live: int) -> None:
        """Grow the per-episode arrays so ``live`` episodes have distinct slots."""
        if live <= self.start.numel():
            return
        view = self.live()
        slots = self.start.numel()
        while slots < live:
            slots *= 2
        self._alloc(slots)
        new = view.serial % slots
        self.start[new], self.length[new], self.closed[new] = view.start, view.length, view.closed
        self.dead[new] = view.dead

    def close_open(self) -> None:
        if self._newest_open():
            self.closed[self._newest_slot()] = True
            self._changed(torch.tensor([self._newest_slot()]))

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
        raise CheckpointError(f"the episode index's serials [{first}, {nxt}) number {count} episodes, "
                              f"but it saves {tuple(start.shape)}")
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
        raise CheckpointError(f"episode {int(held[at])} starts at row {int(start[held[at]])}, expected row "
                              f"{int(expected[at])}: episodes overlap, leave a gap or are out of order")
