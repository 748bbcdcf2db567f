"""Bad input gets a clear error naming the problem and leaves the storage exactly as it was."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers import make_steps, same_bytes
from tensordict import TensorDict
from torchrl.data import ReplayBuffer, TensorDictReplayBuffer

from gear_torchrl import EmptyStoreError, GearStorage, SpecMismatchError


def snapshot(storage: GearStorage):
    shard = storage.shard
    return (
        copy.deepcopy({k: v for k, v in shard.state().items() if k != "columns"}),
        [c.clone() for c in shard.columns],
        storage._last_cursor_index,
        storage._mutation_revision,
    )


def assert_unchanged(storage: GearStorage, snap) -> None:
    meta, columns, cursor, revision = snap
    now = snapshot(storage)
    assert now[0]["size"] == meta["size"] and now[0]["head"] == meta["head"]
    assert now[0]["spec"] == meta["spec"] and len(now[1]) == len(columns)  # no column added
    for name in ("start", "length", "closed"):
        assert torch.equal(now[0]["episodes"][name], meta["episodes"][name])
    assert now[0]["episodes"]["next_serial"] == meta["episodes"]["next_serial"]
    assert all(same_bytes(a, b) for a, b in zip(now[1], columns))
    assert now[2] == cursor
    assert now[3] == revision


@pytest.fixture
def storage():
    s = GearStorage(50)
    s.set(torch.arange(30), make_steps(30, seed=1))
    return s


def bad_writes():
    good = make_steps(4, seed=2)
    missing = good.exclude("obs")
    new_and_bad = good.clone()  # a new key is a new column, but not when another key is wrong
    new_and_bad["surprise"] = torch.zeros(4)
    new_and_bad["action"] = new_and_bad["action"].int()
    nesting = good.exclude("next")
    nesting["next"] = torch.zeros(4)
    as_string = good.clone()
    as_string["obs"] = "not a tensor"
    wrong_dtype = good.clone()
    wrong_dtype["obs"] = wrong_dtype["obs"].double()
    wrong_shape = good.clone()
    del wrong_shape["obs"]
    wrong_shape["obs"] = torch.zeros(4, 5)
    nested_dtype = good.clone()
    nested_dtype["next", "done"] = nested_dtype["next", "done"].to(torch.uint8)
    return [
        (missing, "an append must carry every stored key: missing ['obs']"),
        (new_and_bad, "key 'action' has dtype torch.int32, the store holds torch.int64"),
        (nesting, "key 'next' is a leaf in this write, but the store holds 'next.obs' below it"),
        (as_string, "key 'obs' holds a NonTensorData; the store holds a tensor there"),
        (wrong_dtype, "key 'obs' has dtype torch.float64"),
        (wrong_shape, "key 'obs' has shape (4, 5), expected (4, 4)"),
        (nested_dtype, "key 'next.done' has dtype torch.uint8"),
        (torch.zeros(4, 3), "this store holds a TensorDict"),
    ]


@pytest.mark.parametrize("case", range(len(bad_writes())))
def test_mismatched_write_is_rejected_and_nothing_changes(storage, case):
    data, message = bad_writes()[case]
    snap = snapshot(storage)
    with pytest.raises(SpecMismatchError, match=re.escape(message)):
        storage.set(torch.arange(30, 34), data)
    assert_unchanged(storage, snap)


def test_rejected_extend_through_the_buffer_keeps_the_data(storage):
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    snap = snapshot(storage)
    bad = make_steps(4, seed=3)
    bad["obs"] = bad["obs"].half()
    with pytest.raises(SpecMismatchError):
        rb.extend(bad)
    assert_unchanged(storage, snap)


@pytest.mark.parametrize("index", [30, -31, [0, 30], torch.tensor([[1, 2], [3, 99]]), torch.tensor([0.5])])
def test_out_of_range_or_non_integer_reads(storage, index):
    snap = snapshot(storage)
    with pytest.raises(IndexError, match="out of range for 30 rows|must be integers"):
        storage.get(index)
    assert_unchanged(storage, snap)


def test_out_of_range_write_index(storage):
    snap = snapshot(storage)
    with pytest.raises(IndexError, match="write index 50 is out of range for 50 rows"):
        storage.set(torch.tensor([1, 50]), make_steps(2, seed=4))
    with pytest.raises(IndexError, match="3 write indices for 2 rows"):
        storage.set(torch.tensor([1, 2, 3]), make_steps(2, seed=4))
    assert_unchanged(storage, snap)


def test_non_tensor_leaf_is_refused_by_a_shared_store_on_first_write():
    storage = GearStorage(10, shared=True)  # a local store keeps them beside the columns
    try:
        td = TensorDict({"obs": torch.zeros(2, 3)}, [2])
        td["name"] = "hello"
        with pytest.raises(SpecMismatchError, match=r"non-tensor leaves \['name'\] cannot live in a shared"):
            storage.set(torch.arange(2), td)
        assert not storage.initialized and len(storage) == 0
    finally:
        storage.close()


def test_reading_or_sampling_an_empty_storage():
    storage = GearStorage(10)
    with pytest.raises(EmptyStoreError, match="empty storage"):
        storage.get(0)
    rb = ReplayBuffer(storage=GearStorage(10), batch_size=2)
    with pytest.raises(RuntimeError, match="empty"):
        rb.sample()
    rb.extend(make_steps(3, seed=1))
    rb.empty()
    with pytest.raises(RuntimeError, match="empty"):
        rb.sample()


def test_load_state_dict_of_another_layout_is_rejected(storage):
    other = GearStorage(50)
    other.set(torch.arange(3), TensorDict({"x": torch.zeros(3)}, [3]))
    snap = snapshot(storage)
    with pytest.raises(ValueError, match="differ"):
        storage.load_state_dict(other.state_dict())
    smaller = GearStorage(40)
    with pytest.raises(ValueError, match="capacity 50"):
        smaller.load_state_dict(storage.state_dict())
    assert_unchanged(storage, snap)


def test_loading_a_missing_or_damaged_checkpoint(tmp_path, storage):
    with pytest.raises(FileNotFoundError, match="no gear_torchrl checkpoint"):
        GearStorage(50).loads(tmp_path / "nothing")
    storage.dumps(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "column_0.bin").write_bytes(b"truncated")
    fresh = GearStorage(50)
    with pytest.raises(ValueError, match="damaged"):
        fresh.loads(tmp_path / "ckpt")
    assert len(fresh) == 0 and not fresh.initialized


def test_bad_capacity():
    with pytest.raises(ValueError, match="capacity must be positive"):
        GearStorage(0)


def test_cuda_device_without_a_gpu_says_why():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present here: tests/gpu covers GearStorage(device='cuda')")
    with pytest.raises(RuntimeError, match=r"GearStorage\(device='cuda'\) cannot run here: no CUDA device"):
        GearStorage(10, device="cuda")
    with pytest.raises(ValueError, match="memory='device' needs device='cuda'"):
        GearStorage(10, memory="device")
    with pytest.raises(ValueError, match="device 'cpu' or 'cuda'"):
        GearStorage(10, device="meta")
