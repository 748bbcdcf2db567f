"""Episodes of a ``[T, num_envs]`` store: one episode index per env column, read as one.

Each env column is a ring of ``time_capacity`` steps, written a time step at a
time in lockstep with the others, so each keeps a plain :class:`EpisodeIndex`
over its time rows (appends, eviction, rebuilds and state exactly as in a 1-D
store). Readers that keep something per episode (a window sampler's tree) see
the columns' episode slots one after the other, as one index.

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
from typing import Any, NamedTuple, cast

import torch

from gear_torchrl.errors import CheckpointError
from gear_torchrl.store.episodes import EpisodeIndex, EpisodeView, Position, Uid
from gear_torchrl.store.episodes import check_state as check_column_state
from gear_torchrl.store.state_checks import field

_UIDS = itertools.count()

# Each column's (revision, first_serial, next_serial, slots): what the joined slots were built from.
_Key = tuple[tuple[int, int, int, int], ...]


class _Slots(NamedTuple):
    """The columns' episode slots laid end to end, as of ``key``."""

    key: _Key
    offsets: torch.Tensor  # int64 [E + 1]: column e's slots are [offsets[e], offsets[e + 1])
    start: torch.Tensor  # window row of each slot's first live step
    length: torch.Tensor
    closed: torch.Tensor
    dead: torch.Tensor
    first_serial: torch.Tensor  # per column, for ``slot_is_live``
    num_episodes: torch.Tensor


