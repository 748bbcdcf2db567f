"""Sum and min trees of priorities in float64 tensors, updated and searched in batches.

float64 because float32 trees lose mass once millions of priorities are
summed. The tensors are the whole state: a checkpoint writes them as they are.
"""
from __future__ import annotations

import torch

from gear_torchrl._ext import _C


def tree_nodes(capacity: int) -> int:
    """Nodes of a binary tree over ``capacity`` leaves: 2L with L the next power of two."""
    leaves = 1
    while leaves < capacity:
        leaves *= 2
    return 2 * leaves


class PriorityTrees:
    """Per-row masses with O(log N) batched set, prefix search, total and minimum."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.sum = torch.zeros(tree_nodes(capacity), dtype=torch.float64)
        self.min = torch.full((tree_nodes(capacity),), float("inf"), dtype=torch.float64)

    @property
    def total(self) -> float:
        return float(self.sum[1])

    @property
    def minimum(self) -> float:
        return float(self.min[1])

    def set(self, index: torch.Tensor, mass: torch.Tensor) -> None:
        """Masses of rows; the minimum counts positive masses only, so importance weights stay finite."""
        mass = mass.to(torch.float64)
        _C.sum_tree_set(self.sum, index, mass)
        _C.min_tree_set(self.min, index, torch.where(mass > 0, mass, float("inf")))

    def remove(self, index: torch.Tensor) -> None:
        self.set(index, torch.zeros(index.numel(), dtype=torch.float64))

    def get(self, index: torch.Tensor) -> torch.Tensor:
        return self.sum[index + self.sum.numel() // 2]

    def find(self, prefix_mass: torch.Tensor) -> torch.Tensor:
        return _C.sum_tree_find(self.sum, prefix_mass)

    def clear(self) -> None:
        self.sum.zero_()
        self.min.fill_(float("inf"))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Per-row masses: the same state whatever structure (and device) holds them."""
        leaves = self.sum.numel() // 2
        return {"mass": self.sum[leaves: leaves + self.capacity]}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        mass = tensors["mass"].to("cpu", torch.float64)
        self.clear()
        self.set(torch.arange(self.capacity), mass)


class ScoreTree:
    """Per-row scores in a max tree: batched set, and the k best rows in O(k log N)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.max = torch.full((tree_nodes(capacity),), float("-inf"), dtype=torch.float64)

    def set(self, index: torch.Tensor, score: torch.Tensor) -> None:
        _C.max_tree_set(self.max, index, score)

    def remove(self, index: torch.Tensor) -> None:
        self.set(index, torch.full((index.numel(),), float("-inf"), dtype=torch.float64))

    def top(self, k: int) -> torch.Tensor:
        return _C.max_tree_topk(self.max, k)

    def clear(self) -> None:
        self.max.fill_(float("-inf"))
