"""GearPrioritizedSequenceSampler: prioritized windows (``selection/priority_windows.py``) for TorchRL.

``update_priority`` takes the batch's flat index and either one priority per
step (reduced per window: R2D2's ``eta * max + (1 - eta) * mean``, or the
first training step's own priority with ``reduction="start"``) or one per
window.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch

from gear_torchrl.adapters.samplers.prioritized import GearPrioritizedSampler, KeyedPriorityState
from gear_torchrl.adapters.samplers.sequence import GearSequenceSampler
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.priority_windows import PriorityWindowSelector, PriorityWindowSpec, key_priorities
from gear_torchrl.selection.windows import WindowSpec


class GearPrioritizedSequenceSampler(KeyedPriorityState, GearSequenceSampler, GearPrioritizedSampler):  # type: ignore[misc]  # windows' sample
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

    selector: PriorityWindowSelector

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
        if window_options.get("uniform_over", "windows") != "windows":
            raise ValueError("prioritized windows are drawn by priority: uniform_over does not apply")
        GearSequenceSampler.__init__(self, seq_len, **window_options)
        windows = cast(WindowSpec, self.selector.spec)  # of the WindowSelector it made, replaced below
        self._windows, self._reduction_eta = windows, (reduction, float(eta))
        GearPrioritizedSampler.__init__(self, max_capacity, alpha, beta, eps)  # builds the core below, once
        self.window_reduction = reduction  # (TorchRL's `reduction` is the per-step reduce over extra dims)
        self.eta = eta

    def _new_selector(self, alpha: float, eps: float) -> PriorityWindowSelector:
        spec = PriorityWindowSpec.over(self._windows, alpha, eps, *self._reduction_eta)
        return PriorityWindowSelector(spec, self._max_capacity)

    @property
    def _row_mass(self) -> torch.Tensor:
        return self.selector.row_mass

    @property
    def _tree(self):
        return self.selector.trees

    # -- sampling and priorities ----------------------------------------------------------
    def info(self, picked: Picked) -> dict[str, Any]:
        """Each window's importance weight, repeated over its steps (global minimum mass across shards)."""
        weight = self._importance_weights(picked.extra["mass"], picked.scalars["min_mass"])
        self._anneal_beta()
        return {"priority_weight": weight.repeat_interleave(self.window_len)}

    @torch.no_grad()
    def update_priority(self, index: Any, priority: Any, *, storage: Any = None, generation: Any = None) -> None:
        """Priorities for sampled windows: ``index`` is the batch's flat index (``[W * window_len]``)."""
        if self._took_seeding(index, priority, storage):
            return
        targets, priority = key_priorities(self.selector.spec, self._index_rows(storage, index), priority)
        self._update_keys(storage, targets, priority)

    def set_key_priorities(self, rows: torch.Tensor, priority: torch.Tensor) -> None:
        """Raw priorities of window keys (checked)."""
        self.selector.update(rows, priority)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(seq_len={self.seq_len}, burn_in={self.burn_in}, "
            f"reduction={self.window_reduction!r}, alpha={self.alpha}, beta={self._beta})"
        )
