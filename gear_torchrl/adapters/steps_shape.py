"""A ``GearStorage``'s size and shape as TorchRL's storages report them (``ndim=1``: ``[rows]``)."""

from __future__ import annotations

from typing import Any

import torch
from torchrl.data.replay_buffers.storages import TensorStorage

from gear_torchrl.store.shard import Shard


class StepsShape(TensorStorage):
    """Size, shape and membership of a storage of ``max_size`` steps over ``_shard`` (``EnvColumnsStorage``
    reports ``[T, num_envs]`` instead). A shared store numbers its live rows oldest first: it never wraps."""

    _shard: Shard
    shared: bool

    @property
    def initialized(self) -> bool:  # type: ignore[override]  # TorchRL sets it; here the shard knows
        return self._shard.table is not None

    @property
    def _len(self) -> int:
        return self._shard.readable_rows()

    @_len.setter
    def _len(self, value: int) -> None:
        self._shard.set_size(int(value))

    def __len__(self) -> int:
        return self._shard.readable_rows()

    @property
    def _total_shape(self) -> torch.Size | None:  # None: not laid out yet (an ndim=2 store before its first write)
        return torch.Size([self.max_size])

    @property
    def _len_along_dim0(self) -> int:
        return self._shard.readable_rows()

    def _max_size_along_dim0(self, *, single_data=None, batched_data=None) -> int:
        return self.max_size

    @property
    def shape(self) -> torch.Size | None:  # None: not laid out yet (an ndim=2 store before its first write)
        return torch.Size([self._shard.readable_rows()])

    @property
    def _is_full(self) -> bool:
        # A shared store's indices number its live rows oldest first: they never wrap.
        return not self.shared and self._shard.size == self.max_size

    def flatten(self) -> TensorStorage:
        return self

    def contains(self, item: Any) -> bool | torch.Tensor:
        size = self._shard.size
        if isinstance(item, int):
            return -size <= item < size
        if isinstance(item, torch.Tensor):
            return (item >= -size) & (item < size)
        raise NotImplementedError(f"contains() does not take {type(item).__name__}")
