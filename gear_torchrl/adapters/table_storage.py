"""The TorchRL storages gear samplers draw through: each holds a :class:`Table` (``selection/table.py``)."""

from __future__ import annotations

from torchrl.data.replay_buffers.storages import TensorStorage

from gear_torchrl.adapters.rate_gate import RateLimitedStorage
from gear_torchrl.selection.table import Table


class TableStorage(RateLimitedStorage, TensorStorage):
    """A TorchRL ``TensorStorage`` whose rows a :class:`Table` selects from, draws gated by its rate limiter.

    ``GearStorage`` holds a ``ShardTable`` (one shard: local or shared, ``ndim`` 1 or 2),
    ``ShardedGearStorage`` a ``ShardedTable``; samplers call ``storage.table``.
    """

    table: Table
