"""Episodes of a ``[T, num_envs]`` store: one episode index per env column, kept as one.

Each env column is a ring of ``time_capacity`` steps, written a time step at a
time in lockstep with the others. Its episodes follow exactly the rules of a
1-D :class:`EpisodeIndex` (serials that only grow, live ones tiling the
column's stored steps, eviction by lengths alone), but the columns' records
are held side by side, ``[num_envs, slots]``, so a write of time steps
updates every column in a few array operations instead of a loop over
columns (an ``ndim=2`` append is as cheap as a 1-D one). Readers that keep
something per episode (a window sampler's tree) see slot ``e * slots + s``:
the columns one after the other, as one index.

Window rows: a window inside env ``e`` must step through time in that column
only, also across the time ring's end. Episode starts are therefore handed
to readers as *window rows* ``e * 2 * time_capacity + t``: each column owns a
block of twice its ring, so every step of an episode (at most a ring long)
stays inside its block, and ``(t mod time_capacity, e)`` of any window
position is recovered from its row alone (:meth:`EnvEpisodes.coordinates`).
"""

from __future__ import annotations

import itertools
import os
from typing import Any, cast

import numpy as np
import torch

from gear_torchrl.errors import CheckpointError
from gear_torchrl.kernels import _C
from gear_torchrl.store.change_log import ChangeLog
from gear_torchrl.store.episodes import EpisodeView, Position, Uid
from gear_torchrl.store.episodes import check_state as check_column_state
from gear_torchrl.store.state_checks import field

_MIN_SLOTS = 64
_UIDS = itertools.count()
_NO_SLOTS = torch.empty(0, dtype=torch.int64)


