"""GearPrioritizedSampler: TorchRL's PrioritizedSampler over the priority core (``selection/priorities.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torchrl.data.replay_buffers.samplers import PrioritizedSampler
from torchrl.data.replay_buffers.storages import Storage

from gear_torchrl.adapters.samplers.priority_state import PriorityState
from gear_torchrl.adapters.samplers.selecting import select
from gear_torchrl.adapters.samplers.staleness import BoundsStaleness
from gear_torchrl.adapters.table_storage import TableStorage
from gear_torchrl.selection.checked_inputs import as_rows, integer_rows, seeds_defaults
from gear_torchrl.selection.picked import Picked, SelectionIndex, sample_of
from gear_torchrl.selection.priorities import PrioritySelector, PrioritySpec, ProportionalSpec
from gear_torchrl.store.policy_versions import POLICY_VERSION
from gear_torchrl.store.table_spec import NestedKey


class GearPrioritizedSampler(BoundsStaleness, PriorityState, PrioritizedSampler):
    """Proportional PER (Schaul et al.): P(i) = p_i^alpha / sum_j p_j^alpha, weights (p_i / p_min)^-beta.

    A drop-in for TorchRL's ``PrioritizedSampler`` (it is one, so
    ``TensorDictReplayBuffer.update_tensordict_priority`` works), with its trees in
    float64 and every update and draw done in one batched extension call.

    Each sampled batch's info carries ``"generation"``: pass it back as
    ``update_priority(index, priority, generation=...)`` and rows overwritten since
    they were sampled keep their new priority instead of the stale one (the
    standard ``update_tensordict_priority`` path gets this without it).

    ``beta`` anneals linearly to ``beta_final`` over ``beta_anneal_steps`` calls
    to ``sample`` when that is given.

    With ``device="cuda"`` the masses live on the GPU (blocked prefix sums, see
    ``selection/block_sums.py``): draws, weights and updates run there, for
    storages whose batches are on the GPU too.

    ``max_staleness``, ``version_key`` and ``consumer_version`` bound the policy
    versions drawn, as TorchRL's ``StalenessAwareSampler`` does
    (``adapters/samplers/staleness.py``); the weights are those of the fresh rows.
    """

    selector: PrioritySelector[ProportionalSpec]
    _device: torch.device  # TorchRL's may be None; ours is always set

    def __init__(
        self,
        max_capacity: int,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        *,
        beta_final: float = 1.0,
        beta_anneal_steps: int | None = None,
        device: torch.device | str = "cpu",
        max_staleness: int = -1,
        version_key: NestedKey = POLICY_VERSION,
    ) -> None:
        if alpha < 0 or beta < 0:
            raise ValueError(f"alpha and beta must be non-negative, got alpha={alpha}, beta={beta}")
        if max_capacity <= 0:
            raise ValueError(f"max_capacity must be positive, got {max_capacity}")
        self._max_capacity = int(max_capacity)
        self._beta = float(beta)
        self._beta_start = float(beta)
        self._beta_final = float(beta_final)
        self._beta_anneal_steps = beta_anneal_steps
        self.reduction = "max"
        self._device = torch.device(device)
        self.selector = self._new_selector(float(alpha), float(eps))
        self._sample_calls = 0
        # The last draw (rows, their generations, writes seen by then): TorchRL's update_tensordict_priority
        # passes no generation, and a row rewritten since its draw must not take the update.
        self._last_draw: tuple[SelectionIndex, torch.Tensor, int] | None = None
        self._bound_staleness(max_staleness, version_key, self._max_capacity)

    def _empty(self) -> None:
        """The core cleared (and the staleness bound's versions), the last draw forgotten."""
        self.rule.clear()
        self._last_draw = None

    def state_dict(self) -> dict[str, Any]:
        return self._with_bound(PriorityState.state_dict(self))

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        return self._checked_bound(state, PriorityState.checked_state_dict(self, state, rows))

    def _assign(self, state: dict[str, Any]) -> None:
        PriorityState._assign(self, state)
        self._assign_bound(state)

    def _new_selector(self, alpha: float, eps: float) -> PrioritySelector[ProportionalSpec]:
        """The core this sampler adapts (prioritized windows make another, over their windows)."""
        return PrioritySelector(PrioritySpec(alpha, eps), self._max_capacity, self._device)

    # -- TorchRL's knobs -------------------------------------------------------------
    # TorchRL keeps alpha and eps as attributes; here the core holds them, and TorchRL's code only reads them.
    @property  # type: ignore[misc]  # read from the core
    def alpha(self) -> float:
        return self.selector.alpha

    @property
    def _alpha(self) -> float:  # type: ignore[override]  # read from the core
        return self.selector.alpha

    @property
    def _eps(self) -> float:  # type: ignore[override]  # read from the core
        return self.selector.eps

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = float(value)

    @property
    def default_priority(self) -> float:
        """Raw priority of new rows: the largest seen, so new experience gets sampled."""
        return float(self.selector.max_raw_priority)

    @property
    def _trees(self):
        return self.selector.trees

    @_trees.setter
    def _trees(self, trees) -> None:  # a test swaps the CPU trees for the GPU's structure
        self.selector.trees = trees

    @property
    def _generation(self) -> torch.Tensor:
        return self.selector.generation

    def masses(self, index: torch.Tensor) -> torch.Tensor:
        """``(p + eps)^alpha`` of each row."""
        return self.selector.masses(index)

    @property
    def total_mass(self) -> float:
        return self.selector.total

    @property
    def min_mass(self) -> float:
        """The smallest positive mass (what normalizes the importance weights)."""
        return float(self.selector.trees.minimum)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self._max_capacity}, alpha={self.alpha}, beta={self._beta}, "
            f"eps={self._eps}, total_mass={self.total_mass:.6g})"
        )

    # -- sampling --------------------------------------------------------------------
    def sample(self, storage: Storage, batch_size: int) -> tuple[SelectionIndex, dict]:  # type: ignore[override]  # TorchRL annotates Tensor; its samplers return (index, info)
        picked = select(storage, self.rule, batch_size, self._rng)
        return picked.index, self.info(picked)

    def info(self, picked: Picked) -> dict[str, Any]:
        """Importance weights (global: the smallest mass of every shard picked from) and write generations."""
        generation = picked.extra["generation"]
        self._last_draw = (picked.index, generation, self.selector.writes)
        weight = self._importance_weights(picked.extra["mass"], picked.scalars["min_mass"])
        self._anneal_beta()
        return {"priority_weight": weight, "generation": generation, **self.staleness_info(picked)}

    def _importance_weights(self, masses: torch.Tensor, min_mass: float | torch.Tensor) -> torch.Tensor:
        """(N P(i))^-beta normalized by its largest value: (mass_i / min mass)^-beta."""
        return torch.pow(masses / min_mass, -self._beta).to(torch.float32)

    def _anneal_beta(self) -> None:
        self._sample_calls += 1
        if self._beta_anneal_steps:
            frac = min(1.0, self._sample_calls / self._beta_anneal_steps)
            self._beta = self._beta_start + frac * (self._beta_final - self._beta_start)

    # -- priorities ------------------------------------------------------------------
    @torch.no_grad()
    def update_priority(
        self,
        index: int | torch.Tensor,
        priority: float | torch.Tensor,
        *,
        storage: Storage | None = None,
        generation: torch.Tensor | None = None,
    ) -> None:
        """Set raw priorities; everything is checked before any priority changes."""
        if _follows_writes(storage) and seeds_defaults(index, priority, self.default_priority):
            return  # TorchRL's first-use seeding of stored rows: owners give new rows this priority already
        if generation is None:
            generation = self._generations_if_rewritten_since_drawn(index)
        self._update(storage, index, priority, generation)

    # -- what samplers of keyed rules share (windows, packs: a pick's key is a row) ----------------------
    def _took_seeding(self, index: Any, priority: Any, storage: Any) -> bool:
        """Whether ``update_priority`` is TorchRL's first-use seeding of every stored row at the default
        priority (rows 0..len-1, not a sampled index): they are new rows, followed here (or by their owners);
        nothing else is to be done."""
        if storage is None or sample_of(index) is not None or torch.as_tensor(index).numel() != len(storage):
            return False
        if not seeds_defaults(index, priority, self.default_priority):
            return False
        if not _follows_writes(storage):
            self.mark_update(index)
        return True

    def _index_rows(self, storage: Any, index: Any) -> torch.Tensor:
        """The rows a batch's index names, as the storage names them (global ids on a sharded store, whose
        owners check them; ``(t, e)`` of ``ndim=2`` as ``t * E + e``); -1 skips."""
        if isinstance(storage, TableStorage):
            return storage.table.rows_of(index)
        return as_rows(integer_rows(index).reshape(-1).as_subclass(torch.Tensor), self._max_capacity)

    def _update_keys(
        self, storage: Any, keys: torch.Tensor, priority: torch.Tensor, generation: torch.Tensor | None = None
    ) -> None:
        """Raw priorities of keys that are the store's rows already (checked against the rows stored)."""
        if isinstance(storage, TableStorage):
            storage.table.update_rows(self.selector, keys, priority, generation)
        else:
            self.selector.update(keys, priority, generation)

    def _generations_if_rewritten_since_drawn(self, index: Any) -> torch.Tensor | None:
        """The last draw's generations when ``index`` is its rows and some write came since, else None.

        TorchRL's ``update_tensordict_priority`` brings the drawn rows back without
        their generations; with no write since the draw, none can be stale and the
        update costs no check at all.
        """
        last = self._last_draw
        if last is None or last[2] == self.selector.writes:
            return None
        drawn, generation, _ = last
        if isinstance(drawn, tuple):  # (t, e) coordinates of an ndim=2 storage: TorchRL hands them back stacked
            drawn = torch.stack(drawn, -1)
        if isinstance(index, tuple):
            index = torch.stack(index, -1)
        if not isinstance(index, torch.Tensor):
            return None
        same = index is drawn or (index.shape == drawn.shape and torch.equal(index.to(drawn.device), drawn))
        return generation if same else None

    def forget(self, rows: torch.Tensor) -> None:
        """Rows lose their mass until they are written again (evicted, or capped by MaxTimesSampled)."""
        self.selector.forget(rows)

    exclude = forget

    def add(self, index: torch.Tensor | int) -> None:
        """Nothing to do: ``mark_update`` already gave the new row its priority."""

    def extend(self, index: torch.Tensor | tuple) -> None:
        """Nothing to do: ``mark_update`` already gave the new rows their priority."""

    @property
    def selector_capacity(self) -> int:
        return self._max_capacity

    def __getstate__(self) -> dict:
        return dict(self.__dict__)


class KeyedPriorityState:
    """Listed first in the bases of a prioritized sampler over another sampler's draws (windows, packs): its
    state, files and write-following are ``GearPrioritizedSampler``'s, over masses of keys (each window's or
    sequence's first trained step), which no TorchRL sampler's files hold."""

    _torchrl_files = False
    _empty = PriorityState._empty
    state_dict = PriorityState.state_dict
    load_state_dict = PriorityState.load_state_dict
    dumps = PriorityState.dumps
    loads = PriorityState.loads
    mark_update = GearPrioritizedSampler.mark_update


def _follows_writes(storage: Storage | None) -> bool:
    """Whether ``storage``'s table follows writes itself (a sharded store's owners): TorchRL's first-use
    priority seeding of new rows is then theirs already."""
    return isinstance(storage, TableStorage) and storage.table.follows_writes
