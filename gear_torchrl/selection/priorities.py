"""Proportional priorities over rows: float64 trees, write generations, the largest priority seen.

P(i) = (p_i + eps)^alpha / sum_j (p_j + eps)^alpha. New rows get the largest
raw priority seen, so new experience is drawn. Each row's write generation
lets an update for a row rewritten since it was drawn be dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch

from gear_torchrl.errors import CheckpointError
from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import AnsweredBy, SelectionSpec, StatefulSelector
from gear_torchrl.selection.block_sums import BlockPrefixSums
from gear_torchrl.selection.checked_inputs import (
    NativeUpdate,
    as_generation,
    row_bound,
    validated,
)
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.trees import PriorityTrees
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.state_checks import (
    checked_float,
    checked_int,
    checked_tensor,
    field,
    require_masses,
    require_nonnegative,
    require_nothing_past,
)

_NONE = torch.empty(0, dtype=torch.int64)


class NativeTables(NamedTuple):
    """What the native owner draws from and updates, named as ``_C.PriorityRule``'s fields (csrc/net/owner.h)."""

    sum_tree: torch.Tensor
    min_tree: torch.Tensor
    generation: torch.Tensor  # each row's write generation
    followed: torch.Tensor  # the positions [lo, hi) the core has followed
    max_priority: torch.Tensor  # the largest raw priority seen
    alpha: float
    eps: float


class ProportionalSpec(SelectionSpec):
    """A rule that draws in proportion to ``(p + eps)^alpha`` (``PrioritySpec``, ``PriorityWindowSpec``);
    each rule's dataclass declares the fields."""

    alpha: float
    eps: float
    # A pick is whole as rows or windows, each with its mass and generation: what the owner's extension draws
    # (packs say more per pick: their core picks them).
    answered_by: ClassVar[AnsweredBy] = "prioritized"

    def check(self) -> None:
        if not self.alpha >= 0:
            raise ValueError(f"alpha must be non-negative, got {self.alpha}")


@dataclass(frozen=True)
class PrioritySpec(ProportionalSpec):
    """Proportional prioritized rows: P(i) ~ (p_i + eps)^alpha."""

    kind: ClassVar[str] = "priorities"
    can_exclude: ClassVar[bool] = True
    alpha: float
    eps: float = 1e-8

    def build(self, capacity: int) -> PrioritySelector[PrioritySpec]:
        return PrioritySelector(self, capacity)


ProportionalT_co = TypeVar("ProportionalT_co", bound=ProportionalSpec, covariant=True)


