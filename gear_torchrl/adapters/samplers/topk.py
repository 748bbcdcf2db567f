"""TopKSampler: the rows with the highest score (``selection/topk.py``) for TorchRL."""

from __future__ import annotations

from typing import Any

import torch
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage

from gear_torchrl.adapters.samplers.selecting import SavesCoreState, select
from gear_torchrl.adapters.samplers.staleness import BoundsStaleness
from gear_torchrl.selection.picked import SelectionIndex
from gear_torchrl.selection.state_file import StateDictFile
from gear_torchrl.selection.topk import TopKSelector, TopKSpec
from gear_torchrl.store.policy_versions import POLICY_VERSION
from gear_torchrl.store.table_spec import NestedKey, optional_path


class TopKSampler(BoundsStaleness, SavesCoreState, StateDictFile, Sampler):
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
        max_staleness, version_key: the best rows among those at most ``max_staleness`` policy versions
            older than ``consumer_version`` (``adapters/samplers/staleness.py``; -1: no bound).
    """

    selector: TopKSelector

    def __init__(
        self,
        max_capacity: int,
        key: NestedKey | None = None,
        default_score: float = 0.0,
        *,
        max_staleness: int = -1,
        version_key: NestedKey = POLICY_VERSION,
    ) -> None:
        self.max_capacity = max_capacity
        self.key = key
        self.default_score = default_score
        self.selector = TopKSelector(TopKSpec(optional_path(key), float(default_score)), max_capacity)
        self._bound_staleness(max_staleness, version_key, max_capacity)

    def state_dict(self) -> dict[str, Any]:
        return self._with_bound(SavesCoreState.state_dict(self))

    def checked_state_dict(self, state: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
        return self._checked_bound(state, SavesCoreState.checked_state_dict(self, state, rows))

    def _assign(self, state: dict[str, Any]) -> None:
        SavesCoreState._assign(self, state)
        self._assign_bound(state)

    @property
    def selector_capacity(self) -> int:
        return self.max_capacity

    @property
    def _scores(self):
        return self.selector.scores

    def sample(self, storage: Storage, batch_size: int) -> tuple[SelectionIndex, dict]:
        picked = select(storage, self.rule, batch_size, self._rng)
        return picked.index, self.staleness_info(picked)

    def update_priority(self, index: Any, priority: Any, *, storage: Storage | None = None) -> None:
        self._update(storage, index, priority)

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (at most) ``k`` best rows, best first, and their scores."""
        index = self.selector.scores.top(k)
        return index, self.selector.scores.get(index)

    def forget(self, rows: torch.Tensor) -> None:
        """Rows leave the ranking until they are written again (evicted, or capped by MaxTimesSampled)."""
        self.selector.forget(rows)

    exclude = forget

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r})"
