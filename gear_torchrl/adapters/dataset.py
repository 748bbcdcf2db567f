"""GearDataset: a replay buffer as an endless ``IterableDataset`` of sampled batches.

With ``DataLoader(num_workers=k)`` each worker has its own copy of the
buffer; over a shared GearStorage that copy attaches to the same rows, and
over a ShardedGearStorage it opens its own connections to the shards, so
every worker samples everything written so far, by any process, with the
seed the DataLoader gave it. ``prefetch`` overlaps sampling (for a sharded
store: the transfer) of the next batches with the training step.

``loader()`` workers hand their batches over through shared-memory slots
(``dataset_slots``) rather than pickled tensors, and are forked (where that is
safe, else from a forkserver) rather than spawned: a spawned worker imports
torch and torchrl again before its first batch (spawn is TorchRL's default).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gear_torchrl.adapters.dataset_slots import SlotPlan, SlotReader, SlotWriter, batch_of, new_plan


class GearDataset(IterableDataset):
    """Batches ``replay_buffer.sample(batch_size)``, forever or ``num_batches`` per worker.

    ``dataset.loader(num_workers=k, ...)`` gives the ``DataLoader`` to use: batching
    is the sampler's job, so the loader must neither batch nor convert again.
    """

    def __init__(
        self, replay_buffer: Any, batch_size: int | None = None, num_batches: int | None = None, prefetch: int = 0
    ) -> None:
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
        self._slot_plan: SlotPlan | None = None  # set by GearLoader before its workers start
        self._seeded_in: int | None = None  # the worker process whose copy of the buffer was reseeded

    def loader(self, *, batch_slots: int | None = None, **kwargs: Any) -> GearLoader:
        """A ``DataLoader`` over this dataset that hands the sampled batches through as they are.

        With workers, each hands its batches over through ``batch_slots`` shared-memory slots
        (default: ``prefetch_factor + 1``, enough that a worker never waits while the loader
        has room for its batches; 0: pickle them through the queue, as a plain DataLoader
        does). Without ``multiprocessing_context``, workers are forked where that is safe,
        else forked from a forkserver (see :func:`worker_context`).
        """
        if kwargs.get("num_workers", 0) and "multiprocessing_context" not in kwargs:
            kwargs["multiprocessing_context"] = worker_context()
        if batch_slots is None:
            batch_slots = (kwargs.get("prefetch_factor") or 2) + 1
        if batch_slots < 0:
            raise ValueError(f"batch_slots must be >= 0, got {batch_slots}")
        return GearLoader(self, batch_slots=batch_slots, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        stream = self._ahead() if self.prefetch else self._batches()
        worker = get_worker_info()
        if worker is None:
            return stream
        if self._seeded_in != os.getpid():  # once per worker: persistent workers go on drawing
            _reseed_copy(self.replay_buffer, worker.seed)
            self._seeded_in = os.getpid()
        if self._slot_plan is None:
            return stream
        return self._through_slots(stream, SlotWriter(self._slot_plan, worker.id))

    @staticmethod
    def _through_slots(stream: Iterator[Any], writer: SlotWriter) -> Iterator[Any]:
        for batch in stream:
            yield writer.ticket(batch)

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
            except BaseException as exc:  # noqa: BLE001  (the consumer re-raises it)
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


class GearLoader(DataLoader):
    """A ``DataLoader`` over a :class:`GearDataset` (from ``GearDataset.loader``).

    It neither batches nor collates (the sampler made the batch). Its workers
    copy each batch into a shared-memory slot and send only the slot's ticket;
    iterating turns tickets back into batches, each a copy the consumer owns.
    """

    dataset: GearDataset

    def __init__(self, dataset: GearDataset, *, batch_slots: int, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=None, collate_fn=as_is, **kwargs)
        self.batch_slots = batch_slots
        self._plan: SlotPlan | None = None
        self._readers: list[SlotReader] = []

    @property
    def batches_from_slots(self) -> int:
        """Batches copied out of a worker's slot (not pickled) since this loader was made."""
        return sum(reader.through_slots for reader in self._readers)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # with slots: a generator, not DataLoader's iterator
        if self.num_workers == 0 or self.batch_slots == 0:
            self.dataset._slot_plan = None
            return super().__iter__()
        return self._from_slots()

    def _from_slots(self) -> Iterator[Any]:
        if self._plan is None or not self.persistent_workers:  # persistent workers keep their semaphores
            context = self.multiprocessing_context or multiprocessing.get_context()
            self._plan = new_plan(context, self.num_workers, self.batch_slots)
            self.dataset._slot_plan = self._plan
        reader = SlotReader(self._plan)
        self._readers.append(reader)
        try:
            items = super().__iter__()  # starts the workers, which take the plan with them
            self.dataset._slot_plan = None  # a plain DataLoader over this dataset later must get batches
            for item in items:
                yield batch_of(item)
        finally:
            reader.close()


def worker_context() -> multiprocessing.context.BaseContext | None:
    """How ``loader()`` starts workers when not told: ``fork`` where safe, else ``forkserver``.

    A spawned worker (TorchRL makes spawn the default) imports torch, torchrl and
    gear_torchrl again before its first batch: about 4 s of CPU each on the CI
    machine, all at once. A forked one starts in milliseconds, but forking is unsafe
    with a CUDA context or another thread in this process (the child would inherit
    locks no thread will release). A forkserver imports those modules once, in a
    clean process of its own, and forks every later worker from it.
    """
    methods = multiprocessing.get_all_start_methods()
    if sys.platform != "linux" or "fork" not in methods:
        return None
    if not torch.cuda.is_initialized() and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    if "forkserver" not in methods:
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # no effect once this process's forkserver runs
    return context


_PRELOAD = [
    "torch",
    "tensordict",
    "torchrl.data",
    "gear_torchrl.adapters.storage",
    "gear_torchrl.adapters.samplers",
    "gear_torchrl.adapters.dataset",
]


def _reseed_copy(replay_buffer: Any, seed: int) -> None:
    """A worker's copy of a buffer seeded with ``rb.set_rng`` would draw what every other worker draws:
    seed it from the worker's seed (the DataLoader gives each worker its own)."""
    rng = getattr(replay_buffer, "_rng", None)
    if isinstance(rng, torch.Generator) and hasattr(replay_buffer, "set_rng"):
        fresh = torch.Generator(device=rng.device)
        fresh.manual_seed(seed)
        replay_buffer.set_rng(fresh)


_END = object()


def as_is(batch: Any) -> Any:
    """The loader's collate: a sampled batch is already a batch."""
    return batch
