"""GearDataset: the stream a DataLoader iterates, with and without prefetch, in this process or in workers."""

from __future__ import annotations

import gc
import multiprocessing.context
import sys
import threading
from collections.abc import Generator
from typing import Any

import pytest
import torch
from helpers import as_dataset, assert_same_td, make_steps
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import GearDataset, GearStorage


def test_dataset_prefetch_yields_the_same_stream_and_forwards_errors():
    rb = TensorDictReplayBuffer(storage=GearStorage(100), batch_size=8)
    rb.extend(make_steps(50, seed=0))
    torch.manual_seed(0)
    plain = [b["obs"] for b in GearDataset(rb, num_batches=5)]
    torch.manual_seed(0)
    ahead = [b["obs"] for b in GearDataset(rb, num_batches=5, prefetch=2)]
    assert len(ahead) == 5 and all(torch.equal(a, b) for a, b in zip(plain, ahead))
    stream = iter(GearDataset(rb, prefetch=3))  # endless: stopping early must not hang
    assert isinstance(stream, Generator), type(stream)  # (declared an Iterator: closing is a generator's)
    next(stream)
    stream.close()
    empty = TensorDictReplayBuffer(storage=GearStorage(10), batch_size=4)
    with pytest.raises(RuntimeError, match="empty"):
        next(iter(GearDataset(empty, prefetch=1)))


def test_loader_hands_over_pinned_batches_for_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA (torch.cuda.is_available() is False)")
    rb = TensorDictReplayBuffer(storage=GearStorage(100), batch_size=8)
    rb.extend(make_steps(50, seed=0))
    for workers in (0, 1):  # with a worker, the pin thread copies the slot into pinned memory
        loader = GearDataset(rb, num_batches=2, prefetch=1).loader(pin_memory=True, num_workers=workers, timeout=60)
        batches = list(loader)
        assert len(batches) == 2 and all(b["obs"].is_pinned() for b in batches)
        assert all(torch.equal(b["obs"], rb.storage.get(b["index"])["obs"]) for b in batches)
    assert loader.batches_from_slots == 2


# -- DataLoader workers: batches through shared-memory slots ---------------------------------


