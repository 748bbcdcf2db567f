"""TopKSampler: the rows with the highest score (GEAR's top-k selection).

Scores come from a key of the stored data (read once, when the rows are
written) or from ``update_priority``. A max tree keeps them, so a batch costs
O(batch · log N): no scan of the store.
"""
from __future__ import annotations

from typing import Any

import torch
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage

from gear_torchrl._ext import _C
from gear_torchrl.samplers.following import FollowsCommits
from gear_torchrl.samplers.prioritized import _as_index, _as_priority
from gear_torchrl.samplers.state_file import StateDictFile
from gear_torchrl.samplers.trees import ScoreTree
from gear_torchrl.storage import GearStorage
from gear_torchrl.store.spec import NestedKey, as_path
from gear_torchrl.store.state_checks import CheckpointError, checked_tensor, field, require_nothing_past


class TopKSampler(FollowsCommits, StateDictFile, Sampler):
    """Each batch is the ``batch_size`` highest-scoring rows, best first.

    Rows committed by TrajectoryWriters (in this process or, over a shared
    storage, in others) are scored as they are seen, and overwritten or evicted
    rows leave the ranking. Over a ShardedGearStorage each owner ranks its own
    rows and a batch is the best of all owners' best.

    Args:
        max_capacity: rows of the storage it samples.
        key: a scalar-per-row key of the data whose value is the score (e.g.
            ``("next", "reward")``); None to score rows with ``update_priority``
            (new rows then score ``default_score``).
    """

    def __init__(self, max_capacity: int, key: NestedKey | None = None, default_score: float = 0.0) -> None:
        self.max_capacity = max_capacity
        self.key = key
        self.default_score = default_score
        self._scores = ScoreTree(max_capacity)

    def mark_update(self, index: Any, *, storage: Storage | None = None) -> None:
        index = _as_index(index, self.max_capacity)
        index = index[index >= 0]
        if self.key is None:
            score = torch.full((index.numel(),), self.default_score, dtype=torch.float64)
        else:
            score = self._scores_from(storage, index)
        self._scores.set(index, score)

    def _scores_from(self, storage: Storage | None, index: torch.Tensor) -> torch.Tensor:
        if not isinstance(storage, GearStorage):
            raise TypeError(f"TopKSampler(key=...) reads scores from a GearStorage, got {type(storage).__name__}")
        column = storage.shard.column(self.key)
        if column is None:
            raise KeyError(f"TopKSampler: the data has no key {self.key!r}")
        values = column.index_select(0, index.to(column.device)).reshape(index.numel(), -1)
        if values.shape[1] != 1:
            raise ValueError(f"TopKSampler: key {self.key!r} holds {values.shape[1]} values per row, not one")
        return values[:, 0].double().cpu()

    def update_priority(self, index: Any, priority: Any, *, storage: Storage | None = None) -> None:
        if self.key is not None:
            raise RuntimeError(f"TopKSampler scores rows by {self.key!r}; update_priority does not apply")
        if getattr(storage, "is_sharded", False):  # the owners keep their rows' scores
            storage.update_priority(self.selection(), index, priority)
            return
        index = _as_index(index, self.max_capacity)
        priority = _as_priority(priority, index.numel())
        keep = index >= 0
        self._scores.set(index[keep], priority[keep])

    def forget(self, rows: torch.Tensor) -> None:
        """Rows leave the ranking until they are written again (evicted, or capped by MaxTimesSampled)."""
        self._scores.remove(rows)

    exclude = forget

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        if getattr(storage, "is_sharded", False):  # every owner's best rows, merged
            return storage.select_top(self.selection(), batch_size), {}
        return FollowsCommits.sample(self, storage, batch_size)

    def selection(self) -> dict[str, Any]:
        """What a shard owner needs to rank its rows."""
        key = None if self.key is None else list(as_path(self.key))
        return {"kind": "topk", "key": key, "default_score": self.default_score}

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (at most) ``k`` best rows, best first, and their scores."""
        index = self._scores.top(k)
        return index, self._scores.get(index)

    def _pick(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        if len(storage) == 0:
            raise RuntimeError("cannot sample from an empty storage: write some data first")
        index = self._scores.top(batch_size)
        if index.numel() < batch_size:
            raise RuntimeError(f"TopKSampler: asked for the top {batch_size} rows, only {index.numel()} are stored")
        return index, {}

    def _empty(self) -> None:
        self._scores.clear()
        self._followed = (0, 0)

    def state_dict(self) -> dict[str, Any]:
        return {"scores": self._scores.max.clone()}

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        """``state`` checked: a tree of this capacity, no NaN, no scored row past the ``rows`` restored."""
        scores = checked_tensor(field(state, "scores", "the saved TopKSampler state"), "scores", torch.float64,
                                tuple(self._scores.max.shape))
        if bool(scores.isnan().any()):
            at = int(scores.isnan().nonzero()[0, 0])
            raise CheckpointError(f"scores hold NaN at entry {at}: the state is damaged")
        leaves = self._leaves(scores)
        require_nothing_past(leaves > float("-inf"), rows, "scores")
        return {"scores": scores}

    def _assign(self, state: dict[str, Any]) -> None:
        """Rebuild the tree from the saved leaves: its inner nodes are derived, never trusted."""
        self._scores.clear()
        self._scores.set(torch.arange(self.max_capacity), self._leaves(state["scores"]).clone())

    def _leaves(self, tree: torch.Tensor) -> torch.Tensor:
        first = _C.tree_leaf_offset(tree.numel())
        return tree[first: first + self.max_capacity]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r})"
