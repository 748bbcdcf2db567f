"""Windows drawn in proportion to priority (R2D2's sequence priorities).

A window is keyed by the ring row of its first training step (after the
burn-in; in a ``[T, num_envs]`` store, that step's row ``t * num_envs + e``).
A float64 tree holds one mass per row: the row's priority mass if a window
may start its training steps there, else zero. Which rows may do so follows
the episode index's change log, so a pick costs O(count · log N).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import needs_shard
from gear_torchrl.selection.checked_inputs import (
    NativeUpdate,
    as_generation,
    as_priority,
    row_bound,
    validated,
)
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.priorities import PrioritySelector, ProportionalSpec
from gear_torchrl.selection.trees import PriorityTrees
from gear_torchrl.selection.windows import (
    WindowGeometry,
    WindowSpec,
    check_episode_markers,
    no_window_reason,
    redraw_wrapping,
    wrap_starts,
)
from gear_torchrl.store.episodes import EpisodeIndex, Episodes, Position
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.table_spec import Path

_NONE = torch.empty(0, dtype=torch.int64)


def key_priorities(spec: PriorityWindowSpec, rows: torch.Tensor, priority: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows whose priorities change (window keys, or every step) and their raw priorities.

    ``rows`` is a batch's flat index (``[W * window_len]``); ``priority`` one per step (reduced
    per window: ``eta * max + (1 - eta) * mean``, or each step its own with ``reduction="start"``)
    or one per window.
    """
    if rows.numel() % spec.window_len:
        raise ValueError(f"index of {rows.numel()} rows is not whole windows of {spec.window_len} steps")
    windows = rows.view(-1, spec.window_len)
    per_window = torch.as_tensor(priority).numel() == windows.shape[0] and windows.shape[0] != rows.numel()
    priority = as_priority(priority, windows.shape[0] if per_window else rows.numel())
    if not per_window and spec.reduction == "start":
        return rows, priority
    if not per_window:
        steps = priority.view(-1, spec.window_len)
        priority = spec.eta * steps.max(1).values + (1 - spec.eta) * steps.mean(1)
    return windows[:, spec.burn_in], priority


@dataclass(frozen=True)
class PriorityWindowSpec(WindowGeometry, ProportionalSpec):
    """Windows in proportion to their key step's priority (R2D2's sequence priorities)."""

    kind: ClassVar[str] = "priority_windows"
    seq_len: int
    burn_in: int = 0
    strict_length: bool = True
    include_open: bool = True
    cross_ring_end: bool = True
    traj_key: Path | None = None
    end_key: Path | None = None
    alpha: float = 0.9
    eps: float = 1e-6
    reduction: str = "r2d2"
    eta: float = 0.9

    def check(self) -> None:
        WindowGeometry.check(self)
        ProportionalSpec.check(self)
        if self.reduction not in ("r2d2", "start"):
            raise ValueError(f"reduction must be 'r2d2' or 'start', got {self.reduction!r}")
        if not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"eta must be in [0, 1], got {self.eta}")

    uniform_over: ClassVar[str] = "windows"

    @classmethod
    def over(cls, windows: WindowSpec, alpha: float, eps: float, reduction: str, eta: float) -> PriorityWindowSpec:
        """``windows``' geometry, drawn by priority."""
        geometry = {f.name: getattr(windows, f.name) for f in dataclasses.fields(windows) if f.name != "uniform_over"}
        return cls(**geometry, alpha=alpha, eps=eps, reduction=reduction, eta=eta)

    def build(self, capacity: int) -> PriorityWindowSelector:
        return PriorityWindowSelector(self, capacity)


class LiveTables(NamedTuple):
    """An index's live episodes as ``EpisodeIndex.locate`` searches them, named as the extension takes them
    (csrc/kernels/windows.h ``LiveTensors``)."""

    first_start: int  # the ring row where the oldest live episode starts
    live_start: torch.Tensor  # int64 [E], oldest first
    live_length: torch.Tensor
    live_ends: torch.Tensor  # their lengths' running sums
    live_closed: torch.Tensor  # bool [E]

    @classmethod
    def of(cls, episodes: EpisodeIndex) -> LiveTables:
        view, ends = episodes.located()
        return cls(int(view.start[0]) if view.start.numel() else 0, view.start, view.length, ends, view.closed)


class NativeWindowTables(NamedTuple):
    """What the native owner draws prioritized windows from and updates, named as ``_C.PriorityWindowRule``'s
    fields (csrc/net/owner.h): the core's tables, and (``LiveTables``) the live episodes of the index its trees
    were derived from."""

    sum_tree: torch.Tensor
    min_tree: torch.Tensor
    generation: torch.Tensor
    row_mass: torch.Tensor
    max_priority: torch.Tensor
    derivation: torch.Tensor  # int64 [1]: moves whenever the trees are derived anew (``derived``: its value now)
    derived: int
    alpha: float
    eps: float


