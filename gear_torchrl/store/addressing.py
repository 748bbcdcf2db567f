"""What a shard's ring row is: a step of one stream, or a step of one of ``num_envs`` env columns.

A shard is one ring of columns (``store/shard.py``). Its addressing is the part
that depends on how steps follow each other: the episode index (episodes run
down the stream, or down each env column), which rows a window steps through,
what TorchRL's writers store under ``"index"``, and how rows are shaped in a
view. The ring, the copies and the reads are the same for both, and so is how
rows become visible to readers (this process's writes, or a shared commit log).

- :class:`StepRows`: row ``i`` is a step of one stream (``ndim=1``).
- :class:`EnvColumns`: ``[T, num_envs]`` steps laid out row-major (``ndim=2``),
  step ``(t, e)`` at row ``t * num_envs + e``; a write of time steps is one run
  of rows, so the ring's append path is unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, overload

import torch
from torch import Tensor

from gear_torchrl.errors import CheckpointError
from gear_torchrl.kernels import _C
from gear_torchrl.store.env_episodes import EnvEpisodes
from gear_torchrl.store.env_episodes import check_state as check_env_episode_state
from gear_torchrl.store.episodes import EpisodeIndex, Episodes, episode_ends
from gear_torchrl.store.episodes import check_state as check_episode_state
from gear_torchrl.store.state_checks import field
from gear_torchrl.store.windows import Windows


class Addressing(ABC):
    """How the ``capacity`` rows of a ring are steps (see the module docstring)."""

    episodes: Episodes
    ndim: int  # TorchRL's ``ndim`` of a storage addressed so

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @property
    @abstractmethod
    def num_envs(self) -> int | None:
        """Env columns (0 until the first write lays them out), or None: rows are one stream's steps."""

    @property
    def rows_per_step(self) -> int:
        """Ring rows one time step takes: 1, or ``num_envs`` (commits and evictions come in whole steps)."""
        return self.num_envs or 1

    @abstractmethod
    def ends(self, flags: Tensor | None, traj: Tensor | None, n: int) -> Tensor:
        """Which of ``n`` consecutive rows end an episode, given their end flags and trajectory ids."""

    @abstractmethod
    def append(
        self, rows: Tensor, ends: Tensor, traj: Tensor | None, dropped_ends: Tensor | None, evicted: int
    ) -> None:
        """Record appended ``rows`` in the episode index, ``evicted`` oldest rows dropped;
        ``dropped_ends``: end flags of the write's first rows the ring could not hold (None: it held them all)."""

    @abstractmethod
    def append_dead(self, rows: Tensor) -> None:
        """Record appended ``rows`` as a crashed writer's: one closed episode that no sampler picks."""

    @abstractmethod
    def evict(self, rows: int) -> None:
        """Drop the ``rows`` oldest rows from the episode index (another process is about to overwrite them)."""

    @abstractmethod
    def closed_ends(self) -> Tensor:
        """Ring rows that end a closed live episode (not a crashed writer's): what a copy of the store keeps."""

    @abstractmethod
    def rebuild(self, order: Tensor, ends: Tensor, traj: Tensor | None) -> None:
        """Re-derive the episode index over stored rows ``order`` (oldest first)."""

    @abstractmethod
    def torchrl_positions(self, rows: Tensor) -> Tensor:
        """What TorchRL's writers store under ``"index"`` for ``rows``."""

    @property
    @abstractmethod
    def window_rows(self) -> int:
        """Episode starts, and so window starts, are rows of ``[0, window_rows)``."""

    @abstractmethod
    def ring_rows(self, window_rows: Tensor) -> Tensor:
        """The ring row each window row (any integer: taken modulo ``window_rows``) names."""

    @abstractmethod
    def gather_plan(self, windows: Windows) -> Windows:
        """``windows`` (starts in ``[0, window_rows)``) as the gather kernel reads them: runs of ring rows."""

    @abstractmethod
    def grid(self, rows: int) -> tuple[int, ...]:
        """The shape ``rows`` ring rows take in a view (``[rows]``, or ``[T, num_envs]``)."""

    def state(self) -> dict[str, Any]:
        """What a shard's state holds about the addressing, beside its episode index."""
        return {}

    @abstractmethod
    def check_state(self, state: dict, size: int, head: int, tracked: bool) -> None:
        """Raise CheckpointError unless a shard ``state`` of ``size`` rows, cursor ``head``, fits this addressing."""

    def load_state(self, state: dict) -> None:  # noqa: B027  (a hook: an addressing with no layout takes none)
        """Take a checked ``state``'s layout (its episode index is loaded by the shard)."""


