"""A shared store takes new keys as a local one does, across processes (spawn), and TorchRL's collectors
that bring them (the asynchronous SAC recipe: a learner's first rollout, then a collector process whose
batches carry the policy's outputs and trajectory ids)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import time

import pytest
import shared_workers as w
import torch
from helpers import descriptor_of
from tensordict.nn import TensorDictModule
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import GearStorage, SpecMismatchError, TrajectoryWriter
from gear_torchrl.store.shared_memory import store_segments

pytestmark = [pytest.mark.usefixtures("no_shm_leaks"), pytest.mark.processes]
CTX = mp.get_context("spawn")
JOIN_S = 120


def _join(process, code: int = 0) -> None:
    process.join(JOIN_S)
    assert process.exitcode == code, f"{process.name} exited with {process.exitcode}"


def test_a_key_another_process_adds_is_read_by_every_process_and_earlier_rows_read_zeros():
    storage = GearStorage(100, shared=True)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=200)
    ready, go, results = CTX.Event(), CTX.Event(), CTX.Queue()
    try:
        rb.extend(w.keyed_rows(5, 0))
        reader = CTX.Process(target=w.read_after_growth, args=(storage, ready, go, results))
        reader.start()
        assert ready.wait(JOIN_S)
        actor = CTX.Process(target=w.extend_with_keys, args=(storage, 3, 5, {"v": 2.5}))
        actor.start()
        _join(actor)
        go.set()
        keys, obs, v = results.get(timeout=JOIN_S)
        _join(reader)
        assert "v" in keys
        assert all((value == 2.5) == (o >= 5) for o, value in zip(obs, v)), "a row read another row's new key"
        assert {o for o in obs} == set(range(8))
        rows = rb[:]  # the owner, which mapped the first layout only, maps the new column too
        assert rows["obs"].tolist() == list(range(8))
        assert rows["v"].tolist() == [0.0] * 5 + [2.5] * 3
        rb.extend(w.keyed_rows(2, 8, v=4.0))  # the owner writes the grown layout as any other
        assert rb[:]["v"].tolist()[-2:] == [4.0, 4.0]
        assert len(store_segments(storage.handle.store_id)) == 4  # control, rates, data, data1
    finally:
        storage.close()


def test_a_write_checked_before_another_process_added_a_key_reads_zeros_there_even_after_a_lap():
    storage = GearStorage(8, shared=True)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    actor_side = GearStorage(0, handle=storage.handle)  # another attachment, as an actor process holds
    try:
        rb.extend(w.keyed_rows(4, 0))
        writer = TrajectoryWriter(actor_side)
        writer.extend(w.keyed_rows(3, 100))  # checked against the layout without "v"
        rb.extend(w.keyed_rows(8, 10, v=7.0))  # adds "v" and laps the ring: every row holds 7 there
        writer.end_episode()
        rows = rb[:]
        assert rows["obs"].tolist()[-3:] == [100.0, 101.0, 102.0]
        assert rows["v"].tolist()[-3:] == [0.0, 0.0, 0.0], "the actor's rows kept an older lap's values"
        assert len(rows) >= 7 and rows["v"].tolist()[:-3] == [7.0] * (len(rows) - 3)
    finally:
        actor_side.close()
        storage.close()


def test_a_wrapped_shared_store_holds_at_least_all_but_a_block_and_counts_every_write():
    storage = GearStorage(640, shared=True)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4, shared=True)
    try:
        for first in range(0, 2_000, 100):
            rb.extend(w.keyed_rows(100, first))
            assert len(rb) <= 640
        assert 640 - 640 // 64 <= len(rb) <= 640  # README: the difference from LazyTensorStorage, bounded
        assert rb.write_count == 2_000 and storage.stats()["inserts"] == 2_000
        assert rb[:]["obs"].tolist() == list(range(2_000 - len(rb), 2_000))  # the newest rows, oldest first
    finally:
        storage.close()


def test_a_write_without_a_key_the_store_holds_is_refused_and_changes_nothing():
    storage = GearStorage(50, shared=True)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    try:
        rb.extend(w.keyed_rows(4, 0, v=1.0))
        with pytest.raises(SpecMismatchError, match="'v'"):
            rb.extend(w.keyed_rows(2, 4))
        with pytest.raises(SpecMismatchError, match=r"'v' has dtype torch.int64"):
            rb.extend(w.keyed_rows(2, 4, w=1.0).set("v", torch.zeros(2, dtype=torch.int64)))
        assert len(rb) == 4 and rb[:]["obs"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert "w" not in rb[:].keys()  # the refused write's other new key was not laid out either
    finally:
        storage.close()


def test_two_processes_adding_one_key_with_different_dtypes_the_second_is_refused_saying_which():
    storage = GearStorage(50, shared=True)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    actor_side = GearStorage(0, handle=storage.handle)
    try:
        rb.extend(w.keyed_rows(4, 0))
        writer = TrajectoryWriter(actor_side)
        writer.extend(w.keyed_rows(2, 100, v=1.0))  # "v" as float32, checked before the owner adds it
        rb.extend(w.keyed_rows(2, 4).set("v", torch.ones(2, dtype=torch.int64)))
        with pytest.raises(SpecMismatchError, match=r"'v' is stored as torch.int64.*this write holds torch.float32"):
            writer.end_episode()
        assert rb[:]["obs"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert rb[:]["v"].dtype == torch.int64
    finally:
        actor_side.close()
        storage.close()


def test_a_process_dying_while_it_adds_a_key_leaves_the_store_usable():
    storage = GearStorage(50, shared=True)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    try:
        rb.extend(w.keyed_rows(4, 0))
        dying = CTX.Process(target=w.die_adding_a_key, args=(storage,))
        dying.start()
        _join(dying, code=3)
        assert len(rb) == 4 and "v" not in rb[:].keys()
        rb.extend(w.keyed_rows(3, 4, v=5.0))  # lays "v" out again, over what the dead process left
        assert rb[:]["v"].tolist() == [0.0] * 4 + [5.0] * 3
    finally:
        storage.close()


def _sample_until(rb: TensorDictReplayBuffer, rows: int, seconds: float = 90.0) -> list:
    """Sample while a collector fills the store, as a learner does; every batch drawn."""
    batches, start = [], time.monotonic()
    while len(rb) < rows:
        assert time.monotonic() - start < seconds, f"the collector wrote {len(rb)} rows in {seconds} s"
        if len(rb):
            batches.append(rb.sample())
        time.sleep(0.05)
    return batches + [rb.sample()]


@pytest.mark.parametrize("first_rollout", [True, False], ids=["learner-initialises", "collector-initialises"])
def test_an_async_collector_adds_keys_to_a_shared_store_while_a_learner_samples(first_rollout):
    from torchrl.collectors import AsyncCollector

    policy = TensorDictModule(w.LocScalePolicy(), in_keys=["observation"], out_keys=["loc", "scale", "action"])
    rb = TensorDictReplayBuffer(storage=GearStorage(2_000, shared=True), shared=True, batch_size=64)
    make_env = w.mock_env if first_rollout else w.batched_mock_env  # a batched env: no [1, 1] placeholder
    if first_rollout:  # the async SAC script: one rollout lays the storage out, then it is emptied
        rb.extend(w.mock_env().rollout(10))
        rb.empty()
    collector = AsyncCollector(make_env, policy, frames_per_batch=50, total_frames=-1, replay_buffer=rb)
    collector.start()
    try:
        batches = _sample_until(rb, 150)
        assert rb.write_count >= 150 and rb.storage.stats()["inserts"] >= 150  # what README says to wait on
    finally:
        collector.async_shutdown()
        # TorchRL's weight-sync scheme shuts itself down in __del__ by putting to a queue, which hangs if
        # that runs at interpreter exit (no thread can start then): collect it now.
        del collector
        gc.collect()
    try:
        last = batches[-1]
        for key in ("loc", "scale", ("collector", "traj_ids")):
            assert key in last.keys(True, True), f"{key} was not stored"
        for batch in batches:
            if "loc" in batch.keys():
                assert torch.equal(batch["loc"], torch.full_like(batch["loc"], 0.25))
                assert torch.equal(batch["scale"], torch.ones_like(batch["scale"]))
        assert rb.storage.shard.table.find("observation") is not None
    finally:
        rb.storage.close()


def test_a_shard_that_adds_a_key_keeps_serving_learners_that_know_the_older_table():
    from gear_torchrl.distributed.shard_client import ShardClient
    from gear_torchrl.distributed.shard_server import ShardServer
    from gear_torchrl.store.table_spec import TableSpec
    from gear_torchrl.store.windows import Windows

    storage = GearStorage(64, shared=True)
    rb = TensorDictReplayBuffer(storage=storage)
    server = client = None
    try:
        rb.extend(w.keyed_rows(10, 0))
        server = ShardServer(storage.handle, b"s" * 32, host="127.0.0.1", timeout=5.0)
        client = ShardClient(descriptor_of(server.address, storage.handle), b"s" * 32, 5.0)
        learners_table = TableSpec.from_json(client.describe()["spec"])
        rb.extend(w.keyed_rows(10, 10, v=3.0))  # the owner's actors bring a key after the learner looked
        out = [torch.empty(4, *c.row_shape, dtype=c.dtype) for c in learners_table.columns]
        client.read(Windows.of_rows(torch.tensor([0, 5, 12, 19])), out)
        obs = learners_table.find("obs")
        assert obs is not None
        assert out[obs].tolist() == [0.0, 5.0, 12.0, 19.0]
        described = client.describe()
        assert TableSpec.from_json(described["spec"]).find("v") is not None
        assert described["offsets"] is None  # one-sided reads would miss the new segment: refused by the learner
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.close()
        storage.close()
