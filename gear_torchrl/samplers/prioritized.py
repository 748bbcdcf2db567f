"""GearPrioritizedSampler: proportional prioritized replay on float64 trees in the extension."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torchrl.data.replay_buffers.samplers import PrioritizedSampler
from torchrl.data.replay_buffers.storages import Storage

from gear_torchrl.samplers.block_sums import BlockPrefixSums
from gear_torchrl.samplers.following import FollowsCommits
from gear_torchrl.samplers.random_draws import uniform
from gear_torchrl.samplers.trees import PriorityTrees
from gear_torchrl.samplers.state_file import StateDictFile
from gear_torchrl.store.state_checks import (
    CheckpointError,
    checked_float,
    checked_int,
    checked_tensor,
    field,
    require_masses,
    require_nonnegative,
    require_nothing_past,
)


def _shaped_priority(priority: Any, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    priority = torch.as_tensor(priority).detach().to(device, torch.float64).reshape(-1)
    if priority.numel() == 1 and count != 1:
        priority = priority.expand(count)
    if priority.numel() != count:
        raise ValueError(f"got {priority.numel()} priorities for {count} indices")
    return priority


def _bad_priorities(priority: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(priority) | (priority < 0)


def _refuse_bad_priority(priority: torch.Tensor, bad: torch.Tensor) -> None:
    pos = int(bad.nonzero()[0, 0])
    raise ValueError(f"priorities must be finite and non-negative; got {float(priority[pos])} at position {pos}")


class _Checked(NamedTuple):
    """An update's indices and priorities on the sampler's device, and what checking them learned."""

    index: torch.Tensor
    priority: torch.Tensor | None
    skips: bool  # some index is -1
    max_priority: float  # 0.0 without priorities


class IndexDtypeError(IndexError, TypeError):
    """Indices that are not integers: a float would be truncated to another row, a bool read as row 0 or 1."""


def _integer_rows(index: Any) -> torch.Tensor:
    rows = torch.as_tensor(index)
    if rows.dtype == torch.bool or rows.is_floating_point() or rows.is_complex():
        raise IndexDtypeError(f"priority indices must be integers, got {rows.dtype}")
    return rows.to(torch.int64)


def _validated(index: Any, priority: Any, capacity: int, device: torch.device | str = "cpu",
               stored: int | None = None) -> _Checked:
    """Indices (and priorities) on ``device``, checked with a single wait for it.

    Index -1 means "skip", as TorchRL's ``MaxValueWriter`` uses it. Indices must
    be below ``capacity`` and, when the storage is known, below its ``stored``
    rows: a priority there would be drawn, and the read would fail. A NaN, an
    infinity or a negative value shows in the priorities' minimum or maximum.
    """
    index = _integer_rows(index).reshape(-1).to(device)
    if priority is not None:
        priority = _shaped_priority(priority, index.numel(), device)
    if index.numel() == 0:
        return _Checked(index, priority, False, 0.0)
    facts = torch.stack(torch.aminmax(index)).to(torch.float64)
    if priority is not None:
        facts = torch.cat([facts, torch.stack(torch.aminmax(priority))])
    lo, hi, *extremes = facts.tolist()
    bound, rows = (capacity, "rows") if stored is None or stored >= capacity else (stored, "stored rows")
    if lo < -1 or hi >= bound:
        raise IndexError(f"priority index {int(lo) if lo < -1 else int(hi)} is out of range for {bound} {rows}")
    if extremes and not (extremes[0] >= 0 and extremes[1] < math.inf):
        _refuse_bad_priority(priority, _bad_priorities(priority))
    return _Checked(index, priority, lo < 0, extremes[1] if extremes else 0.0)


def _stored_rows(storage: Storage | None) -> int | None:
    """Rows of a gear storage a sampler may draw (None: not known, the capacity bounds indices)."""
    shard = getattr(storage, "shard", None)
    return None if shard is None else shard.ring_rows


def _as_index(index: Any, capacity: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return _validated(index, None, capacity, device).index


def _as_priority(priority: Any, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    priority = _shaped_priority(priority, count, device)
    bad = _bad_priorities(priority)
    if bool(bad.any()):
        _refuse_bad_priority(priority, bad)
    return priority


def _seeds_defaults(index: Any, priority: Any, default: float) -> bool:
    """Whether this is TorchRL's ``_initialize_prioritized_sampler``: rows 0..n-1 at the default priority."""
    index, priority = torch.as_tensor(index).reshape(-1), torch.as_tensor(priority).reshape(-1)
    return (index.numel() > 0 and bool((index == torch.arange(index.numel(), device=index.device)).all())
            and bool((priority == default).all()))


