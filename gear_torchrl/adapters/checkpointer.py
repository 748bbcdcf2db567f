"""TorchRL checkpointer for GearStorage: ``rb.dumps(path)`` / ``rb.loads(path)`` restore it exactly.

TorchRL's ``rb.loads`` restores the storage, then the sampler, then the
writer. So that a damaged checkpoint changes nothing, the storage's ``loads``
checks all of it first: its own files in full, and inside a buffer's
checkpoint what the buffer reads next (a gear sampler's state, TorchRL's
writer and buffer metadata). Only then does it replace the rows.

A save also writes TorchRL's manifests over the same data files, and a load
reads what TorchRL's ``TensorStorageCheckpointer`` saved (``LazyTensorStorage``,
``LazyMemmapStorage``): a buffer moves between the storages through its
checkpoints, both ways (``torchrl_layout.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase

from gear_torchrl.adapters.torchrl_layout import (
    TORCHRL_MANIFEST,
    forget_torchrl_layout,
    read_torchrl_layout,
    torchrl_files_are_current,
    write_torchrl_layout,
)
from gear_torchrl.store.persistence import SHARD_MANIFEST, read_manifest, read_shard, save_shard

_FOLLOWING_JSON = ("buffer_metadata.json", "writer/metadata.json")  # TorchRL reads these after the storage


class GearStorageCheckpointer(StorageCheckpointerBase):
    """Saves data, episode index and cursor as raw column files with checksums (no 2 GiB limit).

    Args:
        torchrl_layout: also give the column files TorchRL's names and manifests, so a
            ``LazyTensorStorage`` or ``LazyMemmapStorage`` buffer loads the checkpoint
            (hard links: no byte is written twice on a full store). Turn it off only
            where a checkpoint is copied file by file (TorchRL's ``Checkpoint`` with
            ``format="archive"`` stores each name's bytes once per name).
    """

    def __init__(self, torchrl_layout: bool = True) -> None:
        super().__init__()
        self.torchrl_layout = torchrl_layout

    def dumps(self, storage: Any, path: str | Path) -> None:
        path = Path(path)
        for hook in self._save_hooks:
            hook(storage, path)
        state = storage._shard.state()
        save_shard(storage._shard, path, state)
        if self.torchrl_layout:
            write_torchrl_layout(path, state)
        else:  # an older TorchRL manifest here must not look newer than these files
            forget_torchrl_layout(path)

    def loads(self, storage: Any, path: str | Path) -> None:
        path = Path(path)
        if torchrl_files_are_current(path, TORCHRL_MANIFEST, SHARD_MANIFEST):
            state = read_torchrl_layout(storage._shard, path)
            restored = state["size"]
        else:
            state = read_shard(storage._shard, path)
            restored = None if state.get("compacted", True) else state["size"]  # (unknown before checksums)
        _check_rest_of_buffer(storage, path, restored)
        storage._shard.load_state(state)
        storage._sync_cursor_from_shard()
        for hook in self._load_hooks:
            hook(storage, path)


def _check_rest_of_buffer(storage: Any, path: Path, rows: int | None) -> None:
    """In a replay buffer's checkpoint (``<root>/storage``), check what ``rb.loads`` restores after the storage.

    ``rows``: how many rows the storage restores, at their ring positions (None
    when they were compacted, from a shared store). Every buffer reading this
    storage that has a gear sampler checks the saved sampler state against itself.
    """
    root = path.parent
    if path.name != "storage" or not (root / "buffer_metadata.json").exists():
        return
    for buffer in storage._attached_entities:
        check = getattr(getattr(buffer, "_sampler", None), "check_checkpoint", None)
        if check is not None:
            check(root / "sampler", rows)
    for name in _FOLLOWING_JSON:
        if (root / name).exists():
            read_manifest(root / name)
