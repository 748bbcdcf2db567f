"""QueueSampler: FIFO or LIFO, each written row sampled once (``selection/queue.py``) for TorchRL."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage

from gear_torchrl.adapters.samplers.selecting import SavesCoreState, select
from gear_torchrl.selection.picked import SelectionIndex
from gear_torchrl.selection.queue import QueueSelector, QueueSpec
from gear_torchrl.selection.state_file import StateDictFile


class QueueSampler(SavesCoreState, StateDictFile, Sampler):
    """Consume rows in write order (``"fifo"``) or newest first (``"lifo"``).

    Rows committed by TrajectoryWriters (in this process or, over a shared
    storage, in others) join the queue in commit order, and rows overwritten or
    evicted before they were consumed leave it. Over a ShardedGearStorage each
    owner keeps the queue of its shard (shared by every learner) and a batch is
    split by the rows waiting in each.
    """

    selector: QueueSelector

    def __init__(self, max_capacity: int, order: Literal["fifo", "lifo"] = "fifo") -> None:
        self.max_capacity = max_capacity
        self.order = order
        self.selector = QueueSelector(QueueSpec(order), max_capacity)

    @property
    def selector_capacity(self) -> int:
        return self.max_capacity

    def sample(self, storage: Storage, batch_size: int) -> tuple[SelectionIndex, dict]:
        return select(storage, self.selector, batch_size, self._rng).index, {}

    def take(self, batch_size: int) -> torch.Tensor:
        """Consume ``batch_size`` (at most ``len(self)``) rows from the queue's end."""
        return self.selector.take(batch_size)

    def give_back(self, rows: torch.Tensor) -> None:
        """Rows ``take`` returned that were not used: they are served first again."""
        self.selector.give_back(rows)

    def forget(self, rows: torch.Tensor) -> None:
        self.selector.forget(rows)

    def __len__(self) -> int:
        """Rows written and not consumed yet."""
        return len(self.selector)

    @property
    def ran_out(self) -> bool:
        return len(self.selector) == 0

    @ran_out.setter
    def ran_out(self, value: bool) -> None:
        """TorchRL's buffers reset this flag; the queue's content decides it."""

    def update_priority(self, *args: Any, **kwargs: Any) -> None:
        """Queues have no priorities."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(order={self.order!r}, waiting={len(self)})"
