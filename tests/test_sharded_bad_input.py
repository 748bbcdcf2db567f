"""Bad input to a sharded store gets a clear error and changes nothing (one rank owning one shard)."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import one_rank_sharded_store
from tensordict import TensorDict
from torchrl.data import ReplayBuffer, TensorDictReplayBuffer

from gear_torchrl import (
    EmptyStoreError,
    GearPrioritizedSampler,
    GearSequenceSampler,
    QueueSampler,
    ShardedGearStorage,
    TrajectoryWriter,
)
from gear_torchrl.distributed import global_ids


@pytest.fixture(scope="module")
def storage():
    with one_rank_sharded_store(100) as store:
        yield store


def _steps(n: int) -> TensorDict:
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict({"obs": torch.arange(n, dtype=torch.float32), ("next", "done"): done}, [n])


def test_sampling_an_empty_sharded_store_says_so(storage):
    with pytest.raises(RuntimeError, match="empty"):  # TorchRL's RandomSampler asks len() first
        TensorDictReplayBuffer(storage=storage, batch_size=4).sample()
    with pytest.raises(EmptyStoreError, match="nothing to sample in any of the 1 live shards"):
        TensorDictReplayBuffer(storage=storage, sampler=GearSequenceSampler(2), batch_size=4).sample()


def test_bad_options_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="transport"):
        ShardedGearStorage(10, transport="carrier-pigeon")  # type: ignore[arg-type]  # bad input: no such transport
    with pytest.raises(ValueError, match="on_shard_failure"):
        ShardedGearStorage(10, on_shard_failure="ignore")  # type: ignore[arg-type]  # bad input: no such policy


def test_an_owner_extends_its_own_shard_and_a_copy_sends_its_rows_to_the_owner(storage):
    before = len(storage.local)
    ReplayBuffer(storage=storage).extend(_steps(5))
    assert len(storage.local) == before + 5
    reader = pickle.loads(pickle.dumps(storage))  # a copy holds no shard (as a DataLoader worker's)
    assert not reader.episode_sink().through_shared_memory(0)  # transport="tcp": an INSERT to the owner
    ReplayBuffer(storage=reader).extend(_steps(3))
    assert len(storage.local) == before + 8
    with pytest.raises(NotImplementedError, match="appends only"):
        reader.set(0, _steps(1)[0], set_cursor=False)
    reader.close()


def test_bad_row_ids_and_priorities_leave_the_owner_unchanged(storage):
    first = len(storage.local)  # earlier tests may have written: these rows follow theirs in the ring
    writer = TrajectoryWriter(storage.local)
    writer.extend(_steps(10))
    writer.end_episode()
    sampler = GearPrioritizedSampler(100, alpha=1.0, beta=0.5)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=8)
    rb.sample()  # the owner starts keeping these priorities
    ids = global_ids.encode(0, torch.arange(first, first + 10))
    rb.update_priority(ids, torch.arange(1.0, 11.0))
    with pytest.raises(ValueError, match="not a global row id"):
        rb.update_priority(torch.tensor([3]), torch.tensor([5.0]))
    with pytest.raises(ValueError, match="finite and non-negative"):
        rb.update_priority(ids[:2], torch.tensor([1.0, float("nan")]))
    with pytest.raises(IndexError, match="out of range"):
        rb.update_priority(global_ids.encode(0, torch.tensor([500])), torch.tensor([1.0]))
    with pytest.raises(IndexError, match="names shard 5"):
        storage.get(global_ids.encode(5, torch.tensor([0])))
    rb.sample()  # updates are posted: the owner has applied them when it answers the connection's next request
    owner = next(sel for spec, sel, _ in storage._membership.server.selectors.shared() if spec.kind == "priorities")
    expected = torch.arange(1.0, 11.0, dtype=torch.float64) + 1e-8  # alpha 1, eps 1e-8
    assert torch.allclose(owner.masses(torch.arange(first, first + 10)), expected)
    rows = storage.get(ids[[2, 7]])  # reads by id still work, in the order asked
    assert rows["obs"].tolist() == [2.0, 7.0]


def test_a_queue_batch_the_shards_cannot_fill_takes_nothing(storage):
    rb = TensorDictReplayBuffer(storage=storage, sampler=QueueSampler(100))
    waiting = len(storage.local)  # every row written so far waits in the owner's queue
    with pytest.raises(EmptyStoreError, match=f"found {waiting} of {waiting + 1}"):
        rb.sample(waiting + 1)
    served = rb.sample(waiting)["index"]  # all of them went back
    assert torch.equal(served.sort().values, global_ids.encode(0, torch.arange(waiting)))


def test_give_back_returns_every_round_of_a_shards_picks(monkeypatch):
    """A shard that picked in several rounds of one batch gets all of them back, in order."""
    from gear_torchrl.distributed.shard_client import Ask
    from gear_torchrl.distributed.shard_links import ShardLinks
    from gear_torchrl.distributed.shard_owners import ShardOwners
    from gear_torchrl.selection.picked import Picked
    from gear_torchrl.selection.queue import QueueSpec

    links = ShardLinks([], b"", "tcp", 1.0, False, "skip")  # no descriptors: only what give_back touches
    links.fan_out.failed[2] = "gone"
    given: dict[int, list[int]] = {}

    class Client:
        def __init__(self, shard: int) -> None:
            self.shard = shard

        def give_back(self, selection, rows) -> None:
            given.setdefault(self.shard, []).extend(rows.tolist())

    monkeypatch.setattr(links, "client", Client)
    spec = QueueSpec("fifo")
    ask = Ask(spec, 0, None)
    got = [
        (0, Picked.row_picks(torch.tensor([1, 2]), 0.0), ask),
        (1, Picked.row_picks(torch.tensor([5]), 0.0), ask),
        (2, Picked.row_picks(torch.tensor([7]), 0.0), ask),
        (0, Picked.row_picks(torch.tensor([3]), 0.0), ask),
    ]
    ShardOwners(links).give_back(spec, got)
    assert given == {0: [1, 2, 3], 1: [5]}  # the failed shard is not asked


def test_an_operator_secret_comes_from_the_environment_or_a_file_and_is_long_enough(tmp_path, monkeypatch):
    from gear_torchrl.distributed.secret import SECRET_ENV, SECRET_FILE_ENV, operator_secret

    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    assert operator_secret() is None  # rank 0 draws one
    monkeypatch.setenv(SECRET_ENV, "x" * 16)
    assert operator_secret() == b"x" * 16
    path = tmp_path / "secret"
    path.write_text("y" * 64 + "\n")
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    with pytest.raises(ValueError, match="not both"):
        operator_secret()
    monkeypatch.delenv(SECRET_ENV)
    assert operator_secret() == b"y" * 64  # the file's line, without its newline
    path.write_text("too short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        operator_secret()
