"""GearPrioritizedSequenceSampler: prioritized windows (R2D2's sequence priorities).

A window is keyed by the ring row of its first training step (after the
burn-in). A float64 tree holds one mass per row: the row's priority mass if
a window may start its training steps there, else zero. Which rows may do so
follows the episode index (its change log, as for the uniform sampler), so a
batch costs O(batch · log N).

``update_priority`` takes the batch's flat index and either one priority per
step (reduced per window: R2D2's ``eta * max + (1 - eta) * mean``, or the
first training step's own priority with ``reduction="start"``) or one per
window.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from gear_torchrl._ext import _C
from gear_torchrl.samplers.prioritized import (
    GearPrioritizedSampler,
    _as_index,
    _as_priority,
    _seeds_defaults,
)
from gear_torchrl.samplers.random_draws import uniform
from gear_torchrl.samplers.sequence import GearSequenceSampler
from gear_torchrl.storage import GearStorage
from gear_torchrl.store.episodes import EpisodeIndex
from gear_torchrl.store.shard import Windows


class GearPrioritizedSequenceSampler(GearSequenceSampler, GearPrioritizedSampler):
    """Windows drawn in proportion to their priority, with importance weights per step.

    Takes GearSequenceSampler's window options plus ``alpha``, ``beta``, ``eps``
    (as GearPrioritizedSampler) and:

    Args:
        max_capacity: rows of the storage it samples.
        reduction: ``"r2d2"`` (``eta * max + (1 - eta) * mean`` of a window's step
            priorities) or ``"start"`` (each step keeps its own priority; a window
            weighs as its first training step).
        eta: R2D2's mix of max and mean.
    """

    def __init__(
        self,
        max_capacity: int,
        seq_len: int | None = None,
        *,
        alpha: float = 0.9,
        beta: float = 0.6,
        eps: float = 1e-6,
        reduction: Literal["r2d2", "start"] = "r2d2",
        eta: float = 0.9,
        **window_options: Any,
    ) -> None:
        if reduction not in ("r2d2", "start"):
            raise ValueError(f"reduction must be 'r2d2' or 'start', got {reduction!r}")
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"eta must be in [0, 1], got {eta}")
        GearSequenceSampler.__init__(self, seq_len, **window_options)
        GearPrioritizedSampler.__init__(self, max_capacity, alpha, beta, eps)
        self.window_reduction = reduction  # (TorchRL's `reduction` is the per-step reduce over extra dims)
        self.eta = eta

    def _init(self) -> None:
        GearPrioritizedSampler._init(self)
        self._row_mass = torch.ones(self._max_capacity, dtype=torch.float64)  # (p + eps)^alpha per row
        self._episodes: EpisodeIndex | None = None  # of the storage last sampled

    # -- which rows may key a window ----------------------------------------------------
    def _key_offsets(self, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """First and one-past-last offset of a training start, per episode length."""
        if self.strict_length:
            return torch.full_like(length, self.burn_in), (length - self.seq_len + 1).clamp_min(self.burn_in)
        return torch.zeros_like(length), length

    def _valid_keys(self, episodes: EpisodeIndex, rows: torch.Tensor) -> torch.Tensor:
        slots, offset, found = episodes.locate(rows)
        lo, hi = self._key_offsets(episodes.length[slots])
        valid = found & (offset >= lo) & (offset < hi)
        if not self.include_open:
            valid &= episodes.closed[slots]
        return valid

    def _refresh(self, episodes: EpisodeIndex) -> None:
        """Re-derive the masses of the rows of every episode that changed since the last look."""
        slots = episodes.changed_since(self._seen)
        if slots is None:
            self._trees.clear()
            slots = torch.arange(episodes.start.numel())
        slots = slots[episodes.slot_is_live(slots)]
        if slots.numel():
            self._set_masses(episodes, episodes.rows_of(slots))
        self._seen = episodes.position
        self._episodes = episodes
        self._tree = self._trees  # the base class draws from and checks `_tree`

    def _set_masses(self, episodes: EpisodeIndex, rows: torch.Tensor) -> None:
        valid = self._valid_keys(episodes, rows)
        self._trees.set(rows[valid], self._row_mass[rows[valid]])
        self._trees.remove(rows[~valid])  # no mass, and out of the minimum

    def draw_windows(self, storage: GearStorage, num_windows: int) -> Windows:
        # Rows committed by TrajectoryWriters (or other processes) since the last draw get the
        # largest priority seen, as rows written through the buffer do (call inside ``picking()``).
        self.follow(storage)
        return GearSequenceSampler.draw_windows(self, storage, num_windows)

    def _draw_once(self, episodes: EpisodeIndex, count: int) -> Windows:
        """Windows by their key steps' priorities: the key step sits ``burn_in`` steps into its window."""
        keys = self._trees.find(uniform(count, self._rng) * self._trees.total)
        slots, key_offset, _ = episodes.locate(keys)
        placed = _C.place_windows(episodes.start, episodes.length, slots, key_offset - self.burn_in, self.window_len)
        return Windows(placed[0], self.window_len, *placed[1:])

    # -- sampling and priorities ----------------------------------------------------------
    def sample(self, storage: GearStorage, batch_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
        if not getattr(storage, "is_sharded", False) and storage.max_size != self._max_capacity:
            raise ValueError(f"sampler built for {self._max_capacity} rows, storage holds {storage.max_size}")
        index, info = GearSequenceSampler.sample(self, storage, batch_size)
        self._anneal_beta()
        return index, info

    def _pick_local(self, storage: GearStorage, num_windows: int) -> tuple[torch.Tensor, Windows, dict[str, Any]]:
        index, windows, _ = GearSequenceSampler._pick_local(self, storage, num_windows)
        keys = index.view(-1, self.window_len)[:, self.burn_in].cpu()
        return index, windows, self._weights_info(self._trees.get(keys), self._trees.minimum)

    def _pick_shards(self, storage: Any, num_windows: int) -> tuple[torch.Tensor, Windows, dict[str, Any]]:
        """Each owner draws windows by its own priorities; the weights use the global minimum mass."""
        picked = storage.select(self.selection(), num_windows)
        return picked.index, picked.windows, self._weights_info(picked.extra["mass"], picked.scalars["min_mass"])

    def _weights_info(self, key_masses: torch.Tensor, min_mass: float) -> dict[str, Any]:
        """Each window's importance weight, repeated over its steps."""
        return {"priority_weight": self._importance_weights(key_masses, min_mass).repeat_interleave(self.window_len)}

    def selection(self) -> dict[str, Any]:
        """What a shard owner needs to keep these window priorities (``beta`` stays with the learner)."""
        return {**GearSequenceSampler.selection(self), "kind": "prioritized_sequence", "alpha": self._alpha,
                "eps": self._eps, "reduction": self.window_reduction, "eta": self.eta}

    @torch.no_grad()
    def update_priority(self, index: Any, priority: Any, *, storage: GearStorage | None = None) -> None:
        """Priorities for sampled windows: ``index`` is the batch's flat index (``[W * window_len]``)."""
        sharded = getattr(storage, "is_sharded", False)
        if self._is_seeding(index, priority, storage):
            # TorchRL's first-use seeding of stored rows (not windows): they become new rows, here or on their owners.
            if not sharded:
                self.mark_update(index)
            return
        if sharded:  # global row ids: the owners check them
            rows = torch.as_tensor(index, dtype=torch.int64).reshape(-1)
        else:
            rows = _as_index(index, self._max_capacity)
        targets, priority = self._key_priorities(rows, priority)
        if sharded:
            storage.update_priority(self.selection(), targets, priority)
        else:
            self.set_key_priorities(targets, priority)

    def _is_seeding(self, index: Any, priority: Any, storage: Any) -> bool:
        """Whether TorchRL's buffer is giving every stored row the default priority (rows 0..len-1)."""
        if storage is None or torch.as_tensor(index).numel() != len(storage):
            return False
        return _seeds_defaults(index, priority, self.default_priority)

    def _key_priorities(self, rows: torch.Tensor, priority: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows whose priorities change (window keys, or every step) and their raw priorities."""
        if rows.numel() % self.window_len:
            raise ValueError(f"index of {rows.numel()} rows is not whole windows of {self.window_len} steps")
        windows = rows.view(-1, self.window_len)
        per_window = torch.as_tensor(priority).numel() == windows.shape[0] and windows.shape[0] != rows.numel()
        priority = _as_priority(priority, windows.shape[0] if per_window else rows.numel())
        if not per_window and self.window_reduction == "start":
            return rows, priority
        if not per_window:
            steps = priority.view(-1, self.window_len)
            priority = self.eta * steps.max(1).values + (1 - self.eta) * steps.mean(1)
        return windows[:, self.burn_in], priority

    def set_key_priorities(self, rows: torch.Tensor, priority: torch.Tensor) -> None:
        """Raw priorities of rows (checked) as window keys: what an update lands as, here or on a shard's owner."""
        if priority.numel():
            self._max_raw_priority = max(self._max_raw_priority, float(priority.max()))
        self._row_mass[rows] = torch.pow(priority + self._eps, self._alpha)
        if self._episodes is not None:  # else the first sample derives every mass
            self._set_masses(self._episodes, rows)

    def mark_update(self, index: Any, *, storage: GearStorage | None = None) -> None:
        """New rows get the largest priority seen; their windows count once the index says so."""
        rows = _as_index(index, self._max_capacity)
        rows = rows[rows >= 0]
        self._generation[rows] += 1
        self._row_mass[rows] = (self._max_raw_priority + self._eps) ** self._alpha

    # -- state ------------------------------------------------------------------------------
    def _empty(self) -> None:
        GearSequenceSampler._empty(self)
        self._init()

    _mass_key = "row_mass"
    _masses_draw_rows = False  # a row's mass counts once the episode index says a window starts there

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {"row_mass": self._row_mass, "generation": self._generation}

    def _assign(self, state: dict[str, Any]) -> None:
        self._row_mass.copy_(state["row_mass"])
        self._generation.copy_(state["generation"])
        self._alpha, self._beta, self._eps = state["alpha"], state["beta"], state["eps"]
        self._max_raw_priority = state["max_raw_priority"]
        self._sample_calls = state["sample_calls"]
        GearSequenceSampler._empty(self)  # the tree is re-derived at the next sample

    def state_dict(self) -> dict[str, Any]:
        return GearPrioritizedSampler.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        GearPrioritizedSampler.load_state_dict(self, state_dict)

    def dumps(self, path: str | Path) -> None:
        GearPrioritizedSampler.dumps(self, path)

    def loads(self, path: str | Path) -> None:
        GearPrioritizedSampler.loads(self, path)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(seq_len={self.seq_len}, burn_in={self.burn_in}, reduction={self.window_reduction!r}, "
                f"alpha={self._alpha}, beta={self._beta})")