class GearPrioritizedSampler(FollowsCommits, StateDictFile, PrioritizedSampler):
    """Proportional PER (Schaul et al.): P(i) = p_i^alpha / sum_j p_j^alpha, weights (p_i / p_min)^-beta.

    A drop-in for TorchRL's ``PrioritizedSampler`` (it is one, so
    ``TensorDictReplayBuffer.update_tensordict_priority`` works), with its trees in
    float64 and every update and draw done in one batched extension call.

    Each sampled batch's info carries ``"generation"``: pass it back as
    ``update_priority(index, priority, generation=...)`` and rows overwritten since
    they were sampled keep their new priority instead of the stale one.

    ``beta`` anneals linearly to ``beta_final`` over ``beta_anneal_steps`` calls
    to ``sample`` when that is given.

    With ``device="cuda"`` the masses live on the GPU (blocked prefix sums, see
    ``block_sums.py``): draws, weights and updates run there, for storages whose
    batches are on the GPU too.
    """

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
    ) -> None:
        if alpha < 0 or beta < 0:
            raise ValueError(f"alpha and beta must be non-negative, got alpha={alpha}, beta={beta}")
        if max_capacity <= 0:
            raise ValueError(f"max_capacity must be positive, got {max_capacity}")
        self._max_capacity = int(max_capacity)
        self._alpha = float(alpha)
        self._beta = float(beta)
        self._beta_start = float(beta)
        self._beta_final = float(beta_final)
        self._beta_anneal_steps = beta_anneal_steps
        self._eps = float(eps)
        self.reduction = "max"
        self._device = torch.device(device)
        self._init()

    def _init(self) -> None:
        # The one place CPU and GPU differ: trees in the extension, or blocked prefix sums on the device.
        if self._device.type == "cpu":
            self._trees: PriorityTrees | BlockPrefixSums = PriorityTrees(self._max_capacity)
        else:
            self._trees = BlockPrefixSums(self._max_capacity, self._device)
        self._generation = torch.zeros(self._max_capacity, dtype=torch.int64, device=self._device)
        # The last draw (rows, their generations, writes seen by then): TorchRL's update_tensordict_priority
        # passes no generation, and a row rewritten since its draw must not take the update.
        self._last_draw: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._writes = 0  # mark_update calls: none since a draw means none of its rows was rewritten
        # A device tensor, so updates never wait for the GPU to learn the new maximum.
        self._max_raw_priority = torch.tensor(1.0, dtype=torch.float64, device=self._device)
        self._sample_calls = 0
        self._followed = (0, 0)  # the shared store's rows this sampler has priorities for

    # -- TorchRL's knobs -------------------------------------------------------------
    @property
    def alpha(self) -> float:
        return self._alpha

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = float(value)

    @property
    def default_priority(self) -> float:
        """Raw priority of new rows: the largest seen, so new experience gets sampled."""
        return float(self._max_raw_priority)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(capacity={self._max_capacity}, alpha={self._alpha}, beta={self._beta}, "
                f"eps={self._eps}, total_mass={self.total_mass:.6g})")

    # -- sampling --------------------------------------------------------------------
    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        if getattr(storage, "is_sharded", False):
            return self._sample_shards(storage, batch_size)
        return FollowsCommits.sample(self, storage, batch_size)

    def forget(self, rows: torch.Tensor) -> None:
        """Rows lose their mass until they are written again (evicted, or capped by MaxTimesSampled)."""
        self._trees.remove(rows.to(self._device))

    def _pick(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        if len(storage) == 0:
            raise RuntimeError("cannot sample from an empty storage: write some data first")
        if not self._trees.total > 0:  # on a GPU, the one wait for the device in a draw
            raise RuntimeError("every stored row has priority 0: nothing can be sampled")
        index, generation = self.draw(batch_size)
        self._last_draw = (index, generation, self._writes)
        weight = self._importance_weights(self._trees.get(index), self._trees.minimum)
        self._anneal_beta()
        return index, {"priority_weight": weight, "generation": generation}

    def _sample_shards(self, storage: Any, batch_size: int) -> tuple[torch.Tensor, dict]:
        """Each shard's owner draws its share from its own trees; the weights are global."""
        picked = storage.select(self.selection(), batch_size)
        weight = self._importance_weights(picked.extra["mass"], picked.scalars["min_mass"])
        self._anneal_beta()
        return picked.index, {"priority_weight": weight, "generation": picked.extra["generation"]}

    def draw(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` rows drawn in proportion to their masses, and their write generations."""
        mass = uniform(count, self._rng, self._device) * self._trees.total
        index = self._trees.find(mass)
        return index, self._generation.index_select(0, index)

    def _importance_weights(self, masses: torch.Tensor, min_mass: float) -> torch.Tensor:
        """(N P(i))^-beta normalized by its largest value: (mass_i / min mass)^-beta."""
        return torch.pow(masses / min_mass, -self._beta).to(torch.float32)

    def selection(self) -> dict[str, Any]:
        """What a shard owner needs to keep these priorities (``beta`` stays with the learner)."""
        return {"kind": "prioritized", "alpha": self._alpha, "eps": self._eps}

    def masses(self, index: torch.Tensor) -> torch.Tensor:
        """``(p + eps)^alpha`` of each row."""
        return self._trees.get(index)

    @property
    def total_mass(self) -> float:
        return float(self._trees.total)

    @property
    def min_mass(self) -> float:
        """The smallest positive mass (what normalizes the importance weights)."""
        return float(self._trees.minimum)

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
        """Set raw priorities; everything is checked before the trees change."""
        if getattr(storage, "is_sharded", False):
            if _seeds_defaults(index, priority, self.default_priority):
                return  # TorchRL's first-use seeding of stored rows: owners give new rows this priority already
            storage.update_priority(self.selection(), index, priority, generation)
            return
        index, priority, skips, max_priority = _validated(index, priority, self._max_capacity, self._device,
                                                          stored=_stored_rows(storage))
        if index.numel() == 0:
            return
        # Masks, not filters: filtering would wait for the GPU.
        keep = (index >= 0) if skips else None
        rows = index.clamp_min(0) if skips else index
        if generation is None:
            generation = self._generations_if_rewritten_since_drawn(index)
        if generation is not None:
            generation = torch.as_tensor(generation, dtype=torch.int64).reshape(-1).to(self._device)
            if generation.numel() != index.numel():
                raise ValueError(f"got {generation.numel()} generations for {index.numel()} indices")
            current = self._generation.index_select(0, rows) == generation
            keep = current if keep is None else keep & current
        if keep is None:  # every entry lands: the checked maximum is the batch's
            self._max_raw_priority.clamp_(min=max_priority)
        else:
            self._max_raw_priority = torch.maximum(self._max_raw_priority, torch.where(keep, priority, 0.0).max())
        self._trees.set(rows, torch.pow(priority + self._eps, self._alpha), keep)

    def _generations_if_rewritten_since_drawn(self, index: torch.Tensor) -> torch.Tensor | None:
        """The last draw's generations when ``index`` is its rows and some write came since, else None.

        TorchRL's ``update_tensordict_priority`` brings the drawn rows back without
        their generations; with no write since the draw, none can be stale and the
        update costs no check at all.
        """
        last = self._last_draw
        if last is None or last[2] == self._writes:
            return None
        drawn, generation, _ = last
        same = index is drawn or (index.shape == drawn.shape and torch.equal(index, drawn))
        return generation if same else None

    def mark_update(self, index: int | torch.Tensor, *, storage: Storage | None = None) -> None:
        """Rows were (over)written: new generation, default priority."""
        index = _as_index(index, self._max_capacity, self._device)
        index = index[index >= 0]
        self._writes += 1
        self._generation[index] += 1
        mass = torch.pow(self._max_raw_priority + self._eps, self._alpha)
        self._trees.set(index, mass.repeat(index.numel()))

    exclude = forget  # MaxTimesSampled: unsampleable until written again

    def add(self, index: int) -> None:
        """Nothing to do: ``mark_update`` already gave the new row its priority."""

    def extend(self, index: torch.Tensor) -> None:
        """Nothing to do: ``mark_update`` already gave the new rows their priority."""

    def _empty(self) -> None:
        self._init()

    # -- state -----------------------------------------------------------------------
    _state_file = "sampler.json"
    _mass_key = "mass"  # the saved per-row masses
    _masses_draw_rows = True  # a positive mass makes its row drawable (the storage must restore it)

    def _scalars(self) -> dict:
        return {"capacity": self._max_capacity, "alpha": self._alpha, "beta": self._beta, "eps": self._eps,
                "max_raw_priority": float(self._max_raw_priority), "sample_calls": self._sample_calls}

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {**self._trees.tensors(), "generation": self._generation}

    def state_dict(self) -> dict[str, Any]:
        return {**self._scalars(), **{k: v.clone() for k, v in self._state_tensors().items()}}

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        """``state`` checked in full: scalars in range, tensors of this sampler's shapes, masses finite and
        non-negative, none on a row past the ``rows`` a storage restores with it."""
        where = f"the saved {type(self).__name__} state"
        capacity = checked_int(field(state, "capacity", where), "capacity", lo=1)
        if capacity != self._max_capacity:
            raise CheckpointError(f"state is for capacity {capacity}, this sampler has {self._max_capacity}")
        checked = {"capacity": capacity, "sample_calls": checked_int(field(state, "sample_calls", where),
                                                                     "sample_calls")}
        for name in ("alpha", "beta", "eps", "max_raw_priority"):
            checked[name] = checked_float(field(state, name, where), name)
        for name, own in self._state_tensors().items():
            checked[name] = checked_tensor(field(state, name, where), name, own.dtype, tuple(own.shape))
        mass = checked[self._mass_key]
        require_masses(mass, self._mass_key)
        if self._masses_draw_rows:
            require_nothing_past(mass > 0, rows, self._mass_key)
        require_nonnegative(checked["generation"], "generation")
        return checked

    def _assign(self, state: dict[str, Any]) -> None:
        self._trees.load_tensors({k: state[k] for k in self._trees.tensors()})
        self._generation.copy_(state["generation"])
        self._last_draw = None  # draws before the load say nothing of the loaded rows
        self._alpha, self._beta, self._eps = state["alpha"], state["beta"], state["eps"]
        self._max_raw_priority = torch.tensor(state["max_raw_priority"], dtype=torch.float64, device=self._device)
        self._sample_calls = state["sample_calls"]

    def _unlisted_layout(self) -> dict[str, tuple[torch.dtype, list[int]]]:
        """Before checksums, ``sampler.json`` held the scalars alone, next to these files."""
        return {name: (t.dtype, list(t.shape)) for name, t in self._state_tensors().items()}

    def __getstate__(self) -> dict:
        return dict(self.__dict__)
