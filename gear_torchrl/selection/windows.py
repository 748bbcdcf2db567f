"""Windows of steps inside episodes, uniform over windows or over episodes.

No scan of done flags at pick time: a tree over episode slots holds each
episode's number of windows (kept current from the episode index's change
log), so a pick costs O(count · log episodes): episodes by window count,
then an offset inside each.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import AnsweredBy, SelectionSpec, Selector, SpecT_co, needs_shard
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.random_draws import uniform
from gear_torchrl.selection.trees import PriorityTrees
from gear_torchrl.store.episodes import Episodes, Position
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.table_spec import Path, as_path
from gear_torchrl.store.windows import Windows

_MAX_REJECTION_ROUNDS = 16
_NONE = torch.empty(0, dtype=torch.int64)


class WindowGeometry(SelectionSpec):
    """What every rule over windows of steps settles (``WindowSpec``, ``PriorityWindowSpec``): their lengths,
    and the keys expected to delimit episodes. Each rule's dataclass declares the fields."""

    seq_len: int
    burn_in: int
    strict_length: bool
    include_open: bool
    cross_ring_end: bool
    traj_key: Path | None
    end_key: Path | None

    @property
    def window_len(self) -> int:
        return self.burn_in + self.seq_len

    @property
    def rows_per_pick(self) -> int:
        return self.window_len

    def check(self) -> None:
        if self.seq_len < 1 or self.burn_in < 0:
            raise ValueError(
                f"seq_len must be >= 1 and burn_in >= 0, got seq_len={self.seq_len}, burn_in={self.burn_in}"
            )


class EpisodeKeys(Protocol):
    """What a rule over episodes says of them: the keys it expects to delimit them, and whether it may wrap."""

    @property
    def cross_ring_end(self) -> bool: ...

    @property
    def traj_key(self) -> Path | None: ...

    @property
    def end_key(self) -> Path | None: ...


def check_episode_markers(spec: EpisodeKeys, shard: Shard) -> None:
    """Windows must not cross episodes: refuse when nothing in the data delimits them, or keys disagree."""
    if not shard.tracks_episodes:
        assert shard.table is not None  # a shard with rows has a table
        raise RuntimeError(
            f"windows need rows that are single steps (batch_size [] per row); these rows are "
            f"{list(shard.table.row_batch_shape)}. For [num_envs, T] batches of a batched env use "
            "GearStorage(max_size, ndim=2)"
        )
    if shard.num_envs is not None and not spec.cross_ring_end:
        raise NotImplementedError(
            "cross_ring_end=False is not available over an ndim=2 storage yet (its windows "
            "step through one env column, whose time ring ends elsewhere than the rows')"
        )
    if spec.traj_key is not None and spec.traj_key != as_path(shard.traj_key or ()):
        key = _shown(spec.traj_key)
        raise ValueError(
            f"traj_key={key!r}: episodes come from the storage's index, whose "
            f"trajectory key is {shard.traj_key!r}; build GearStorage(traj_key={key!r})"
        )
    if spec.end_key is not None and spec.end_key not in {as_path(k) for k in shard.end_keys}:
        key = _shown(spec.end_key)
        raise ValueError(
            f"end_key={key!r}: episodes come from the storage's index, whose end keys "
            f"are {shard.end_keys!r}; build GearStorage(end_keys=[{key!r}])"
        )
    if not shard.has_episode_markers:
        raise KeyError(
            f"none of the storage's end keys {shard.end_keys!r} nor a trajectory key is in the "
            "data, so every stored step would count as one episode and windows would cross "
            "episodes; pass GearStorage(end_keys=..., traj_key=...) naming keys the data has"
        )


def _shown(path: tuple[str, ...]) -> str | tuple[str, ...]:
    """A key as users write it: a name, or a tuple of names."""
    return path[0] if len(path) == 1 else path


def no_window_reason(spec: WindowGeometry, episodes: Episodes) -> str:
    longest = int(episodes.live().length.max()) if episodes.num_episodes else 0
    if spec.strict_length:
        return (
            f"no stored episode holds a window of {spec.window_len} steps (longest: {longest} steps); "
            "use strict_length=False to pad, or a shorter seq_len/burn_in"
        )
    return "no episode can be sampled (include_open=False and every stored episode is still open?)"


def wrap_starts(picked: Picked, window_rows: int) -> Picked:
    """``picked`` with its windows' starts taken into ``[0, window_rows)``, in place: episodes' starts run on
    past the ring's last row."""
    picked.starts.remainder_(window_rows)
    return picked


def wraps(windows: Windows, capacity: int) -> torch.Tensor:
    """Which windows' valid rows run from the last ring row to the first."""
    first = (windows.starts + windows.valid_begin) % capacity
    return first + (windows.valid_end - windows.valid_begin) > capacity


def redraw_wrapping(draw: Callable[[int], Windows], windows: Windows, capacity: int) -> None:
    """Draw the ``windows`` that wrap the ring end again (``draw(count)``), a bounded number of times."""
    for _ in range(_MAX_REJECTION_ROUNDS):
        wrapping = wraps(windows, capacity)
        if not bool(wrapping.any()):
            return
        redraw = draw(int(wrapping.sum()))
        for name in ("starts", "valid_begin", "valid_end"):
            getattr(windows, name)[wrapping] = getattr(redraw, name)
    raise RuntimeError(
        "could not draw windows that stay off the ring end: almost every window wraps; use cross_ring_end=True"
    )


