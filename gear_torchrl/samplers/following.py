"""Samplers with per-row state, kept current over a shared store.

TorchRL's writer tells the sampler about every write it makes
(``mark_update``). TrajectoryWriters commit behind it: in this process into a
local storage, in any process into a shared one, where a ring block can also
be evicted for them. Before each pick, the sampler catches up with what the
store says those commits changed since it last looked.
"""
from __future__ import annotations

import torch
from torchrl.data.replay_buffers.storages import Storage


class FollowsCommits:
    """Mixin: ``sample`` catches up with other processes' commits, then calls ``_pick``.

    A subclass gives ``mark_update(rows, storage=...)`` (new rows), ``forget(rows)``
    (evicted rows: never serve them again) and ``_pick(storage, batch_size)``.
    """

    _followed: tuple[int, int] = (0, 0)  # how far into the store's commits this sampler has looked

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        shard = getattr(storage, "shard", None)
        if shard is None:
            return self._pick(storage, batch_size)
        with shard.picking():  # a shared store catches up with other processes' commits here
            self.follow(storage)
            return self._pick(storage, batch_size)

    def follow(self, storage: Storage) -> None:
        """Take in the rows committed and evicted since the last look (call inside ``storage.shard.picking()``)."""
        gone, new, self._followed = storage.shard.rows_changed_since(self._followed)
        if gone.numel():
            self.forget(gone)
        if new.numel():
            self.mark_update(new, storage=storage)

    def forget(self, rows: torch.Tensor) -> None:
        raise NotImplementedError

    def _pick(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError
