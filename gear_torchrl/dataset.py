"""GearDataset: a replay buffer as an endless ``IterableDataset`` of sampled batches.

With ``DataLoader(num_workers=k)`` each worker has its own copy of the
buffer; over a shared GearStorage that copy attaches to the same rows, and
over a ShardedGearStorage it opens its own connections to the shards, so
every worker samples everything written so far, by any process, with the
seed the DataLoader gave it. ``prefetch`` overlaps sampling (for a sharded
store: the transfer) of the next batches with the training step.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset


class GearDataset(IterableDataset):
    """Batches ``replay_buffer.sample(batch_size)``, forever or ``num_batches`` per worker.

    ``dataset.loader(num_workers=k, ...)`` gives the ``DataLoader`` to use: batching
    is the sampler's job, so the loader must neither batch nor convert again.
    """

    def __init__(self, replay_buffer: Any, batch_size: int | None = None, num_batches: int | None = None,
                 prefetch: int = 0) -> None:
        if batch_size is None and getattr(replay_buffer, "_batch_size", None) is None:
            raise ValueError("give batch_size, or build the replay buffer with one")
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.prefetch = prefetch
        self.replay_buffer = replay_buffer
        self.batch_size = batch_size
        self.num_batches = num_batches

    def loader(self, **kwargs: Any) -> DataLoader:
        """A ``DataLoader`` over this dataset that hands the sampled TensorDicts through as they are."""
        return DataLoader(self, batch_size=None, collate_fn=as_is, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        return self._ahead() if self.prefetch else self._batches()

    def _batches(self) -> Iterator[Any]:
        produced = 0
        while self.num_batches is None or produced < self.num_batches:
            yield self.replay_buffer.sample(self.batch_size)
            produced += 1

    def _ahead(self) -> Iterator[Any]:
        """``_batches`` run by a thread up to ``prefetch`` batches ahead of the consumer."""
        ready: queue.Queue = queue.Queue(self.prefetch)
        stop = threading.Event()

        def put(item: tuple[Any, BaseException | None]) -> bool:
            while not stop.is_set():  # the consumer may have stopped listening
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for batch in self._batches():
                    if not put((batch, None)):
                        return
                put((_END, None))
            except BaseException as exc:  # the consumer re-raises it
                put((_END, exc))

        thread = threading.Thread(target=produce, name="gear-dataset-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                batch, error = ready.get()
                if error is not None:
                    raise error
                if batch is _END:
                    return
                yield batch
        finally:
            stop.set()
            thread.join(timeout=10)


_END = object()


def as_is(batch: Any) -> Any:
    """The loader's collate: a sampled batch is already a batch."""
    return batch
