"""Top-k: the rows with the highest score (GEAR's top-k selection).

Scores come from a key of the stored data (read once, when the rows are
written) or from updates. A max tree keeps them, so a pick costs
O(count · log N): no scan of the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gear_torchrl.errors import CheckpointError
from gear_torchrl.kernels import _C
from gear_torchrl.selection.base import SelectionSpec, StatefulSelector
from gear_torchrl.selection.checked_inputs import as_priority, as_rows
from gear_torchrl.selection.picked import Picked
from gear_torchrl.selection.trees import ScoreTree
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.state_checks import checked_tensor, field, require_nothing_past
from gear_torchrl.store.table_spec import Path


@dataclass(frozen=True)
class TopKSpec(SelectionSpec):
    """The best-scoring rows, scored by a stored key or by updates (new rows: ``default_score``)."""

    kind: ClassVar[str] = "top_k"
    can_exclude: ClassVar[bool] = True
    merges_best: ClassVar[bool] = True
    key: Path | None = None
    default_score: float = 0.0

    def build(self, capacity: int) -> TopKSelector:
        return TopKSelector(self, capacity)


class TopKSelector(StatefulSelector[TopKSpec]):
    """A max tree of scores; a pick is the best rows, best first, with their scores."""

    def __init__(self, spec: TopKSpec, capacity: int) -> None:
        self.spec = spec
        self.capacity = capacity
        self.clear()

    def clear(self) -> None:
        self.scores = ScoreTree(self.capacity)
        self._followed = (0, 0)

    def written(self, rows: torch.Tensor, shard: Shard | None) -> None:
        key = self.spec.key
        if key is None:
            score = torch.full((rows.numel(),), self.spec.default_score, dtype=torch.float64)
        else:
            score = self._scores_from(shard, key, rows)
        self.scores.set(rows, score)

    def _scores_from(self, shard: Shard | None, key: Path, rows: torch.Tensor) -> torch.Tensor:
        column = None if shard is None else shard.column(key)
        if column is None:
            raise KeyError(f"top-k scores rows by {key!r}, which the data does not have")
        values = column.index_select(0, rows.to(column.device)).reshape(rows.numel(), -1)
        if values.shape[1] != 1:
            raise ValueError(f"top-k: key {key!r} holds {values.shape[1]} values per row, not one")
        return values[:, 0].double().cpu()

    def forget(self, rows: torch.Tensor) -> None:
        """Rows leave the ranking until they are written again (evicted, or capped)."""
        self.scores.remove(rows)

    exclude = forget

    def update(self, rows: Any, priority: Any, generation: Any = None, stored: int | None = None) -> None:
        if self.spec.key is not None:
            raise RuntimeError(f"top-k scores rows by {self.spec.key!r}; priority updates do not apply")
        rows = as_rows(rows, self.capacity)
        priority = as_priority(priority, rows.numel())
        keep = rows >= 0
        self.scores.set(rows[keep], priority[keep])

    def mass(self, shard: Shard) -> float:
        return float(shard.size)

    def pick(self, shard: Shard | None, count: int, generator: torch.Generator | None) -> Picked:
        """The (at most) ``count`` best rows, best first, with their scores, and the shard's mass (its rows;
        without a shard, the rows picked)."""
        rows = self.scores.top(count)
        mass = float(rows.numel()) if shard is None else self.mass(shard)
        return Picked.row_picks(rows, mass, extra={"score": self.scores.get(rows)})

    def nothing_to_pick(self, shard: Shard | None, count: int, got: int) -> str:
        return f"top-k: asked for the top {count} rows, only {got} are stored"

    # -- state -----------------------------------------------------------------------
    def export_rows(self, rows: torch.Tensor) -> dict[str, Any]:
        return {"score": self.scores.get(rows).clone()}

    def import_rows(self, state: dict[str, Any]) -> None:
        score = state["score"]
        ranked = score > float("-inf")  # rows out of the ranking stay out
        self.scores.set(torch.arange(score.numel())[ranked], score[ranked])

    def state_dict(self) -> dict[str, Any]:
        return {"scores": self.scores.max.clone()}

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        """A tree of this capacity, no NaN, no scored row past the ``rows`` restored."""
        scores = checked_tensor(
            field(state, "scores", "the saved top-k state"), "scores", torch.float64, tuple(self.scores.max.shape)
        )
        if bool(scores.isnan().any()):
            at = int(scores.isnan().nonzero()[0, 0])
            raise CheckpointError(f"scores hold NaN at entry {at}: the state is damaged")
        require_nothing_past(self._leaves(scores) > float("-inf"), rows, "scores")
        return {"scores": scores}

    def assign(self, state: dict[str, Any]) -> None:
        """Rebuild the tree from the saved leaves: its inner nodes are derived, never trusted."""
        self.scores.clear()
        self.scores.set(torch.arange(self.capacity), self._leaves(state["scores"]).clone())

    def _leaves(self, tree: torch.Tensor) -> torch.Tensor:
        first = _C.tree_leaf_offset(tree.numel())
        return tree[first : first + self.capacity]