def _shared_buffer(rows: int = 4_000, batch: int = 256, **kwargs) -> TensorDictReplayBuffer:
    storage = GearStorage(rows, shared=True)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=batch, **kwargs)
    for seed in range(rows // 1_000):
        rb.extend(make_steps(1_000, seed=seed))
    return rb


def _torch_mappings() -> int:
    """Shared-memory mappings of torch's tensors in this process (slot buffers among them)."""
    with open("/proc/self/maps") as maps:
        return sum("/torch_" in line for line in maps)


def test_workers_hand_over_every_batch_intact_through_few_slots(no_shm_leaks):
    rb = _shared_buffer()
    mappings_before = _torch_mappings()
    try:
        loader = GearDataset(rb, prefetch=1).loader(num_workers=2, batch_slots=2, prefetch_factor=1, timeout=60)
        batches = iter(loader)
        received = [next(batches) for _ in range(40)]  # 20 per worker through 2 slots each: slots are freed
        for batch in received:
            assert_same_td(batch, rb.storage.get(batch["index"]))  # every column, every dtype, bit for bit
        assert loader.batches_from_slots == 40  # none took the pickled path
        # The two workers draw their own rows (the DataLoader seeds each), and no batch repeats another.
        assert len({tuple(b["index"].tolist()) for b in received}) == 40
        kept = received[0]["obs"].clone()
        next(batches)
        assert torch.equal(received[0]["obs"], kept)  # a batch is the consumer's copy: later ones leave it be
        del batches, loader
        gc.collect()
        assert _torch_mappings() <= mappings_before  # the workers' slot buffers are unmapped here
    finally:
        rb.storage.close()


def test_workers_of_a_seeded_buffer_draw_different_rows(no_shm_leaks):
    rb = _shared_buffer(generator=torch.Generator().manual_seed(0))
    try:
        batches = iter(GearDataset(rb).loader(num_workers=2, timeout=60))
        first, second = next(batches), next(batches)  # one from each worker
        assert not torch.equal(first["index"], second["index"])  # not one seed copied into both
        del batches
    finally:
        rb.storage.close()


def test_persistent_workers_start_each_pass_with_every_slot_free(no_shm_leaks):
    rb = _shared_buffer()
    try:
        loader = GearDataset(rb, num_batches=30).loader(
            num_workers=2, batch_slots=2, prefetch_factor=1, persistent_workers=True, timeout=60
        )
        for stop_after in (3, 3, 60):  # the first passes stop early: the loader drops their queued tickets
            seen = 0
            for batch in loader:
                assert_same_td(batch, rb.storage.get(batch["index"]))
                seen += 1
                if seen == stop_after:
                    break
        assert seen == 60  # the last pass got every batch of both workers: no slot was lost on the way
        del loader
    finally:
        rb.storage.close()


class ShapeShifter:
    """A stand-in replay buffer whose batches change structure, shape and dtype, with non-tensor leaves."""

    _batch_size = 4

    def __init__(self) -> None:
        self.calls = 0

    def sample(self, batch_size: int | None = None) -> Any:
        self.calls += 1
        n = (batch_size or self._batch_size) + self.calls % 3
        rows = torch.arange(n)
        if self.calls % 2:
            return TensorDict({"x": rows.float(), ("y", "z"): rows.unsqueeze(-1) < 2}, [n])
        return (rows.to(torch.int16), {"n": n, "name": "odd", "w": torch.ones(n, 2, dtype=torch.float64)})


def test_workers_send_batches_whose_layout_changes():
    loader = GearDataset(ShapeShifter(), num_batches=6).loader(num_workers=1, timeout=60)
    for i, batch in enumerate(loader):
        n = 4 + (i + 1) % 3
        if i % 2 == 0:
            assert isinstance(batch, TensorDict) and batch.batch_size == (n,)
            assert torch.equal(batch["x"], torch.arange(n).float())
            assert torch.equal(batch["y", "z"], torch.arange(n).unsqueeze(-1) < 2)
        else:
            rows, info = batch
            assert rows.dtype == torch.int16 and torch.equal(rows, torch.arange(n, dtype=torch.int16))
            assert info["n"] == n and info["name"] == "odd" and torch.equal(info["w"], torch.ones(n, 2).double())
    assert i == 5 and loader.batches_from_slots == 6


def test_a_worker_error_reaches_the_consumer():
    empty = TensorDictReplayBuffer(storage=GearStorage(10), batch_size=4)
    with pytest.raises(RuntimeError, match="empty"):
        next(iter(GearDataset(empty).loader(num_workers=1, timeout=60)))


def test_pickled_batches_remain_available():
    rb = TensorDictReplayBuffer(storage=GearStorage(100), batch_size=8)
    rb.extend(make_steps(50, seed=0))
    loader = GearDataset(rb, num_batches=3).loader(num_workers=1, batch_slots=0, timeout=60)
    batches = list(loader)
    assert len(batches) == 3 and loader.batches_from_slots == 0
    assert all(torch.equal(b["obs"], rb.storage.get(b["index"])["obs"]) for b in batches)


def test_workers_fork_only_where_it_is_safe():
    from gear_torchrl.adapters.dataset import worker_context

    if sys.platform != "linux":
        pytest.skip(f"worker_context chooses fork or forkserver on Linux only (this is {sys.platform})")
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialized in this test process: forking is never chosen here")

    def chosen() -> multiprocessing.context.BaseContext:
        context = worker_context()
        assert context is not None, "Linux starts workers by fork or forkserver"
        return context

    assert chosen().get_start_method() == ("fork" if threading.active_count() == 1 else "forkserver")
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert chosen().get_start_method() == "forkserver"  # a thread may hold a lock the child needs
    finally:
        stop.set()
        thread.join()


def test_the_owner_closes_its_store_while_forked_workers_still_run(no_shm_leaks):
    from gear_torchrl.store.shared_memory import store_segments

    rb = _shared_buffer()
    store_id = rb.storage.shard.visibility.store_id
    batches = iter(GearDataset(rb).loader(num_workers=2, multiprocessing_context="fork", timeout=60))
    next(batches)
    rb.storage.close()  # the workers' copies of the janitor's pipe must not keep it waiting
    assert store_segments(store_id) == []
    del batches


# -- The storage itself as a map-style Dataset (TorchRL's proposal: one get per batch) --------


def test_a_dataloader_over_the_storage_gets_each_batch_in_one_call(monkeypatch):
    from torch.utils.data import DataLoader
    from torchrl.data import LazyTensorStorage

    data = make_steps(100, seed=3)
    ours, theirs = GearStorage(100), LazyTensorStorage(100)
    for storage in (ours, theirs):
        TensorDictReplayBuffer(storage=storage).extend(data)
    calls: list[Any] = []
    get = ours.get

    def counted(index: Any) -> Any:  # count the reads the loader makes
        calls.append(index)
        return get(index)

    monkeypatch.setattr(ours, "get", counted)
    epoch = list(
        DataLoader(
            as_dataset(ours),
            batch_size=16,
            shuffle=True,
            collate_fn=lambda batch: batch,
            generator=torch.Generator().manual_seed(0),
        )
    )
    assert len(calls) == len(epoch) == 7  # one get per batch, not one per row
    rows = torch.cat([batch["info", "step"] for batch in epoch])
    assert sorted(rows.tolist()) == data["info", "step"].tolist()  # an epoch: every row once
    for batch in epoch:
        assert_same_td(batch.exclude("index"), data[batch["info", "step"] - 30_000])
    # TorchRL's own storage, read one row at a time, gives the same batches in the same order.
    same = DataLoader(
        as_dataset(theirs),
        batch_size=16,
        shuffle=True,
        collate_fn=torch.stack,
        generator=torch.Generator().manual_seed(0),
    )
    for mine, reference in zip(epoch, same):
        assert_same_td(mine, reference)


def test_a_plain_dataloader_after_a_loader_gets_batches_not_tickets():
    from torch.utils.data import DataLoader

    from gear_torchrl.adapters.dataset import as_is

    rb = TensorDictReplayBuffer(storage=GearStorage(100), batch_size=8)
    rb.extend(make_steps(50, seed=0))
    dataset = GearDataset(rb, num_batches=2)
    assert len(list(dataset.loader(num_workers=1, timeout=60))) == 2
    plain = list(DataLoader(dataset, batch_size=None, collate_fn=as_is, num_workers=1, timeout=60))
    assert len(plain) == 2 and all(isinstance(b, TensorDict) for b in plain)