@dataclass(frozen=True)
class WindowSpec(WindowGeometry):
    """Windows of ``burn_in + seq_len`` steps inside one episode each (see ``selection/windows.py``).

    ``traj_key`` / ``end_key``: what the reader expects to delimit episodes; checked
    against the store's own keys at the first pick (None: not checked).
    """

    kind: ClassVar[str] = "windows"
    per_reader: ClassVar[bool] = True
    answered_by: ClassVar[AnsweredBy] = "windows"
    seq_len: int
    burn_in: int = 0
    strict_length: bool = True
    uniform_over: str = "windows"
    include_open: bool = True
    cross_ring_end: bool = True
    traj_key: Path | None = None
    end_key: Path | None = None

    def check(self) -> None:
        super().check()
        if self.uniform_over not in ("windows", "episodes"):
            raise ValueError(f"uniform_over must be 'windows' or 'episodes', got {self.uniform_over!r}")

    def build(self, capacity: int) -> WindowSelector:
        return WindowSelector(self)


class EpisodeTreeSelector(Selector[SpecT_co]):
    """A rule that draws episodes by a weight each (windows, packed sequences): the weights in a tree over
    episode slots, kept current from the episode index's change log; per reader (it follows the reader's
    index)."""

    def __init__(self, spec: SpecT_co) -> None:
        self.spec = spec
        self.tree: PriorityTrees | None = None
        self._seen: Position | None = None  # the episode index's position when last refreshed

    @abstractmethod
    def _weights(self, episodes: Episodes, slots: torch.Tensor) -> torch.Tensor:
        """float64 weights of episode ``slots`` (0: not drawn)."""

    def _refresh(self, episodes: Episodes) -> PriorityTrees:
        """The weight tree, brought up to the index's revision."""
        slots = episodes.changed_since(self._seen)
        if slots is None or self.tree is None or self.tree.capacity != episodes.start.numel():
            self.tree = PriorityTrees(episodes.start.numel())
            slots = torch.arange(episodes.start.numel())
        if slots.numel():
            self.tree.set(slots, self._weights(episodes, slots))
        self._seen = episodes.position
        return self.tree

    def mass(self, shard: Shard) -> float:
        """The shard's total weight: how many windows (or eligible episodes, ...) it holds."""
        if shard.size == 0 or not shard.tracks_episodes:
            return 0.0
        return float(self._refresh(shard.episodes).total)

    def clear(self) -> None:
        self.tree, self._seen = None, None


class WindowSelector(EpisodeTreeSelector[WindowSpec]):
    """Per-episode window counts in a tree over episode slots."""

    def _windows_in(self, length: torch.Tensor) -> torch.Tensor:
        if self.spec.strict_length:
            return (length - self.spec.window_len + 1).clamp_min(0)
        return length

    def _weights(self, episodes: Episodes, slots: torch.Tensor) -> torch.Tensor:
        count = self._windows_in(episodes.length[slots])
        count = torch.where(episodes.slot_is_live(slots) & ~episodes.dead[slots], count, 0)
        if not self.spec.include_open:
            count = torch.where(episodes.closed[slots], count, 0)
        if self.spec.uniform_over == "episodes":
            count = (count > 0).to(count.dtype)
        return count.to(torch.float64)

    def draw_state(self, shard: Shard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """What ``pick`` draws from, brought up to the shard's index: the tree's sums and the episodes'
        starts and lengths, for a draw outside Python that repeats ``_draw`` (``csrc/net/owner.cpp``).
        None where ``pick`` does more than that one draw (windows kept off the ring end, env columns)."""
        if not self.spec.cross_ring_end or shard.num_envs is not None or not self.mass(shard) > 0:
            return None
        assert self.tree is not None  # ``mass`` made it
        return self.tree.sum, shard.episodes.start, shard.episodes.length

    def pick(self, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
        shard = needs_shard(self, shard)
        if shard.size:
            check_episode_markers(self.spec, shard)
        mass = self.mass(shard)
        if count == 0 or not mass > 0:
            return Picked(_NONE, self.spec.window_len, _NONE, _NONE, mass)
        picked = self._draw(shard.episodes, count, generator, mass)
        if not self.spec.cross_ring_end:
            redraw_wrapping(lambda n: self._draw(shard.episodes, n, generator, mass), picked, shard.capacity)
        return wrap_starts(picked, shard.window_rows)

    def nothing_to_pick(self, shard: Shard | None, count: int, got: int) -> str:
        return no_window_reason(self.spec, needs_shard(self, shard).episodes)

    def _draw(self, episodes: Episodes, count: int, generator: torch.Generator | None, mass: float) -> Picked:
        """Episodes by their window counts, then a uniform window inside each (``_C.draw_windows``)."""
        assert self.tree is not None  # ``mass`` made it
        spec = self.spec
        placed = _C.draw_windows(
            self.tree.sum,
            episodes.start,
            episodes.length,
            uniform((2, count), generator),
            spec.window_len,
            spec.burn_in,
            spec.strict_length,
        )
        return Picked(placed[0], spec.window_len, placed[1], placed[2], mass)