class StepRows(Addressing):
    """Row ``i`` of the ring is a step of one stream; episodes are runs of rows."""

    episodes: EpisodeIndex
    ndim = 1

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.episodes = EpisodeIndex(capacity)

    @property
    def num_envs(self) -> None:
        return None

    def ends(self, flags: Tensor | None, traj: Tensor | None, n: int) -> Tensor:
        return episode_ends(flags, traj, n)

    def append(
        self, rows: Tensor, ends: Tensor, traj: Tensor | None, dropped_ends: Tensor | None, evicted: int
    ) -> None:
        if dropped_ends is not None and bool(dropped_ends.any()):
            self.episodes.close_open()
        self.episodes.append(
            rows,
            ends,
            evicted=evicted,
            traj_first=None if traj is None else int(traj[0]),
            traj_last=None if traj is None else int(traj[-1]),
        )

    def append_dead(self, rows: Tensor) -> None:
        self.episodes.append(rows, None, evicted=0, dead=True)

    def evict(self, rows: int) -> None:
        self.episodes.evict(rows)

    def closed_ends(self) -> Tensor:
        view = self.episodes.live()
        keep = view.closed & ~view.dead
        return (view.start[keep] + view.length[keep] - 1) % self.capacity

    def rebuild(self, order: Tensor, ends: Tensor, traj: Tensor | None) -> None:
        self.episodes.rebuild(order, ends, traj_last=None if traj is None else int(traj[-1]))

    def torchrl_positions(self, rows: Tensor) -> Tensor:
        return rows.clone()

    @property
    def window_rows(self) -> int:
        return self.capacity

    def ring_rows(self, window_rows: Tensor) -> Tensor:
        return window_rows % self.capacity

    def gather_plan(self, windows: Windows) -> Windows:
        return windows

    def grid(self, rows: int) -> tuple[int, ...]:
        return (rows,)

    def check_state(self, state: dict, size: int, head: int, tracked: bool) -> None:
        check_episode_state(
            field(state, "episodes", "the saved state"),
            self.capacity,
            size,
            oldest_row=head if size == self.capacity else 0,
            tracked=tracked,
        )


