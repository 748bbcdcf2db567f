"""GearSequenceSampler: windows of steps inside episodes, from the episode index.

The successor of GEAR's subscribe patterns and TorchRL's ``SliceSampler``:
no scan of done flags at sample time. A tree over episode slots holds each
episode's number of windows (kept current from the index's change log), so a
batch costs O(batch · log episodes): pick episodes by window count, then an
offset inside each.

The batch comes back in ``SliceSampler``'s layout: ``num_windows * window_len``
flat steps that reshape to ``[num_windows, window_len]``, ``("next",
"truncated")`` marking each window's last valid step and ``("next", "done")``
or-ed with it, plus the validity mask under ``("collector", "mask")``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import torch
from torchrl.data.replay_buffers.samplers import Sampler

from gear_torchrl._ext import _C
from gear_torchrl.samplers.random_draws import uniform
from gear_torchrl.samplers.trees import PriorityTrees
from gear_torchrl.storage import GearStorage
from gear_torchrl.store.episodes import EpisodeIndex
from gear_torchrl.store.shard import Windows
from gear_torchrl.store.spec import NestedKey, as_path

_MAX_REJECTION_ROUNDS = 16


class GearSequenceSampler(Sampler):
    """Windows of ``burn_in + seq_len`` steps inside one episode each.

    Args:
        seq_len: training steps per window.
        num_windows: windows per batch; the batch size must be a multiple of
            ``burn_in + seq_len`` when it is None (like ``SliceSampler``'s ``slice_len``).
        slice_len, num_slices: ``SliceSampler``'s names: ``slice_len`` is the whole window
            (``burn_in + seq_len``), ``num_slices`` is ``num_windows``. Give one of
            ``seq_len`` / ``slice_len``.
        traj_key, end_key: ``SliceSampler``'s names for what delimits episodes. Here the
            storage's episode index does (``GearStorage(traj_key=..., end_keys=...)``): when
            given, they are checked against the storage's at the first sample.
        burn_in: steps before the training steps (R2D2's burn-in). With padding
            they may reach before the episode start (head padding).
        strict_length: only windows fully inside an episode; otherwise windows
            start at every step and run past the episode end (tail padding).
        uniform_over: ``"windows"`` (each window equally likely) or ``"episodes"``
            (each eligible episode equally likely, then a window inside it).
        include_open: sample the episode still being written too.
        cross_ring_end: allow windows whose rows wrap from the last ring row to
            the first (still one episode; windows never span the write cursor).
    """

    def __init__(
        self,
        seq_len: int | None = None,
        *,
        num_windows: int | None = None,
        slice_len: int | None = None,
        num_slices: int | None = None,
        traj_key: NestedKey | None = None,
        end_key: NestedKey | None = None,
        burn_in: int = 0,
        strict_length: bool = True,
        uniform_over: Literal["windows", "episodes"] = "windows",
        include_open: bool = True,
        cross_ring_end: bool = True,
        mask_key: NestedKey = ("collector", "mask"),
        done_key: NestedKey = ("next", "done"),
        truncated_key: NestedKey = ("next", "truncated"),
        terminated_key: NestedKey = ("next", "terminated"),
    ) -> None:
        seq_len, num_windows = _torchrl_names(seq_len, slice_len, num_windows, num_slices, burn_in)
        if seq_len < 1 or burn_in < 0:
            raise ValueError(f"seq_len must be >= 1 and burn_in >= 0, got seq_len={seq_len}, burn_in={burn_in}")
        if uniform_over not in ("windows", "episodes"):
            raise ValueError(f"uniform_over must be 'windows' or 'episodes', got {uniform_over!r}")
        self.seq_len = seq_len
        self.burn_in = burn_in
        self.window_len = burn_in + seq_len
        self.num_windows = num_windows
        self.strict_length = strict_length
        self.uniform_over = uniform_over
        self.include_open = include_open
        self.cross_ring_end = cross_ring_end
        self.mask_key, self.done_key = mask_key, done_key
        self.truncated_key, self.terminated_key = truncated_key, terminated_key
        self.traj_key, self.end_key = traj_key, end_key
        self._tree: PriorityTrees | None = None
        self._seen: tuple[int, int] | None = None  # the episode index's position when last refreshed

    # -- per-episode window counts ----------------------------------------------------
    def _windows_in(self, length: torch.Tensor) -> torch.Tensor:
        if self.strict_length:
            return (length - self.window_len + 1).clamp_min(0)
        return length

    def _weights(self, episodes: EpisodeIndex, slots: torch.Tensor) -> torch.Tensor:
        count = self._windows_in(episodes.length[slots])
        count = torch.where(episodes.slot_is_live(slots) & ~episodes.dead[slots], count, 0)
        if not self.include_open:
            count = torch.where(episodes.closed[slots], count, 0)
        if self.uniform_over == "episodes":
            count = (count > 0).to(count.dtype)
        return count.to(torch.float64)

    def _refresh(self, episodes: EpisodeIndex) -> None:
        """Bring the window-count tree up to the index's revision."""
        slots = episodes.changed_since(self._seen)
        if slots is None or self._tree is None or self._tree.capacity != episodes.start.numel():
            self._tree = PriorityTrees(episodes.start.numel())
            slots = torch.arange(episodes.start.numel())
        if slots.numel():
            self._tree.set(slots, self._weights(episodes, slots))
        self._seen = episodes.position

    # -- sampling -----------------------------------------------------------------------
    def sample(self, storage: GearStorage, batch_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
        num_windows = self._num_windows(batch_size)
        if getattr(storage, "is_sharded", False):  # each shard's owner draws its share
            index, windows, info = self._pick_shards(storage, num_windows)
        else:
            if not isinstance(storage, GearStorage):
                raise TypeError(f"GearSequenceSampler needs a GearStorage (its episode index), got {type(storage).__name__}")
            index, windows, info = self._pick_local(storage, num_windows)
        windows = dataclasses.replace(windows, markers=functools.partial(self._markers, windows))
        storage.plan_windows(index, windows)
        return index, info

    def _pick_local(self, storage: GearStorage, num_windows: int) -> tuple[torch.Tensor, Windows, dict[str, Any]]:
        """TorchRL's flat row index of the windows, the windows, and the batch's info."""
        with storage.shard.picking():  # a shared store catches up with other processes' commits here
            windows = self.draw_windows(storage, num_windows)
        # On the storage's device already: TorchRL would otherwise move it, and the
        # moved copy would no longer be the tensor the storage's window plan names.
        return windows.rows(storage.shard.capacity).to(storage.device), windows, {}

    def _pick_shards(self, storage: Any, num_windows: int) -> tuple[torch.Tensor, Windows, dict[str, Any]]:
        """The same across a ShardedGearStorage: global row ids."""
        index, windows = storage.select_windows(self.selection(), num_windows)
        return index, windows, {}

    def draw_windows(self, storage: GearStorage, num_windows: int) -> Windows:
        """``num_windows`` windows of the shard (call inside ``storage.shard.picking()``)."""
        shard = storage.shard
        if shard.size == 0:
            raise RuntimeError("cannot sample from an empty storage: write some data first")
        if not shard.tracks_episodes:
            raise RuntimeError("GearSequenceSampler needs rows that are single steps (batch_size [] per row)")
        self._check_episode_keys(shard)
        self._refresh(shard.episodes)
        if not self._tree.total > 0:
            raise RuntimeError(self._nothing_to_sample(shard.episodes))
        return self._draw(shard.episodes, num_windows, shard.capacity)

    def _check_episode_keys(self, shard: Any) -> None:
        """Windows must not cross episodes: refuse when nothing in the data delimits them."""
        if self.traj_key is not None and as_path(self.traj_key) != as_path(shard.traj_key or ()):
            raise ValueError(f"traj_key={self.traj_key!r}: episodes come from the storage's index, whose "
                             f"trajectory key is {shard.traj_key!r}; build GearStorage(traj_key={self.traj_key!r})")
        if self.end_key is not None and as_path(self.end_key) not in {as_path(k) for k in shard.end_keys}:
            raise ValueError(f"end_key={self.end_key!r}: episodes come from the storage's index, whose end keys "
                             f"are {shard.end_keys!r}; build GearStorage(end_keys=[{self.end_key!r}])")
        if not shard.has_episode_markers:
            raise KeyError(f"none of the storage's end keys {shard.end_keys!r} nor a trajectory key is in the "
                           "data, so every stored step would count as one episode and windows would cross "
                           "episodes; pass GearStorage(end_keys=..., traj_key=...) naming keys the data has")

    def window_mass(self, storage: GearStorage) -> float:
        """How many windows (or eligible episodes) the shard holds: its weight among shards."""
        shard = storage.shard
        if shard.size == 0 or not shard.tracks_episodes:
            return 0.0
        self._refresh(shard.episodes)
        return float(self._tree.total)

    def selection(self) -> dict[str, Any]:
        """What a shard owner needs to draw these windows."""
        return {"kind": "sequence", "seq_len": self.seq_len, "burn_in": self.burn_in,
                "strict_length": self.strict_length, "uniform_over": self.uniform_over,
                "include_open": self.include_open, "cross_ring_end": self.cross_ring_end}

    def _num_windows(self, batch_size: int) -> int:
        if self.num_windows is not None:
            if batch_size != self.num_windows * self.window_len:
                raise ValueError(f"batch size {batch_size} is not num_windows * window_len = "
                                 f"{self.num_windows} * {self.window_len}")
            return self.num_windows
        if batch_size % self.window_len:
            raise ValueError(f"batch size {batch_size} is not a multiple of the window length {self.window_len}")
        return batch_size // self.window_len

    def _draw(self, episodes: EpisodeIndex, count: int, capacity: int) -> Windows:
        windows = self._draw_once(episodes, count)
        if self.cross_ring_end:
            return windows
        for _ in range(_MAX_REJECTION_ROUNDS):
            wraps = self._wraps(windows, capacity)
            if not bool(wraps.any()):
                return windows
            redraw = self._draw_once(episodes, int(wraps.sum()))
            for name in ("starts", "valid_begin", "valid_end"):
                getattr(windows, name)[wraps] = getattr(redraw, name)
        raise RuntimeError("could not draw windows that stay off the ring end: almost every window wraps; "
                           "use cross_ring_end=True")

    def _wraps(self, windows: Windows, capacity: int) -> torch.Tensor:
        first = (windows.starts + windows.valid_begin) % capacity
        return first + (windows.valid_end - windows.valid_begin) > capacity

    def _draw_once(self, episodes: EpisodeIndex, count: int) -> Windows:
        """Episodes by their window counts, then a uniform window inside each."""
        u = uniform((2, count), self._rng)
        slots = self._tree.find(u[0] * self._tree.total)
        placed = _C.uniform_windows(episodes.start, episodes.length, slots, u[1], self.window_len, self.burn_in,
                                    self.strict_length)
        return Windows(placed[0], self.window_len, *placed[1:])

    def _markers(self, windows: Windows, columns: dict[NestedKey, torch.Tensor],
                 mask: torch.Tensor) -> dict[NestedKey, torch.Tensor]:
        """SliceSampler's trajectory markers, from the columns the storage just gathered.

        They go into the batch as it is built, so they cost neither a second
        gather nor a per-key insert afterwards.
        """
        num_steps = mask.numel()
        truncated = torch.zeros(num_steps, 1, dtype=torch.bool, device=mask.device)
        last = torch.arange(windows.starts.numel()) * windows.seq_len + windows.valid_end - 1
        truncated[last.to(mask.device)] = True
        by_path = {as_path(k): t for k, t in columns.items()}

        def stored_flag(key: NestedKey) -> torch.Tensor:
            flag = by_path.get(as_path(key))
            if flag is None:
                return torch.zeros_like(truncated)
            flag = flag.reshape(num_steps, -1)
            return flag if flag.shape[1] == 1 and flag.dtype == torch.bool else flag.any(-1, keepdim=True)

        return {
            self.mask_key: mask,
            self.truncated_key: truncated,
            self.done_key: stored_flag(self.done_key) | truncated,
            self.terminated_key: stored_flag(self.terminated_key),
        }

    def _nothing_to_sample(self, episodes: EpisodeIndex) -> str:
        longest = int(episodes.live().length.max()) if episodes.num_episodes else 0
        if self.strict_length:
            return (f"no stored episode holds a window of {self.window_len} steps (longest: {longest} steps); "
                    "use strict_length=False to pad, or a shorter seq_len/burn_in")
        return "no episode can be sampled (include_open=False and every stored episode is still open?)"

    # -- TorchRL contract -------------------------------------------------------------
    def _empty(self) -> None:
        self._tree, self._seen = None, None

    def state_dict(self) -> dict[str, Any]:
        return {}  # everything is derived from the storage's episode index

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._empty()

    def dumps(self, path) -> None:
        """Nothing to save: the window tree is rebuilt from the storage's episode index."""

    def loads(self, path) -> None:
        self._empty()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(seq_len={self.seq_len}, burn_in={self.burn_in}, "
                f"strict_length={self.strict_length}, uniform_over={self.uniform_over!r})")


def _torchrl_names(seq_len: int | None, slice_len: int | None, num_windows: int | None,
                   num_slices: int | None, burn_in: int) -> tuple[int, int | None]:
    """``seq_len`` and ``num_windows`` from ours or SliceSampler's names (one of each pair at most)."""
    if (seq_len is None) == (slice_len is None):
        raise TypeError("GearSequenceSampler takes one of seq_len (training steps per window) or slice_len "
                        f"(SliceSampler's: the whole window, burn_in included); got seq_len={seq_len}, "
                        f"slice_len={slice_len}")
    if num_windows is not None and num_slices is not None:
        raise TypeError(f"num_windows and num_slices name the same thing; got both ({num_windows}, {num_slices})")
    if slice_len is not None:
        seq_len = slice_len - burn_in
    return seq_len, num_windows if num_slices is None else num_slices