class PrioritySelector(StatefulSelector[ProportionalT_co]):
    """Per-row masses in trees (CPU: the extension's; a GPU: blocked prefix sums), drawn in proportion.

    ``alpha`` and ``eps`` may be changed by a restored state (TorchRL's samplers save them).
    """

    def __init__(self, spec: ProportionalT_co, capacity: int, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.followed_words = torch.zeros(2, dtype=torch.int64)
        self.clear()

    def clear(self) -> None:
        self.alpha, self.eps = self.spec.alpha, self.spec.eps
        # The one place CPU and GPU differ: trees in the extension, or blocked prefix sums on the device.
        self.trees: PriorityTrees | BlockPrefixSums = (
            PriorityTrees(self.capacity) if self.device.type == "cpu" else BlockPrefixSums(self.capacity, self.device)
        )
        self.generation = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        # A device tensor, so updates never wait for the GPU to learn the new maximum.
        self.max_raw_priority = torch.tensor(1.0, dtype=torch.float64, device=self.device)
        self.writes = 0  # calls to ``written``: none since a draw means none of its rows was rewritten
        self.retire()  # the tables made above replace those a native draw may hold: it follows new words
        self.followed_words = torch.zeros(2, dtype=torch.int64)

    # -- what the native owner draws from (distributed/native_owner.py) -------------------
    @property
    def _followed(self) -> tuple[int, int]:
        """How far the tables have followed the store: kept in a tensor, which the native owner follows too."""
        lo, hi = self.followed_words.tolist()
        return lo, hi

    @_followed.setter
    def _followed(self, position: tuple[int, int]) -> None:
        if position != self._followed:
            self.followed_words.copy_(torch.tensor(position, dtype=torch.int64))

    def native_tables(self) -> NativeTables | None:
        """What the native owner draws from and updates (csrc/net/owner.h PriorityRule); None on a GPU."""
        if not isinstance(self.trees, PriorityTrees):
            return None
        return NativeTables(
            self.trees.sum,
            self.trees.min,
            self.generation,
            self.followed_words,
            self.max_raw_priority,
            self.alpha,
            self.eps,
        )

    def retire(self) -> None:
        self.followed_words.fill_(-1)  # never the store's positions: the extension leaves every draw to Python

    # -- following the store ---------------------------------------------------------
    def written(self, rows: torch.Tensor, shard: Shard | None) -> None:
        """Rows (over)written: a new generation, and the largest priority seen."""
        rows = rows.to(self.device)
        self.writes += 1
        self.generation[rows] += 1
        mass = torch.pow(self.max_raw_priority + self.eps, self.alpha)
        self.trees.set(rows, mass.repeat(rows.numel()))

    def forget(self, rows: torch.Tensor) -> None:
        self.trees.remove(rows.to(self.device))

    exclude = forget

    # -- picking ---------------------------------------------------------------------
    @property
    def total(self) -> float:
        return float(self.trees.total)

    def mass(self, shard: Shard) -> float:
        return self.total

    def pick(self, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
        """Rows in proportion to their masses, with their masses and generations; none when all are 0."""
        total = self.trees.total
        if count == 0 or not total > 0:  # on a GPU, the one wait for the device in a draw
            return Picked.row_picks(_NONE.to(self.device), float(total), scalars={"min_mass": self.trees.minimum})
        rows = self.trees.draw(count, generator)
        return Picked.row_picks(
            rows,
            total,
            extra={"mass": self.trees.get(rows), "generation": self.generation.index_select(0, rows)},
            scalars={"min_mass": self.trees.minimum},
        )

    def nothing_to_pick(self, shard: Shard | None, count: int, got: int) -> str:
        return "every stored row has priority 0: nothing can be sampled"

    def masses(self, rows: torch.Tensor) -> torch.Tensor:
        """``(p + eps)^alpha`` of each row."""
        return self.trees.get(rows)

    # -- priorities ------------------------------------------------------------------
    def update(self, rows: Any, priority: Any, generation: Any = None, stored: int | None = None) -> None:
        """Raw priorities; rows -1 are skipped, and rows whose generation moved on keep theirs.

        Everything is checked before the trees change: on the CPU in the extension's one pass, on a GPU
        with tensor ops that never wait for the device but once.
        """
        if isinstance(self.trees, PriorityTrees):
            self._update_in_trees(rows, priority, generation, stored)
            return
        index, priority, skips, max_priority = validated(rows, priority, self.capacity, self.device, stored=stored)
        if index.numel() == 0:
            return
        # Masks, not filters: filtering would wait for the GPU.
        keep = (index >= 0) if skips else None
        rows = index.clamp_min(0) if skips else index
        generation = as_generation(generation, index.numel(), self.device)
        if generation is not None:
            current = self.generation.index_select(0, rows) == generation
            keep = current if keep is None else keep & current
        if keep is None:  # every entry lands: the checked maximum is the batch's
            self.max_raw_priority.clamp_(min=max_priority)
        else:
            self.max_raw_priority = torch.maximum(self.max_raw_priority, torch.where(keep, priority, 0.0).max())
        self.trees.set(rows, torch.pow(priority + self.eps, self.alpha), keep)

    def _update_in_trees(self, rows: Any, priority: Any, generation: Any, stored: int | None) -> None:
        """``update`` on the CPU trees: checked, stale rows dropped and masses set in one extension call."""
        assert isinstance(self.trees, PriorityTrees)
        update = NativeUpdate.of(rows, priority, generation)
        bound = row_bound(self.capacity, stored)
        trees = self.trees.sum, self.trees.min
        facts = _C.priority_update(*trees, self.generation, *update, self.alpha, self.eps, bound)
        self.max_raw_priority.clamp_(min=update.landed(facts, self.capacity, stored))

    # -- state -----------------------------------------------------------------------
    def export_rows(self, rows: torch.Tensor) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "eps": self.eps,
            "max_raw_priority": float(self.max_raw_priority),
            "mass": self.trees.get(rows.to(self.device)).cpu(),
            "generation": self.generation[rows].cpu(),
        }

    def import_rows(self, state: dict[str, Any]) -> None:
        mass, generation = state["mass"].to(self.device), state["generation"].to(self.device)
        rows = torch.arange(mass.numel(), device=self.device)
        self.alpha, self.eps = state["alpha"], state["eps"]
        self.max_raw_priority.fill_(state["max_raw_priority"])  # in place: the native owner may hold this tensor
        self.trees.set(rows, mass, mass > 0)
        self.generation[rows] = generation

    mass_key = "mass"  # the saved per-row masses
    masses_draw_rows = True  # a positive mass makes its row drawable (the storage must restore it)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {**self.trees.tensors(), "generation": self.generation}

    def state_dict(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "alpha": self.alpha,
            "eps": self.eps,
            "max_raw_priority": float(self.max_raw_priority),
            **{k: v.clone() for k, v in self.state_tensors().items()},
        }

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        """Scalars in range, tensors of this core's shapes, masses finite and non-negative, none past ``rows``."""
        where = "the saved priority state"
        capacity = checked_int(field(state, "capacity", where), "capacity", lo=1)
        if capacity != self.capacity:
            raise CheckpointError(f"state is for capacity {capacity}, this sampler has {self.capacity}")
        checked: dict[str, Any] = {"capacity": capacity}
        for name in ("alpha", "eps", "max_raw_priority"):
            checked[name] = checked_float(field(state, name, where), name)
        for name, own in self.state_tensors().items():
            checked[name] = checked_tensor(field(state, name, where), name, own.dtype, tuple(own.shape))
        mass = checked[self.mass_key]
        require_masses(mass, self.mass_key)
        if self.masses_draw_rows:
            require_nothing_past(mass > 0, rows, self.mass_key)
        require_nonnegative(checked["generation"], "generation")
        return checked

    def assign(self, state: dict[str, Any]) -> None:
        self.trees.load_tensors({k: state[k] for k in self.trees.tensors()})
        self.generation.copy_(state["generation"])
        self.alpha, self.eps = state["alpha"], state["eps"]
        self.max_raw_priority.fill_(state["max_raw_priority"])  # in place: the native owner may hold this tensor
        self.writes += 1  # draws before the load say nothing of the loaded rows