class EnvEpisodes:
    """``num_envs`` episode indices, one per env column of ``time_capacity`` time rows."""

    def __init__(self, time_capacity: int, num_envs: int) -> None:
        self.time_capacity = time_capacity
        self.num_envs = num_envs
        self.uid: Uid = (os.getpid(), "env-columns", next(_UIDS))
        # Per column, as an EpisodeIndex keeps them: live episodes are serials [first_serial, next_serial).
        self.first_serial = torch.zeros(num_envs, dtype=torch.int64)
        self.next_serial = torch.zeros(num_envs, dtype=torch.int64)
        self.open_traj: list[int | None] = [None] * num_envs  # trajectory id of each column's open episode
        self.changes = ChangeLog()
        self._alloc(_MIN_SLOTS)

    def _alloc(self, slots: int) -> None:
        """Per-episode records, ``[num_envs, slots]``: episode ``serial`` of column ``e`` at ``[e, serial % slots]``."""
        shape = (self.num_envs, slots)
        self._start = torch.zeros(shape, dtype=torch.int64)  # time row of the first live step
        self._length = torch.zeros(shape, dtype=torch.int64)
        self._closed = torch.zeros(shape, dtype=torch.bool)
        self._dead = torch.zeros(shape, dtype=torch.bool)  # a crashed writer's steps (shared stores)
        self._window_starts: tuple[int, torch.Tensor] | None = None  # (revision, starts as window rows)

    @property
    def slots(self) -> int:
        """Slots per column."""
        return self._start.shape[1]

    # -- window rows --------------------------------------------------------------
    @property
    def window_rows(self) -> int:
        """Window rows are ``[0, window_rows)`` (two time rings per column, see the module docstring)."""
        return 2 * self.time_capacity * self.num_envs

    def coordinates(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Time row and env of window rows (any integers: taken modulo ``window_rows``)."""
        block = 2 * self.time_capacity
        rows = rows % self.window_rows
        return (rows % block) % self.time_capacity, rows // block

    # -- what readers see: slot ``e * slots + s`` ------------------------------------
    @property
    def start(self) -> torch.Tensor:
        """Each slot's first live step, as a window row."""
        if self._window_starts is None or self._window_starts[0] != self.changes.revision:
            block = 2 * self.time_capacity * torch.arange(self.num_envs).unsqueeze(1)
            self._window_starts = (self.changes.revision, (self._start + block).reshape(-1))
        return self._window_starts[1]

    @property
    def length(self) -> torch.Tensor:
        return self._length.reshape(-1)

    @property
    def closed(self) -> torch.Tensor:
        return self._closed.reshape(-1)

    @property
    def dead(self) -> torch.Tensor:
        return self._dead.reshape(-1)

    @property
    def num_episodes(self) -> int:
        return int((self.next_serial - self.first_serial).sum())

    def slot_is_live(self, slots: torch.Tensor) -> torch.Tensor:
        env, local = slots // self.slots, slots % self.slots
        return (local - self.first_serial[env]) % self.slots < (self.next_serial - self.first_serial)[env]

    @property
    def position(self) -> tuple[Uid, int]:
        """What a reader records after catching up; hand it back to ``changed_since``."""
        return (self.uid, self.changes.revision)

    def changed_since(self, position: Position | None) -> torch.Tensor | None:
        """Slots changed after ``position``; None when a reader must rebuild everything."""
        if position is None or position[0] != self.uid:
            return None
        return self.changes.since(cast(int, position[1]))

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Every ring row (``t * num_envs + e``) of the episodes in reader ``slots``, episode after episode."""
        env, local = slots // self.slots, slots % self.slots
        length = self._length[env, local]
        first_of_each = torch.repeat_interleave(torch.cumsum(length, 0) - length, length)
        offset = torch.arange(int(length.sum())) - first_of_each
        time = (self._start[env, local].repeat_interleave(length) + offset) % self.time_capacity
        return time * self.num_envs + env.repeat_interleave(length)

    def locate(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reader slot and step offset of each ring row ``t * num_envs + e``, and whether a live episode holds it.

        A column's live episodes tile its stored steps from the oldest one's start, so a
        binary search over the columns' cumulative lengths (laid end to end) finds a row's
        episode, as in a 1-D index.
        """
        if getattr(self, "_located", (None,))[0] != self.changes.revision:
            view = self.live()
            per_env = self.next_serial - self.first_serial
            self._located = (
                self.changes.revision,
                view,
                torch.cumsum(view.length, 0),
                per_env,
                torch.cumsum(per_env, 0) - per_env,
            )
        _, view, ends, per_env, first_of_env = self._located
        if view.serial.numel() == 0:
            zeros = torch.zeros_like(rows)
            return zeros, zeros, torch.zeros(rows.shape, dtype=torch.bool)
        t, e = rows // self.num_envs, rows % self.num_envs
        oldest = first_of_env[e].clamp_max(ends.numel() - 1)  # the column's oldest episode, where it has one
        column_base = ends[oldest] - view.length[oldest]
        logical = column_base + (t - view.start[oldest]) % self.time_capacity
        i = torch.searchsorted(ends, logical, right=True)
        found = (per_env[e] > 0) & (i < first_of_env[e] + per_env[e])
        i = i.clamp_max(ends.numel() - 1)
        offset = logical - (ends[i] - view.length[i])
        return e * self.slots + view.serial[i] % self.slots, offset, found

    def live(self) -> EpisodeView:
        """Live episodes, env column after env column (oldest first in each); ``start`` in time rows."""
        e, serial = (torch.from_numpy(a) for a in _ranges(self.first_serial.numpy(), self.next_serial.numpy()))
        s = serial % self.slots
        return EpisodeView(serial, self._start[e, s], self._length[e, s], self._closed[e, s], self._dead[e, s], env=e)

    # -- updates (time steps of every column at once) ---------------------------------
    def append(
        self,
        time_rows: torch.Tensor,
        ends: torch.Tensor,
        evicted: int,
        traj: torch.Tensor | None,
        dropped_ends: torch.Tensor | None,
    ) -> None:
        """Record ``time_rows`` (consecutive) as the newest steps of every column.

        ``ends``/``traj``: ``[steps, num_envs]``; ``evicted``: time rows they overwrite;
        ``dropped_ends``: end flags of earlier steps of this write the ring could not hold.
        """
        closing = np.zeros(self.num_envs, dtype=bool)
        if dropped_ends is not None:
            closing |= dropped_ends.reshape(-1, self.num_envs).any(0).cpu().numpy()
        if time_rows.numel() and traj is not None:  # a new trajectory id closes the column's open episode
            closing |= [seen is None or seen != now for seen, now in zip(self.open_traj, traj[0].tolist())]
        closed = self._close_open(closing) if closing.any() else _NO_SLOTS
        if not time_rows.numel():
            self.changes.record(closed)
            return
        changed = self._record(time_rows, ends, evicted)
        self.open_traj = traj[-1].tolist() if traj is not None else [None] * self.num_envs
        self.changes.record(changed if changed is None or not closed.numel() else torch.cat((closed, changed)))

    def append_dead(self, time_rows: torch.Tensor) -> None:
        """Record ``time_rows`` (consecutive) of every column as one closed episode a crashed writer left."""
        closed = self._close_open(np.ones(self.num_envs, dtype=bool))
        ends = torch.zeros(time_rows.numel(), self.num_envs, dtype=torch.bool)
        ends[-1] = True
        changed = self._record(time_rows, ends, evicted=0, dead=True)
        self.open_traj = [None] * self.num_envs
        self.changes.record(changed if changed is None or not closed.numel() else torch.cat((closed, changed)))

    def evict(self, time_rows: int) -> None:
        """Drop the ``time_rows`` oldest steps of every column (another process is about to overwrite them)."""
        if time_rows > 0:
            no_rows = torch.empty(0, dtype=torch.int64)
            self.changes.record(self._record(no_rows, torch.empty(0, self.num_envs, dtype=torch.bool), time_rows))

    def rebuild(self, time_order: torch.Tensor, ends: torch.Tensor, traj: torch.Tensor | None) -> None:
        """Recompute every column from scratch: ``time_order`` oldest first, ``ends``/``traj`` ``[steps, num_envs]``."""
        self.clear()
        if time_order.numel():
            self._record(time_order, ends, evicted=0)
            self.open_traj = traj[-1].tolist() if traj is not None else [None] * self.num_envs
            self.changes.record(None)

    def clear(self) -> None:
        # Serials keep growing: a reference to an old episode never matches a new one.
        self.first_serial = self.next_serial.clone()
        self.open_traj = [None] * self.num_envs
        self.changes.record(None)

    def _newest(self) -> tuple[np.ndarray, np.ndarray]:
        """Each column's newest slot, and whether it holds an open live episode."""
        first, next_ = self.first_serial.numpy(), self.next_serial.numpy()
        newest = (next_ - 1) % self.slots
        return newest, (next_ > first) & ~self._closed.numpy()[np.arange(self.num_envs), newest]

    def _close_open(self, columns: np.ndarray) -> torch.Tensor:
        """Close the open episode of the ``columns`` flagged; the reader slots that changed."""
        newest, is_open = self._newest()
        env = np.flatnonzero(columns & is_open)
        self._closed.numpy()[env, newest[env]] = True
        emptied = env[self._length.numpy()[env, newest[env]] == 0]  # by eviction: the only live one, it leaves
        self.first_serial.numpy()[emptied] = self.next_serial.numpy()[emptied]
        return torch.from_numpy(env * self.slots + newest[env])

    def _record(self, rows: torch.Tensor, ends: torch.Tensor, evicted: int, dead: bool = False) -> torch.Tensor | None:
        """Drop the ``evicted`` oldest steps of every column and record ``rows`` (``ends``: ``[steps, num_envs]``)
        as its newest; the reader slots that changed, None when the records had to be remapped."""
        ends = ends.cpu().contiguous()
        # Episodes each column may then hold (numpy: a small reduction costs a fraction of torch's).
        room = (self.next_serial - self.first_serial).numpy() + ends.numpy()[:-1].sum(0) + 1
        remapped = self._reserve(int(room.max()))
        changed = _C.episodes_append(
            self._start,
            self._length,
            self._closed,
            self._dead,
            self.first_serial,
            self.next_serial,
            rows.cpu().contiguous(),
            ends,
            evicted,
            self.time_capacity,
            dead,
        )
        return None if remapped else changed

    def _reserve(self, live: int) -> bool:
        """Grow every column's records so ``live`` episodes have distinct slots; True when they moved."""
        if live <= self.slots:
            return False
        view = self.live()
        slots = self.slots
        while slots < live:
            slots *= 2
        self._alloc(slots)
        assert view.env is not None
        env, slot = view.env, view.serial % slots
        self._start[env, slot], self._length[env, slot], self._closed[env, slot] = view.start, view.length, view.closed
        self._dead[env, slot] = view.dead
        return True

    # -- persistence -----------------------------------------------------------
    # The columns' states side by side: the per-episode tensors (``start``, ``length``, ``closed``)
    # laid end to end, as a 1-D index saves them (checkpoints store them as files), the rest per column.
    def state(self) -> dict[str, Any]:
        view = self.live()
        return {
            "num_envs": self.num_envs,
            "episodes_per_env": (self.next_serial - self.first_serial).tolist(),
            "start": view.start,
            "length": view.length,
            "closed": view.closed,
            "first_serial": self.first_serial.tolist(),
            "next_serial": self.next_serial.tolist(),
            "open_traj": list(self.open_traj),
        }

    def load(self, state: dict[str, Any]) -> None:
        """Restore from ``state()`` (checked with ``check_state`` first)."""
        self.first_serial = torch.tensor(state["first_serial"], dtype=torch.int64).reshape(self.num_envs)
        self.next_serial = torch.tensor(state["next_serial"], dtype=torch.int64).reshape(self.num_envs)
        self.open_traj = [None if t is None else int(t) for t in state["open_traj"]]
        slots = _MIN_SLOTS
        while slots < max(state["episodes_per_env"], default=0):
            slots *= 2
        self._alloc(slots)
        env, serial = (torch.from_numpy(a) for a in _ranges(self.first_serial.numpy(), self.next_serial.numpy()))
        slot = serial % slots
        for name, records in (("start", self._start), ("length", self._length), ("closed", self._closed)):
            records[env, slot] = torch.as_tensor(state[name], dtype=records.dtype)
        self.changes.record(None)


def _ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(e, v)`` for every ``v`` in ``[lo[e], hi[e])``, ``e`` after ``e``."""
    counts = np.maximum(hi - lo, 0)
    env = np.repeat(np.arange(lo.size), counts)
    offsets = np.cumsum(counts) - counts
    return env, np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(offsets - lo, counts)


_TENSORS = {"start": torch.int64, "length": torch.int64, "closed": torch.bool}
_SCALARS = ("first_serial", "next_serial", "open_traj")


def column_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Each column's ``EpisodeIndex.state()`` out of ``EnvEpisodes.state()``."""
    counts = state["episodes_per_env"]
    split = {name: torch.as_tensor(state[name]).split(counts) for name in _TENSORS}
    return [
        {**{name: split[name][e] for name in _TENSORS}, **{name: state[name][e] for name in _SCALARS}}
        for e in range(len(counts))
    ]


def check_state(
    state: Any, time_capacity: int, num_envs: int, time_rows: int, oldest_time_row: int, tracked: bool
) -> None:
    """Raise CheckpointError unless ``state`` (``EnvEpisodes.state()``) indexes ``time_rows`` steps of each column."""
    where = "the saved episode index of env columns"
    saved_envs = field(state, "num_envs", where)
    counts = field(state, "episodes_per_env", where)
    if (
        saved_envs != num_envs
        or not isinstance(counts, (list, tuple))
        or len(counts) != num_envs
        or any(not isinstance(c, int) or c < 0 for c in counts)
    ):
        raise CheckpointError(
            f"the saved episode index has {saved_envs!r} env columns with {counts!r} episodes; "
            f"this store has {num_envs} env columns"
        )
    for name in (*_TENSORS, *_SCALARS):
        value = field(state, name, where)
        size = value.numel() if isinstance(value, torch.Tensor) else len(value) if isinstance(value, list) else None
        if size != (sum(counts) if name in _TENSORS else num_envs):
            raise CheckpointError(f"the saved episode index's {name!r} does not match its {counts} episodes per env")
    for e, column in enumerate(column_states(state)):
        try:
            check_column_state(column, time_capacity, time_rows, oldest_row=oldest_time_row, tracked=tracked)
        except CheckpointError as err:
            raise CheckpointError(f"env column {e}: {err}") from None
