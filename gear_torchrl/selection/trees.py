"""Sum, min and max trees of per-row values in float64 tensors, updated and searched in batches.

float64 because float32 trees lose mass once millions of priorities are
summed. The layout (8-ary, one cache line per node's children) lives in
csrc/kernels/trees.h; here the trees are tensors plus where their leaves start.
"""

from __future__ import annotations

import torch

from gear_torchrl.kernels import _C
from gear_torchrl.store.huge_pages import empty_huge


def _tree(capacity: int, fill: float) -> tuple[torch.Tensor, int]:
    """A tree tensor over ``capacity`` leaves, every entry ``fill``, and its first leaf's position."""
    nodes = _C.tree_nodes(capacity)
    return empty_huge((nodes,), torch.float64).fill_(fill), _C.tree_leaf_offset(nodes)


class PriorityTrees:
    """Per-row masses with O(log N) batched set, prefix search, total and minimum."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.sum, self._leaf = _tree(capacity, 0.0)
        self.min, _ = _tree(capacity, float("inf"))
        self._masses = self.sum[self._leaf : self._leaf + capacity]  # a view of the leaves

    @property
    def total(self) -> float:
        return float(self.sum[0])

    @property
    def minimum(self) -> float:
        return float(self.min[0])

    def set(self, index: torch.Tensor, mass: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Masses of rows (entries with ``keep`` False dropped); the minimum counts positive masses only."""
        _C.priority_set(self.sum, self.min, index, mass, keep)

    def remove(self, index: torch.Tensor) -> None:
        self.set(index, torch.zeros(index.numel(), dtype=torch.float64))

    def get(self, index: torch.Tensor) -> torch.Tensor:
        return self._masses.index_select(0, index)

    def find(self, prefix_mass: torch.Tensor) -> torch.Tensor:
        return _C.sum_tree_find(self.sum, prefix_mass)

    def draw(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """``count`` rows in proportion to their masses, from ``generator`` (a CPU one, or the global)."""
        return _C.sum_tree_draw(self.sum, count, generator)

    def clear(self) -> None:
        self.sum.zero_()
        self.min.fill_(float("inf"))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Per-row masses: the same state whatever structure (and device) holds them."""
        return {"mass": self._masses}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        mass = tensors["mass"].to("cpu", torch.float64)
        self.clear()
        self.set(torch.arange(self.capacity), mass)


class ScoreTree:
    """Per-row scores in a max tree: batched set, and the k best rows in O(k log N)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.max, leaf = _tree(capacity, float("-inf"))
        self._scores = self.max[leaf : leaf + capacity]  # a view of the leaves

    def set(self, index: torch.Tensor, score: torch.Tensor) -> None:
        _C.max_tree_set(self.max, index, score)

    def get(self, index: torch.Tensor) -> torch.Tensor:
        return self._scores.index_select(0, index)

    def remove(self, index: torch.Tensor) -> None:
        self.set(index, torch.full((index.numel(),), float("-inf"), dtype=torch.float64))

    def top(self, k: int) -> torch.Tensor:
        return _C.max_tree_topk(self.max, k)

    def clear(self) -> None:
        self.max.fill_(float("-inf"))
