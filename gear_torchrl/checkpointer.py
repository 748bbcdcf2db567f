"""TorchRL checkpointer for GearStorage: ``rb.dumps(path)`` / ``rb.loads(path)`` restore it exactly."""
from __future__ import annotations

from pathlib import Path

from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase

from gear_torchrl.store.persistence import load_shard, save_shard


class GearStorageCheckpointer(StorageCheckpointerBase):
    """Saves data, episode index and cursor as raw column files (no 2 GiB limit)."""

    def dumps(self, storage, path: str | Path) -> None:
        for hook in self._save_hooks:
            hook(storage, path)
        save_shard(storage._shard, path)

    def loads(self, storage, path: str | Path) -> None:
        load_shard(storage._shard, path)
        storage._sync_cursor_from_shard()
        for hook in self._load_hooks:
            hook(storage, path)