def window_keys(spec: PriorityWindowSpec) -> dict[str, Any]:
    """Where ``spec``'s keys sit and which rows may be one, named as the extension takes them (``WindowKeys``)."""
    return {
        "window_len": spec.window_len,
        "burn_in": spec.burn_in,
        "strict_length": spec.strict_length,
        "include_open": spec.include_open,
    }


class PriorityWindowSelector(PrioritySelector[PriorityWindowSpec]):
    """Row masses as window keys; rows that may not key a window have none."""

    # Whether a key is a window's first training step, which the extension knows (``_key_offsets``): it then
    # draws and updates this rule itself (csrc/net/owner.cpp, kernels/priorities.cpp).
    keys_are_window_starts: ClassVar[bool] = True

    def __init__(self, spec: PriorityWindowSpec, capacity: int, device: torch.device | str = "cpu") -> None:
        # Moves whenever the trees are derived anew from an index (or cleared, restored, rewritten): a native
        # draw from tables of an earlier derivation is left to Python.
        self.derivation = torch.zeros(1, dtype=torch.int64)
        super().__init__(spec, capacity, "cpu")

    def clear(self) -> None:
        super().clear()
        self.row_mass = torch.ones(self.capacity, dtype=torch.float64)  # (p + eps)^alpha per row
        self._episodes: Episodes | None = None  # of the shard last picked from
        self._seen: Position | None = None
        self.derivation += 1

    def retire(self) -> None:
        super().retire()
        self.derivation += 1

    # -- which rows may key a window ----------------------------------------------------
    def _key_offsets(self, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """First and one-past-last offset of a training start, per episode length."""
        if self.spec.strict_length:
            return (
                torch.full_like(length, self.spec.burn_in),
                (length - self.spec.seq_len + 1).clamp_min(self.spec.burn_in),
            )
        return torch.zeros_like(length), length

    def _valid_keys(self, episodes: Episodes, rows: torch.Tensor) -> torch.Tensor:
        slots, offset, found = episodes.locate(rows)
        lo, hi = self._key_offsets(episodes.length[slots])
        valid = found & (offset >= lo) & (offset < hi)
        if not self.spec.include_open:
            valid &= episodes.closed[slots]
        return valid

    def _refresh(self, episodes: Episodes) -> None:
        """Re-derive the masses of the rows of every episode that changed since the last look."""
        slots = episodes.changed_since(self._seen)
        if slots is None or episodes is not self._episodes:
            self.trees.clear()
            slots = torch.arange(episodes.start.numel())
        slots = slots[episodes.slot_is_live(slots)]
        if slots.numel():
            self._set_masses(episodes, episodes.rows_of(slots))
            self.derivation += 1
        self._seen = episodes.position
        self._episodes = episodes

    def _set_masses(self, episodes: Episodes, rows: torch.Tensor) -> None:
        valid = self._valid_keys(episodes, rows)
        self.trees.set(rows[valid], self.row_mass[rows[valid]])
        self.trees.remove(rows[~valid])  # no mass, and out of the minimum

    # -- following the store ---------------------------------------------------------
    def written(self, rows: torch.Tensor, shard: Shard | None) -> None:
        """New rows get the largest priority seen; their windows count once the index says so."""
        self.writes += 1
        self.generation[rows] += 1
        self.row_mass[rows] = torch.pow(self.max_raw_priority + self.eps, self.alpha)
        self.derivation += 1

    def forget(self, rows: torch.Tensor) -> None:
        super().forget(rows)
        self.derivation += 1

    exclude = forget

    # -- picking ---------------------------------------------------------------------
    def mass(self, shard: Shard) -> float:
        if shard.size == 0 or not shard.tracks_episodes:
            return 0.0
        self._refresh(shard.episodes)
        return self.total

    def pick(self, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
        shard = needs_shard(self, shard)
        episodes = shard.episodes
        if shard.size:
            check_episode_markers(self.spec, shard)
        mass = self.mass(shard)
        scalars = {"min_mass": float(self.trees.minimum)}
        if count == 0 or not mass > 0:
            return Picked(_NONE, self.spec.window_len, _NONE, _NONE, mass, scalars=scalars)
        picked = self._draw(episodes, count, generator, mass)
        if not self.spec.cross_ring_end:
            redraw_wrapping(lambda n: self._draw(episodes, n, generator, mass), picked, shard.capacity)
        keys = shard.addressing.ring_rows(picked.starts + self.spec.burn_in)
        picked.extra["mass"] = self.trees.get(keys)
        picked.extra["generation"] = self.generation[keys]  # what an update of these keys names them by
        picked.scalars = scalars
        return wrap_starts(picked, shard.window_rows)

    def nothing_to_pick(self, shard: Shard | None, count: int, got: int) -> str:
        return no_window_reason(self.spec, needs_shard(self, shard).episodes)

    def draw_state(self, shard: Shard) -> tuple[NativeWindowTables, LiveTables] | None:
        """What ``pick`` draws from and ``update`` changes, the trees brought up to the shard's index, for a
        native owner that repeats them (``csrc/net/owner.cpp``). None where ``pick`` does more than one draw
        (windows kept off the ring end, env columns) or there is nothing to draw. Call under the core's lock,
        after ``follow``."""
        episodes = shard.episodes
        if not (self.keys_are_window_starts and self.spec.cross_ring_end and isinstance(episodes, EpisodeIndex)):
            return None
        if not (isinstance(self.trees, PriorityTrees) and self.mass(shard) > 0):
            return None
        tables = NativeWindowTables(
            self.trees.sum,
            self.trees.min,
            self.generation,
            self.row_mass,
            self.max_raw_priority,
            self.derivation,
            int(self.derivation),
            self.alpha,
            self.eps,
        )
        return tables, LiveTables.of(episodes)

    def _draw(self, episodes: Episodes, count: int, generator: torch.Generator | None, mass: float) -> Picked:
        """Windows by their key steps' priorities: the key step sits ``burn_in`` steps into its window."""
        keys = self.trees.draw(count, generator)
        slots, key_offset, _ = episodes.locate(keys)
        placed = _C.place_windows(
            episodes.start, episodes.length, slots, key_offset - self.spec.burn_in, self.spec.window_len
        )
        return Picked(placed[0], self.spec.window_len, placed[1], placed[2], mass)

    # -- priorities ------------------------------------------------------------------
    def update(self, rows: Any, priority: Any, generation: Any = None, stored: int | None = None) -> None:
        """Raw priorities of window keys (checked against the ``stored`` rows where known): what an update lands
        as, here or on a shard's owner. Keys rewritten since their ``generation`` was drawn keep theirs.

        Once a pick derived the trees from an episode index, one extension call checks the update, keeps each
        row's mass and sets the trees where the row keys a window (as a native owner applies a posted one)."""
        episodes, trees = self._episodes, self.trees
        if not (
            self.keys_are_window_starts and isinstance(episodes, EpisodeIndex) and isinstance(trees, PriorityTrees)
        ):
            self._update_in_python(rows, priority, generation, stored)
            return
        update = NativeUpdate.of(rows, priority, generation)
        facts = _C.priority_window_update(
            trees.sum,
            trees.min,
            self.generation,
            self.row_mass,
            *update,
            self.alpha,
            self.eps,
            row_bound(self.capacity, stored),
            **LiveTables.of(episodes)._asdict(),
            **window_keys(self.spec),
        )
        self.max_raw_priority.clamp_(min=update.landed(facts, self.capacity, stored))

    def _update_in_python(self, rows: Any, priority: Any, generation: Any, stored: int | None) -> None:
        """``update`` with tensor ops: before the first pick (the row masses alone), over env columns, or where
        keys are not window starts (packs)."""
        checked = validated(rows, priority, self.capacity, stored=stored)
        rows, priority = checked.rows, as_priority(checked.priority, checked.rows.numel())
        mass = torch.pow(priority + self.eps, self.alpha)  # over the whole update, as the native owner's
        keep = rows >= 0
        if generation is not None:
            keep &= self.generation[rows.clamp_min(0)] == as_generation(generation, rows.numel())
        rows, priority, mass = rows[keep], priority[keep], mass[keep]
        if priority.numel():
            self.max_raw_priority.clamp_(min=float(priority.max()))
        self.row_mass[rows] = mass
        if self._episodes is not None:  # else the first pick derives every mass
            self._set_masses(self._episodes, rows)

    # -- state -----------------------------------------------------------------------
    def export_rows(self, rows: torch.Tensor) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "eps": self.eps,
            "max_raw_priority": float(self.max_raw_priority),
            "row_mass": self.row_mass[rows].clone(),
            "generation": self.generation[rows].clone(),
        }

    def import_rows(self, state: dict[str, Any]) -> None:
        n = state["row_mass"].numel()
        self.alpha, self.eps = state["alpha"], state["eps"]
        self.max_raw_priority.fill_(state["max_raw_priority"])  # in place: the native owner may hold this tensor
        self.row_mass[:n] = state["row_mass"]
        self.generation[:n] = state["generation"]  # window masses are derived from the index at the next pick
        self.derivation += 1

    mass_key = "row_mass"
    masses_draw_rows = False  # a row's mass counts once the episode index says a window starts there

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"row_mass": self.row_mass, "generation": self.generation}

    def assign(self, state: dict[str, Any]) -> None:
        self.row_mass.copy_(state["row_mass"])
        self.generation.copy_(state["generation"])
        self.alpha, self.eps = state["alpha"], state["eps"]
        self.max_raw_priority.fill_(state["max_raw_priority"])  # in place: the native owner may hold this tensor
        self.writes += 1
        self._episodes, self._seen = None, None  # the tree is re-derived at the next pick
        self.derivation += 1