class EnvEpisodes:
    """``num_envs`` episode indices, one per env column of ``time_capacity`` time rows."""

    def __init__(self, time_capacity: int, num_envs: int) -> None:
        self.time_capacity = time_capacity
        self.num_envs = num_envs
        self.columns = [EpisodeIndex(time_capacity) for _ in range(num_envs)]
        self.uid: Uid = (os.getpid(), "env-columns", next(_UIDS))
        self._slots: _Slots | None = None

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

    # -- what readers see: the columns' slots end to end -----------------------------
    def _current(self) -> _Slots:
        key = tuple((c.revision, c.first_serial, c.next_serial, c.start.numel()) for c in self.columns)
        if self._slots is None or self._slots.key != key:
            self._slots = self._laid_out(key)
        return self._slots

    def _laid_out(self, key: _Key) -> _Slots:
        sizes = torch.tensor([c.start.numel() for c in self.columns], dtype=torch.int64)
        offsets = torch.zeros(self.num_envs + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(sizes, 0)
        env = torch.repeat_interleave(torch.arange(self.num_envs), sizes)
        start = self._joined("start") + env * 2 * self.time_capacity  # time rows to window rows
        return _Slots(key, offsets, start, self._joined("length"), self._joined("closed"), self._joined("dead"),
                      torch.tensor([c.first_serial for c in self.columns], dtype=torch.int64),
                      torch.tensor([c.num_episodes for c in self.columns], dtype=torch.int64))

    def _joined(self, name: str) -> torch.Tensor:
        """The columns' per-slot array ``name``, end to end."""
        parts = [getattr(c, name) for c in self.columns]
        if not parts:
            return torch.empty(0, dtype=torch.bool if name in ("closed", "dead") else torch.int64)
        return torch.cat(parts)

    @property
    def start(self) -> torch.Tensor:
        return self._current().start

    @property
    def length(self) -> torch.Tensor:
        return self._current().length

    @property
    def closed(self) -> torch.Tensor:
        return self._current().closed

    @property
    def dead(self) -> torch.Tensor:
        return self._current().dead

    @property
    def has_dead(self) -> bool:
        return any(c.has_dead for c in self.columns)

    @property
    def num_episodes(self) -> int:
        return sum(c.num_episodes for c in self.columns)

    def _env_of(self, slots: torch.Tensor, slots_now: _Slots) -> torch.Tensor:
        return torch.searchsorted(slots_now.offsets[1:], slots, right=True)

    def slot_is_live(self, slots: torch.Tensor) -> torch.Tensor:
        now = self._current()
        env = self._env_of(slots, now)
        local = slots - now.offsets[env]
        size = now.offsets[1:][env] - now.offsets[env]
        return (local - now.first_serial[env]) % size < now.num_episodes[env]

    @property
    def position(self) -> tuple[Uid, _Key]:
        """What a reader records after catching up; hand it back to ``changed_since``."""
        return (self.uid, self._current().key)

    def changed_since(self, position: Position | None) -> torch.Tensor | None:
        """Slots changed after ``position``; None when a reader must rebuild everything."""
        now = self._current()
        if position is None or position[0] != self.uid:
            return None
        seen_columns = cast(_Key, position[1])  # this index's own position: its columns' keys
        if len(seen_columns) != self.num_envs:
            return None
        parts = []
        for e, (column, seen) in enumerate(zip(self.columns, seen_columns)):
            if seen[3] != column.start.numel():  # the column's slots were remapped: every global slot moved
                return None
            changed = column.changed_since((column.uid, seen[0]))
            if changed is None:
                return None
            parts.append(changed + now.offsets[e])
        return torch.cat(parts).unique() if parts else torch.empty(0, dtype=torch.int64)

    def live(self) -> EpisodeView:
        """Live episodes, env column after env column (oldest first in each); ``start`` in time rows."""
        views = [c.live() for c in self.columns]
        if not views:
            empty = torch.empty(0, dtype=torch.int64)
            return EpisodeView(empty, empty, empty, empty.bool(), empty.bool(), env=empty)
        return EpisodeView(torch.cat([v.serial for v in views]), torch.cat([v.start for v in views]),
                           torch.cat([v.length for v in views]), torch.cat([v.closed for v in views]),
                           torch.cat([v.dead for v in views]),
                           env=torch.repeat_interleave(torch.arange(self.num_envs),
                                                       torch.tensor([v.serial.numel() for v in views])))

    # -- updates (time steps of every column at once) ---------------------------------
    def append(self, time_rows: torch.Tensor, ends: torch.Tensor, evicted: int, traj: torch.Tensor | None,
               dropped_ends: torch.Tensor | None) -> None:
        """Record ``time_rows`` (consecutive) as the newest steps of every column.

        ``ends``/``traj``: ``[steps, num_envs]``; ``evicted``: time rows they overwrite;
        ``dropped_ends``: end flags of earlier steps of this write the ring could not hold.
        """
        for e, column in enumerate(self.columns):
            if dropped_ends is not None and bool(dropped_ends[:, e].any()):
                column.close_open()
            column.append(time_rows, ends[:, e], evicted=evicted,
                          traj_first=None if traj is None else int(traj[0, e]),
                          traj_last=None if traj is None else int(traj[-1, e]))

    def rebuild(self, time_order: torch.Tensor, ends: torch.Tensor, traj: torch.Tensor | None) -> None:
        """Recompute every column from scratch: ``time_order`` oldest first, ``ends``/``traj`` ``[steps, num_envs]``."""
        for e, column in enumerate(self.columns):
            column.rebuild(time_order, ends[:, e], traj_last=None if traj is None else int(traj[-1, e]))

    def clear(self) -> None:
        for column in self.columns:
            column.clear()

    # -- persistence -----------------------------------------------------------
    # The columns' states side by side: the per-episode tensors (``start``, ``length``, ``closed``)
    # laid end to end, as a 1-D index saves them (checkpoints store them as files), the rest per column.
    def state(self) -> dict[str, Any]:
        states = [c.state() for c in self.columns]
        state: dict[str, Any] = {"num_envs": self.num_envs, "episodes_per_env": [s["start"].numel() for s in states]}
        for name, dtype in _TENSORS.items():
            state[name] = torch.cat([s[name] for s in states]) if states else torch.empty(0, dtype=dtype)
        for name in _SCALARS:
            state[name] = [s[name] for s in states]
        return state

    def load(self, state: dict[str, Any]) -> None:
        """Restore from ``state()`` (checked with ``check_state`` first)."""
        for column, saved in zip(self.columns, column_states(state)):
            column.load(saved)


_TENSORS = {"start": torch.int64, "length": torch.int64, "closed": torch.bool}
_SCALARS = ("first_serial", "next_serial", "open_traj")


def column_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Each column's ``EpisodeIndex.state()`` out of ``EnvEpisodes.state()``."""
    counts = state["episodes_per_env"]
    split = {name: torch.as_tensor(state[name]).split(counts) for name in _TENSORS}
    return [{**{name: split[name][e] for name in _TENSORS}, **{name: state[name][e] for name in _SCALARS}}
            for e in range(len(counts))]


def check_state(state: Any, time_capacity: int, num_envs: int, time_rows: int, oldest_time_row: int,
                tracked: bool) -> None:
    """Raise CheckpointError unless ``state`` (``EnvEpisodes.state()``) indexes ``time_rows`` steps of each column."""
    where = "the saved episode index of env columns"
    saved_envs = field(state, "num_envs", where)
    counts = field(state, "episodes_per_env", where)
    if saved_envs != num_envs or not isinstance(counts, (list, tuple)) or len(counts) != num_envs \
            or any(not isinstance(c, int) or c < 0 for c in counts):
        raise CheckpointError(f"the saved episode index has {saved_envs!r} env columns with {counts!r} episodes; "
                              f"this store has {num_envs} env columns")
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
