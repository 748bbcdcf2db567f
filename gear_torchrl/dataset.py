"""GearDataset: a replay buffer as an endless ``IterableDataset`` of sampled batches.

With ``DataLoader(num_workers=k)`` each worker unpickles its own copy of the
buffer; over a shared GearStorage that copy attaches to the same rows, so
every worker samples everything written so far, by any process, with the
seed the DataLoader gave it.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset


class GearDataset(IterableDataset):
    """Batches ``replay_buffer.sample(batch_size)``, forever or ``num_batches`` per worker.

    ``dataset.loader(num_workers=k, ...)`` gives the ``DataLoader`` to use: batching
    is the sampler's job, so the loader must neither batch nor convert again.
    """

    def __init__(self, replay_buffer: Any, batch_size: int | None = None, num_batches: int | None = None) -> None:
        if batch_size is None and getattr(replay_buffer, "_batch_size", None) is None:
            raise ValueError("give batch_size, or build the replay buffer with one")
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches}")
        self.replay_buffer = replay_buffer
        self.batch_size = batch_size
        self.num_batches = num_batches

    def loader(self, **kwargs: Any) -> DataLoader:
        """A ``DataLoader`` over this dataset that hands the sampled TensorDicts through as they are."""
        return DataLoader(self, batch_size=None, collate_fn=as_is, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        produced = 0
        while self.num_batches is None or produced < self.num_batches:
            yield self.replay_buffer.sample(self.batch_size)
            produced += 1


def as_is(batch: Any) -> Any:
    """The loader's collate: a sampled batch is already a batch."""
    return batch
