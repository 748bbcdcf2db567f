"""A ``[T, num_envs]`` shard: steps of ``num_envs`` env columns written a time step at a time.

Underneath it is a 1-D :class:`Shard` of ``time_capacity * num_envs`` rows laid
out ``[T, E]``: step ``(t, e)`` is flat row ``t * E + e``. A write of time steps
is one contiguous run of flat rows (the ring's append path, unchanged), and a
read of ``(t, e)`` coordinates is a read of flat rows. What differs is the
episode index: episodes run down one env column, so each column has its own
(:class:`EnvEpisodes`), and windows step through a column, ``E`` flat rows at a
time. The number of env columns is fixed by the first write (``lay_out``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch

from gear_torchrl.errors import CheckpointError
from gear_torchrl.kernels import _C
from gear_torchrl.store.env_episodes import EnvEpisodes
from gear_torchrl.store.env_episodes import check_state as check_env_episode_state
from gear_torchrl.store.shard import Shard, Windows
from gear_torchrl.store.state_checks import field


class EnvShard(Shard):
    """``capacity`` steps held as ``[capacity // num_envs, num_envs]`` (see the module docstring)."""

    num_envs: int
    episodes: EnvEpisodes

    def __init__(self, capacity: int, **kwargs: Any) -> None:
        super().__init__(capacity, **kwargs)
        self.num_envs = 0  # not laid out yet
        self.episodes = EnvEpisodes(0, 0)

    # -- layout ------------------------------------------------------------------
    @property
    def time_capacity(self) -> int:
        """Time rows of the ring (0 until the first write lays the store out)."""
        return self.capacity // self.num_envs if self.num_envs else 0

    @property
    def time_rows(self) -> int:
        """Readable time rows."""
        return self.size // self.num_envs if self.num_envs else 0

    def lay_out(self, num_envs: int) -> bool:
        """Hold ``num_envs`` env columns; True when this call laid the store out (``forget_layout`` undoes it).

        Raises ValueError, changing nothing, when the store holds another number
        of columns or its capacity is not a whole number of time steps.
        """
        if num_envs == self.num_envs:
            return False
        if self.num_envs:
            raise ValueError(f"this ndim=2 storage holds {self.num_envs} env columns ([T, {self.num_envs}] steps); "
                             f"the data has {num_envs}. Every batch must come from the same number of envs")
        if num_envs < 1 or self.capacity % num_envs:
            raise ValueError(f"an ndim=2 storage of max_size={self.capacity} cannot hold whole time steps of "
                             f"{num_envs} envs: make max_size a multiple of the number of envs (e.g. "
                             f"{max(num_envs, self.capacity // max(num_envs, 1) * num_envs)})")
        self.num_envs = num_envs
        self.episodes = EnvEpisodes(self.capacity // num_envs, num_envs)
        return True

    def forget_layout(self) -> None:
        """Undo a ``lay_out`` whose first write was refused (nothing was written)."""
        self.num_envs = 0
        self.episodes = EnvEpisodes(0, 0)

    # -- episodes per env column ------------------------------------------------------
    def _ends(self, values: Sequence[torch.Tensor | None], n: int) -> torch.Tensor:
        """Which of ``n`` flat rows (whole time steps) end an episode of their env column."""
        flags = None
        for i in self._end_columns:
            flag = values[i]
            assert flag is not None, "the end-flag columns are always among ``values``"
            f = flag.reshape(n, -1).any(-1)
            flags = f if flags is None else flags | f
        steps = n // self.num_envs
        ends = torch.zeros(steps, self.num_envs, dtype=torch.bool) if flags is None \
            else flags.reshape(steps, self.num_envs).cpu().clone()
        traj = self._traj_ids(values, n)
        if traj is not None and steps > 1:  # an id that changes down a column ends that column's episode
            traj = traj.reshape(steps, self.num_envs)
            ends[:-1] |= traj[1:] != traj[:-1]
        return ends.reshape(n)

    def _index_append(self, rows: torch.Tensor, ends: torch.Tensor, traj: torch.Tensor | None,
                      dropped_ends: torch.Tensor | None, evicted: int) -> None:
        envs = self.num_envs
        self.episodes.append(rows[::envs] // envs, _by_time(ends, envs), evicted // envs, _by_time(traj, envs),
                             _by_time(dropped_ends, envs))

    def _index_rebuild(self, order: torch.Tensor, ends: torch.Tensor, traj: torch.Tensor | None) -> None:
        envs = self.num_envs
        self.episodes.rebuild(order[::envs] // envs, _by_time(ends, envs), _by_time(traj, envs))

    def _torchrl_positions(self, rows: torch.Tensor) -> torch.Tensor:
        """TorchRL's writers store a step's time row under ``"index"``."""
        return rows // self.num_envs

    def commit(self, leaves: Any, settles: int = 0) -> torch.Tensor:
        raise NotImplementedError("a TrajectoryWriter appends the steps of one episode; an ndim=2 storage takes "
                                  "time steps of every env at once: write [T, num_envs] batches with rb.extend")

    # -- windows: rows of the columns' window blocks (see store/env_episodes.py) --------
    @property
    def window_rows(self) -> int:
        return self.episodes.window_rows

    def coordinates(self, window_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Time row and env column of window rows."""
        return self.episodes.coordinates(window_rows)

    def window_coordinates(self, windows: Windows) -> tuple[torch.Tensor, torch.Tensor]:
        """``(t, e)`` of every window position, padding included: ``[W * seq_len]`` each."""
        return self.coordinates(_C.window_rows(windows.starts, windows.seq_len, self.window_rows))

    def _gather_plan(self, windows: Windows) -> Windows:
        """Each position as a window of one flat row, empty where it is padding (the same kernel reads it)."""
        t, e = self.window_coordinates(windows)
        valid = windows.mask().to(torch.int64)
        return Windows(t * self.num_envs + e, 1, torch.zeros_like(valid), valid)

    # -- reads ---------------------------------------------------------------------
    def slice_views(self, index: Any, all_slots: bool = False) -> Any:
        """``[T, E]`` steps (every slot with ``all_slots``) at a basic ``index`` (slices, ints), as views of
        the columns, or None where a view cannot be had."""
        if not self.slice_views_possible or self.table is None:
            return None
        steps = self.time_capacity if all_slots else self.time_rows
        grid = (self.time_capacity, self.num_envs)
        lead = torch.empty(steps, self.num_envs, device="meta")[index].shape
        views = [c.view(*grid, *c.shape[1:])[:steps][index] for c in self.columns]
        objects = [o.reshape(grid)[:steps][index] for o in self.objects]
        return self.table.unflatten(views, lead, device=self.out_device, objects=objects)

    # -- state -----------------------------------------------------------------------
    def state(self) -> dict:
        return {**super().state(), "num_envs": self.num_envs}

    def checked_state(self, state: dict) -> Any:
        num_envs = field(state, "num_envs", "the saved state of an ndim=2 storage")
        if self.num_envs and num_envs and num_envs != self.num_envs:
            raise CheckpointError(f"the state holds {num_envs} env columns, this storage {self.num_envs}")
        if num_envs and (not isinstance(num_envs, int) or self.capacity % num_envs):
            raise CheckpointError(f"the state's num_envs {num_envs!r} does not divide the capacity {self.capacity}")
        saved = field(field(state, "episodes", "the saved state"), "num_envs", "the saved episode index")
        if saved != num_envs:
            raise CheckpointError(f"the state holds {num_envs!r} env columns, its episode index {saved!r}")
        return super().checked_state(state)

    def _check_episode_state(self, episodes: Any, size: int, head: int, tracked: bool) -> None:
        num_envs = field(episodes, "num_envs", "the saved episode index")
        if not isinstance(num_envs, int) or num_envs < 0 or (num_envs and self.capacity % num_envs):
            raise CheckpointError(f"the saved episode index has {num_envs!r} env columns: not a divisor of the "
                                  f"capacity {self.capacity}")
        if not num_envs:
            if size:
                raise CheckpointError(f"the state holds {size} rows but no env columns")
            return
        if size % num_envs or head % num_envs:
            raise CheckpointError(f"the state's size {size} and cursor {head} are not whole time steps of "
                                  f"{num_envs} envs")
        steps = self.capacity // num_envs
        check_env_episode_state(episodes, steps, num_envs, size // num_envs,
                                oldest_time_row=head // num_envs if size == self.capacity else 0, tracked=tracked)

    def load_state(self, state: dict) -> None:
        self.checked_state(state)
        if state["num_envs"] and not self.num_envs:
            self.lay_out(state["num_envs"])
        super().load_state(state)


@overload
def _by_time(flat: torch.Tensor, envs: int) -> torch.Tensor: ...


@overload
def _by_time(flat: None, envs: int) -> None: ...


@overload
def _by_time(flat: torch.Tensor | None, envs: int) -> torch.Tensor | None: ...


def _by_time(flat: torch.Tensor | None, envs: int) -> torch.Tensor | None:
    """Per-step values of flat rows ``t * envs + e`` as ``[time, envs]``."""
    return None if flat is None else flat.reshape(-1, envs)