class EnvColumns(Addressing):
    """``[capacity // num_envs, num_envs]`` steps; each env column has its episodes (:class:`EnvEpisodes`).

    Windows step through one column, ``num_envs`` rows at a time. The number of
    columns is fixed by the first write (``lay_out``).
    """

    episodes: EnvEpisodes
    ndim = 2

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._envs = 0  # not laid out yet
        self.episodes = EnvEpisodes(0, 0)

    @property
    def num_envs(self) -> int:
        return self._envs

    @property
    def time_capacity(self) -> int:
        """Time rows of the ring (0 until the first write lays the store out)."""
        return self.capacity // self._envs if self._envs else 0

    def lay_out(self, num_envs: int) -> bool:
        """Hold ``num_envs`` env columns; True when this call laid the store out (``forget_layout`` undoes it).

        Raises ValueError, changing nothing, when the store holds another number
        of columns or its capacity is not a whole number of time steps.
        """
        if num_envs == self._envs:
            return False
        if self._envs:
            raise ValueError(
                f"this ndim=2 storage holds {self._envs} env columns ([T, {self._envs}] steps); "
                f"the data has {num_envs}. Every batch must come from the same number of envs"
            )
        if num_envs < 1 or self.capacity % num_envs:
            raise ValueError(
                f"an ndim=2 storage of max_size={self.capacity} cannot hold whole time steps of "
                f"{num_envs} envs: make max_size a multiple of the number of envs (e.g. "
                f"{max(num_envs, self.capacity // max(num_envs, 1) * num_envs)})"
            )
        self._envs = num_envs
        self.episodes = EnvEpisodes(self.capacity // num_envs, num_envs)
        return True

    def forget_layout(self) -> None:
        """Undo a ``lay_out`` whose first write was refused (nothing was written)."""
        self._envs = 0
        self.episodes = EnvEpisodes(0, 0)

    # -- episodes per env column ------------------------------------------------------
    def ends(self, flags: Tensor | None, traj: Tensor | None, n: int) -> Tensor:
        steps = n // self._envs
        ends = (
            torch.zeros(steps, self._envs, dtype=torch.bool)
            if flags is None
            else flags.reshape(steps, self._envs).cpu().clone()
        )
        if traj is not None and steps > 1:  # an id that changes down a column ends that column's episode
            traj = traj.reshape(steps, self._envs)
            ends[:-1] |= traj[1:] != traj[:-1]
        return ends.reshape(n)

    def append(
        self, rows: Tensor, ends: Tensor, traj: Tensor | None, dropped_ends: Tensor | None, evicted: int
    ) -> None:
        envs = self._envs
        self.episodes.append(
            rows[::envs] // envs,
            _by_time(ends, envs),
            evicted // envs,
            _by_time(traj, envs),
            _by_time(dropped_ends, envs),
        )

    def append_dead(self, rows: Tensor) -> None:
        self.episodes.append_dead(rows[:: self._envs] // self._envs)

    def evict(self, rows: int) -> None:
        self.episodes.evict(rows // self._envs)

    def closed_ends(self) -> Tensor:
        view = self.episodes.live()
        assert view.env is not None, "env columns' episodes know their env"
        keep = view.closed & ~view.dead
        last = (view.start[keep] + view.length[keep] - 1) % self.time_capacity
        return last * self._envs + view.env[keep]

    def rebuild(self, order: Tensor, ends: Tensor, traj: Tensor | None) -> None:
        envs = self._envs
        self.episodes.rebuild(order[::envs] // envs, _by_time(ends, envs), _by_time(traj, envs))

    def torchrl_positions(self, rows: Tensor) -> Tensor:
        """TorchRL's writers store a step's time row under ``"index"``."""
        return rows // self._envs

    # -- windows: rows of the columns' window blocks (see store/env_episodes.py) --------
    @property
    def window_rows(self) -> int:
        return self.episodes.window_rows

    def window_coordinates(self, windows: Windows) -> tuple[Tensor, Tensor]:
        """``(t, e)`` of every window position, padding included: ``[W * window_len]`` each."""
        return self.episodes.coordinates(_C.window_rows(windows.starts, windows.window_len, self.window_rows))

    def ring_rows(self, window_rows: Tensor) -> Tensor:
        t, e = self.episodes.coordinates(window_rows)
        return t * self._envs + e

    def gather_plan(self, windows: Windows) -> Windows:
        """Each position as a window of one flat row, empty where it is padding (the same kernel reads it)."""
        rows = self.ring_rows(_C.window_rows(windows.starts, windows.window_len, self.window_rows))
        valid = windows.mask().to(torch.int64)
        return Windows(rows, 1, torch.zeros_like(valid), valid)

    def grid(self, rows: int) -> tuple[int, ...]:
        return (rows // self._envs, self._envs)

    # -- state -----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"num_envs": self._envs}

    def check_state(self, state: dict, size: int, head: int, tracked: bool) -> None:
        num_envs = field(state, "num_envs", "the saved state of an ndim=2 storage")
        if self._envs and num_envs and num_envs != self._envs:
            raise CheckpointError(f"the state holds {num_envs} env columns, this storage {self._envs}")
        if num_envs and (not isinstance(num_envs, int) or self.capacity % num_envs):
            raise CheckpointError(f"the state's num_envs {num_envs!r} does not divide the capacity {self.capacity}")
        episodes = field(state, "episodes", "the saved state")
        saved = field(episodes, "num_envs", "the saved episode index")
        if saved != num_envs:
            raise CheckpointError(f"the state holds {num_envs!r} env columns, its episode index {saved!r}")
        if not num_envs:
            if size:
                raise CheckpointError(f"the state holds {size} rows but no env columns")
            return
        if size % num_envs or head % num_envs:
            raise CheckpointError(
                f"the state's size {size} and cursor {head} are not whole time steps of {num_envs} envs"
            )
        check_env_episode_state(
            episodes,
            self.capacity // num_envs,
            num_envs,
            size // num_envs,
            oldest_time_row=head // num_envs if size == self.capacity else 0,
            tracked=tracked,
        )

    def load_state(self, state: dict) -> None:
        """Lay out the ``num_envs`` a state (or a shared store's published layout) holds; raises ValueError
        when this store holds another number."""
        if state.get("num_envs"):
            self.lay_out(state["num_envs"])


def addressing_of(ndim: int) -> type[Addressing]:
    """The addressing of TorchRL's ``ndim`` (1: steps, 2: ``[T, num_envs]`` steps)."""
    kinds: dict[int, type[Addressing]] = {StepRows.ndim: StepRows, EnvColumns.ndim: EnvColumns}
    if ndim not in kinds:
        raise ValueError(f"ndim={ndim}: ndim=1 ([steps] rows) and ndim=2 ([T, num_envs] steps) are supported")
    return kinds[ndim]


@overload
def _by_time(flat: Tensor, envs: int) -> Tensor: ...


@overload
def _by_time(flat: None, envs: int) -> None: ...


@overload
def _by_time(flat: Tensor | None, envs: int) -> Tensor | None: ...


def _by_time(flat: Tensor | None, envs: int) -> Tensor | None:
    """Per-step values of flat rows ``t * envs + e`` as ``[time, envs]``."""
    return None if flat is None else flat.reshape(-1, envs)
