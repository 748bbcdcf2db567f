"""Columns and data types, run over GearStorage and LazyTensorStorage side by side.

Each case does what a TorchRL user does, from TorchRL's documented behaviour, and
asserts that both storages give the same observable result. Where they part on
purpose (an append that leaves a stored key out: LazyTensorStorage keeps whatever
the slot held, we refuse), the case says so. Bad input is refused with an error
naming the key, and the store is left exactly as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pytest
import torch
from helpers import assert_same_td, same_bytes
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, tensorclass
from torchrl.data import (
    LazyTensorStorage,
    ReplayBuffer,
    TensorDictMaxValueWriter,
    TensorDictReplayBuffer,
)

from gear_torchrl import CheckpointError, GearStorage, SpecMismatchError

STORAGES = [LazyTensorStorage, GearStorage]


def same_on_both(scenario):
    """Run ``scenario(storage_cls)`` on each storage; the observable results must agree."""
    lazy, gear = (scenario(cls) for cls in STORAGES)
    assert_same(lazy, gear)
    return gear


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def _obs(n: int, value: float = 0.0) -> TensorDict:
    return TensorDict({"obs": torch.full((n, 3), value)}, [n])


# -- item 4: columns added to a live store, writes of some keys ------------------------------------
def test_a_row_written_in_place_without_torchrls_index_keeps_the_index():
    def scenario(cls):
        rb = TensorDictReplayBuffer(storage=cls(10), batch_size=4)
        rb.extend(_obs(5))  # TorchRL stores its "index" key with every row
        rb[0] = TensorDict({"obs": torch.ones(3)}, [])
        rows = rb[:]
        return {"obs": rows["obs"], "index": rows["index"]}

    rows = same_on_both(scenario)
    assert rows["obs"][0].tolist() == [1.0, 1.0, 1.0] and rows["index"].tolist() == [0, 1, 2, 3, 4]


def test_max_value_writer_extend_then_add_then_extend():
    def scenario(cls):
        rb = TensorDictReplayBuffer(storage=cls(8), batch_size=4, writer=TensorDictMaxValueWriter(rank_key="r"))
        rb.extend(TensorDict({"obs": torch.zeros(5, 3), "r": torch.arange(5.0)}, [5]))  # stores no "index"
        rb.add(TensorDict({"obs": torch.ones(3), "r": torch.tensor(10.0)}, []))  # stores "index"
        rb.extend(TensorDict({"obs": torch.ones(4, 3), "r": torch.arange(20.0, 24.0)}, [4]))  # full: replaces
        return {"len": len(rb), "r": rb[:]["r"], "obs": rb[:]["obs"]}

    rows = same_on_both(scenario)
    assert sorted(rows["r"].tolist()) == [2.0, 3.0, 4.0, 10.0, 20.0, 21.0, 22.0, 23.0]


def test_write_all_with_a_new_key_adds_a_column():
    def scenario(cls):
        rb = TensorDictReplayBuffer(storage=cls(10), batch_size=4)
        rb.extend(_obs(5))
        data = rb[:]
        data["value_target"] = torch.arange(5.0).unsqueeze(-1)  # what value estimators write
        rb.write_all(data)
        rb.extend(TensorDict({"obs": torch.ones(2, 3), "value_target": torch.full((2, 1), -1.0)}, [2]))
        return {"value_target": rb[:]["value_target"], "sample": rb.sample()["value_target"].shape}

    rows = same_on_both(scenario)
    assert rows["value_target"].flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, -1.0, -1.0]


def test_a_new_key_written_to_some_rows_reads_zeros_in_the_others():
    def scenario(cls):
        storage = cls(10)
        storage.set(torch.arange(5), _obs(5))
        storage[torch.tensor([1, 3])] = TensorDict({"obs": torch.ones(2, 3), "v": torch.full((2, 2), 3.0)}, [2])
        return {"v": storage[:]["v"], "obs": storage[:]["obs"], "len": len(storage)}

    rows = same_on_both(scenario)
    assert rows["v"][:, 0].tolist() == [0.0, 3.0, 0.0, 3.0, 0.0]


def test_storage_set_with_some_keys_changes_only_those():
    def scenario(cls):
        storage = cls(10)
        storage.set(torch.arange(5), TensorDict({"obs": torch.zeros(5, 3), "a": torch.arange(5.0)}, [5]))
        storage.set(torch.arange(2), TensorDict({"obs": torch.ones(2, 3)}, [2]))
        rows = storage[torch.arange(5)]  # LazyTensorStorage's length moves oddly here: compare the rows
        return {"obs": rows["obs"], "a": rows["a"]}

    rows = same_on_both(scenario)
    assert rows["a"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and rows["obs"][:2].eq(1).all()


def test_extend_with_a_new_key_adds_a_column_older_rows_zero():
    def scenario(cls):
        rb = ReplayBuffer(storage=cls(10), batch_size=4)
        rb.extend(_obs(5))
        rb.extend(TensorDict({"obs": torch.ones(2, 3), ("next", "new"): torch.ones(2, 2, dtype=torch.int32)}, [2]))
        return {"new": rb[:]["next", "new"], "obs": rb[:]["obs"]}

    rows = same_on_both(scenario)
    assert rows["new"].sum(-1).tolist() == [0, 0, 0, 0, 0, 2, 2]


def test_a_new_column_keeps_episodes_and_gathers_with_the_others():
    rb = TensorDictReplayBuffer(storage=GearStorage(20), batch_size=6)
    done = torch.tensor([False, False, True, False, False, True]).unsqueeze(-1)
    rb.extend(TensorDict({"obs": torch.arange(6.0), ("next", "done"): done}, [6]))
    rb.extend(TensorDict({"obs": torch.arange(6.0, 9.0), ("next", "done"): done[:3], "extra": torch.ones(3)}, [3]))
    assert rb.storage.shard.episodes.live().length.tolist() == [3, 3, 3]
    batch = rb.storage.get(torch.arange(9))
    assert batch["extra"].tolist() == [0.0] * 6 + [1.0] * 3 and batch["obs"].tolist() == list(map(float, range(9)))


# -- the rule for appends, and bad input: an error naming the key, the store unchanged ----------------
def _snapshot(storage: GearStorage) -> tuple:
    shard = storage.shard
    return shard.table, len(storage), [c.clone() for c in shard.columns]


def _assert_unchanged(storage: GearStorage, snap: tuple) -> None:
    spec, size, columns = snap
    assert storage.shard.table == spec and len(storage) == size and len(storage.shard.columns) == len(columns)
    assert all(same_bytes(a, b) for a, b in zip(storage.shard.columns, columns))


def test_an_append_that_leaves_a_stored_key_out_is_refused_naming_it():
    # LazyTensorStorage takes it and the new rows keep whatever their slots held; we refuse.
    rb = ReplayBuffer(storage=GearStorage(10), batch_size=4)
    rb.extend(TensorDict({"obs": torch.zeros(5, 3), "a": torch.zeros(5)}, [5]))
    snap = _snapshot(rb.storage)
    with pytest.raises(SpecMismatchError, match=r"an append must carry every stored key: missing \['a'\]"):
        rb.extend(_obs(2, 1.0))
    _assert_unchanged(rb.storage, snap)
    rb.extend(TensorDict({"obs": torch.ones(2, 3), "a": torch.ones(2)}, [2]))  # the next good write lands at 5
    assert rb[:]["a"].tolist() == [0.0] * 5 + [1.0] * 2


@pytest.mark.parametrize(
    "bad,message",
    [
        (
            {"obs": torch.zeros(2, 3, dtype=torch.float64)},
            "key 'obs' has dtype torch.float64, the store holds torch.float32",
        ),
        ({"obs": torch.zeros(2, 4)}, r"key 'obs' has shape \(2, 4\), expected \(2, 3\)"),
    ],
)
def test_a_write_with_a_new_key_and_a_wrong_one_is_refused_and_adds_nothing(bad, message):
    write = TensorDict({**bad, "new": torch.ones(2)}, [2])
    lazy = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=4)
    lazy.extend(_obs(5))
    with pytest.raises(RuntimeError):  # LazyTensorStorage refuses it too, less clearly
        lazy.extend(write)
    rb = ReplayBuffer(storage=GearStorage(10), batch_size=4)
    rb.extend(_obs(5))
    snap = _snapshot(rb.storage)
    for attempt in (lambda: rb.extend(write), lambda: rb.storage.__setitem__(torch.tensor([0, 1]), write)):
        with pytest.raises(SpecMismatchError, match=message):
            attempt()
        _assert_unchanged(rb.storage, snap)
    assert "new" not in rb[:].keys()


def test_a_shared_store_takes_a_new_key_as_a_local_one_does():
    def scenario(shared):
        storage = GearStorage(10, shared=shared)
        try:
            rb = ReplayBuffer(storage=storage, batch_size=4)
            rb.extend(_obs(5))
            rb.extend(TensorDict({"obs": torch.ones(2, 3), "v": torch.ones(2)}, [2]))
            return rb[:]
        finally:
            storage.close()

    local, shared = scenario(False), scenario(True)
    assert_same_td(local, shared)
    assert shared["v"].tolist() == [0.0] * 5 + [1.0] * 2


# -- item 5: data types -------------------------------------------------------------------------------
def test_pytrees_come_back_in_their_structure():
    def scenario(cls):
        rb = ReplayBuffer(storage=cls(10), batch_size=4)
        rb.extend({"a": torch.arange(3.0), "b": (torch.ones(3, 2),), "c": [torch.zeros(3, dtype=torch.int64)]})
        rb.add({"a": torch.tensor(5.0), "b": (torch.full((2,), 5.0),), "c": [torch.tensor(7)]})
        sample = rb.sample()
        return {
            "all": rb[:],
            "row": rb[3],
            "sample_shapes": {k: torch.utils._pytree.tree_map(lambda t: t.shape, v) for k, v in sample.items()},
        }

    rows = same_on_both(scenario)
    assert rows["row"]["b"][0].tolist() == [5.0, 5.0] and rows["all"]["a"].tolist() == [0.0, 1.0, 2.0, 5.0]


def test_a_pytree_of_another_structure_is_refused():
    for storage_cls in STORAGES:
        rb = ReplayBuffer(storage=storage_cls(10), batch_size=4)
        rb.extend({"a": torch.zeros(3), "b": (torch.ones(3, 2),)})
        with pytest.raises(ValueError, match="missing"):
            rb.extend({"a": torch.zeros(3), "c": (torch.ones(3, 2),)})
    # GearStorage names the leaves and keeps its length (LazyTensorStorage counts the refused rows)
    assert len(rb) == 3 and rb[:]["b"][0].shape == (3, 2)


# tensordict is untyped to mypy (no py.typed), so it does not see @tensorclass's dataclass_transform: each class
# declares, for the checker only, the part of the generated __init__ these tests call.
@tensorclass
class Inner:
    z: torch.Tensor

    if TYPE_CHECKING:

        def __init__(self, *, z: torch.Tensor, batch_size: Sequence[int]) -> None: ...


@tensorclass
class Step:
    obs: torch.Tensor
    inner: Inner
    tag: str

    if TYPE_CHECKING:

        def __init__(self, *, obs: torch.Tensor, inner: Inner, tag: str, batch_size: Sequence[int]) -> None: ...


def test_tensorclasses_come_back_as_their_class():
    def scenario(cls):
        rb = ReplayBuffer(storage=cls(10), batch_size=4)
        rb.extend(
            Step(
                obs=torch.arange(6.0).view(3, 2),
                inner=Inner(z=torch.arange(3), batch_size=[3]),
                tag="a",
                batch_size=[3],
            )
        )
        rb.add(Step(obs=torch.ones(2), inner=Inner(z=torch.tensor(9), batch_size=[]), tag="b", batch_size=[]))
        rows, sample = rb[:], rb.sample()
        return {
            "types": (type(rows).__name__, type(rows.inner).__name__, type(sample).__name__),
            "obs": rows.obs,
            "z": rows.inner.z,
            "tags": list(rows.tag),
            "row": type(rb[1]).__name__,
        }

    rows = same_on_both(scenario)
    assert rows["types"] == ("Step", "Inner", "Step") and rows["tags"] == ["a", "a", "a", "b"]


def test_strings_and_non_tensor_data_are_kept_per_row():
    def scenario(cls):
        rb = TensorDictReplayBuffer(storage=cls(10), batch_size=4)
        td = _obs(3)
        td["env_name"] = "cartpole"  # one NonTensorData for the whole batch
        rb.extend(td)
        td = _obs(2, 1.0)
        td["env_name"] = NonTensorStack("pong", "breakout")
        rb.extend(td)
        one = TensorDict({"obs": torch.full((3,), 2.0)}, [])
        one["env_name"] = NonTensorData("go")
        rb.add(one)
        sample, names = rb.sample(), list(rb[:]["env_name"])
        return {
            "names": names,
            "row": rb[4]["env_name"],
            "types": (type(sample.get("env_name")).__name__, type(rb[4].get("env_name")).__name__),
            "grid": [list(r) for r in rb.storage[torch.tensor([[0, 3], [4, 5]])]["env_name"]],
            "sampled_rows_agree": list(sample["env_name"]) == [names[i] for i in sample["index"].tolist()],
        }

    rows = same_on_both(scenario)
    assert rows["names"] == ["cartpole"] * 3 + ["pong", "breakout", "go"] and rows["row"] == "breakout"
    assert rows["types"] == ("NonTensorStack", "NonTensorData") and rows["sampled_rows_agree"]


def test_non_tensor_rows_follow_the_ring_and_a_state_dict():
    storage = GearStorage(4)
    rb = ReplayBuffer(storage=storage, batch_size=2)
    for i in range(3):
        td = _obs(2, float(i))
        td["name"] = NonTensorStack(f"{i}a", f"{i}b")
        rb.extend(td)
    assert list(rb[:]["name"]) == ["2a", "2b", "1a", "1b"]  # slots 0, 1 were overwritten
    restored = GearStorage(4)
    restored.load_state_dict(storage.state_dict())
    assert list(restored[:]["name"]) == ["2a", "2b", "1a", "1b"]


def test_string_leaves_survive_a_checkpoint_and_odd_objects_are_refused_by_name(tmp_path):
    rb = ReplayBuffer(storage=GearStorage(4), batch_size=2)
    for i in range(3):
        td = _obs(2, float(i))
        td["name"] = NonTensorStack(f"{i}a", f"{i}b")
        rb.extend(td)
    rb.dumps(tmp_path / "rb")
    restored = ReplayBuffer(storage=GearStorage(4), batch_size=2)
    restored.loads(tmp_path / "rb")
    assert list(restored[:]["name"]) == ["2a", "2b", "1a", "1b"]
    assert torch.equal(restored[:]["obs"], rb[:]["obs"])
    manifest = next((tmp_path / "rb").rglob("shard.json"))
    manifest.write_text(manifest.read_text().replace('"2a"', '"2z"'))  # a damaged (or forged) string
    fresh = ReplayBuffer(storage=GearStorage(4), batch_size=2)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        fresh.loads(tmp_path / "rb")
    assert len(fresh) == 0
    odd = ReplayBuffer(storage=GearStorage(4), batch_size=2)
    td = _obs(2, 0.0)
    td["name"] = NonTensorStack(("a", 1), ("b", 2))  # tuples would come back as lists
    odd.extend(td)
    with pytest.raises(NotImplementedError, match=r"non-tensor leaf 'name' holds .* cannot store as JSON exactly"):
        odd.dumps(tmp_path / "odd")
    assert not (tmp_path / "odd").exists() or not any((tmp_path / "odd").rglob("*.json"))


def _agents(n: int, start: float = 0.0, sizes=(2, 3, 4)) -> LazyStackedTensorDict:
    """A multi-agent batch: agents stacked along dim 1, each with its own observation size."""
    members = [
        TensorDict({"obs": start + torch.arange(n * k, dtype=torch.float32).view(n, k), "id": torch.full((n,), i)}, [n])
        for i, k in enumerate(sizes)
    ]
    return LazyStackedTensorDict.lazy_stack(members, 1)


def test_ragged_lazy_stacks_come_back_as_lazy_stacks():
    def scenario(cls):
        rb = TensorDictReplayBuffer(storage=cls(10), batch_size=4)
        rb.extend(_agents(5))
        rb.add(_agents(1, 100.0)[0])
        got = rb.storage.get(torch.tensor([1, 5, 3]))
        sample = rb.sample()
        return {
            "type": type(got).__name__,
            "batch": got.batch_size,
            "stack_dim": got.stack_dim,
            "obs": [m["obs"] for m in got.tensordicts],
            "id": got["id"],
            "row": type(rb[2]).__name__,
            "sample": (sample.batch_size, [m["obs"].shape for m in sample.tensordicts], sample["index"].shape),
        }

    rows = same_on_both(scenario)
    assert rows["type"] == "LazyStackedTensorDict" and rows["stack_dim"] == 1
    assert rows["obs"][2][1].tolist() == [100.0, 101.0, 102.0, 103.0]


def test_lazy_stack_members_with_their_own_keys():
    def scenario(cls):
        a = TensorDict({"obs": torch.ones(4, 2), "x": torch.arange(4.0)}, [4])
        b = TensorDict({"obs": torch.zeros(4, 2)}, [4])
        storage = cls(10)
        storage.set(torch.arange(4), LazyStackedTensorDict.lazy_stack([a, b], 1))
        got = storage.get(torch.arange(2))
        return {"keys": [sorted(m.keys()) for m in got.tensordicts], "x": got.tensordicts[0]["x"]}

    same_on_both(scenario)


def test_a_ragged_stack_of_other_shapes_is_refused_and_changes_nothing():
    lazy = TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=4)
    lazy.extend(_agents(3))
    with pytest.raises(RuntimeError):  # LazyTensorStorage refuses it too
        lazy.extend(_agents(2, sizes=(2, 3, 5)))
    rb = TensorDictReplayBuffer(storage=GearStorage(10), batch_size=4)
    rb.extend(_agents(3))
    snap = _snapshot(rb.storage)
    with pytest.raises(SpecMismatchError, match=r"key '\[2\]\.obs' has shape \(2, 5\), expected \(2, 4\)"):
        rb.extend(_agents(2, sizes=(2, 3, 5)))
    _assert_unchanged(rb.storage, snap)
    with pytest.raises(SpecMismatchError, match="stacks 2 members, the store holds 3"):
        rb.extend(_agents(2, sizes=(2, 3)))
    _assert_unchanged(rb.storage, snap)


def test_a_key_that_changes_between_tensor_and_string_is_refused_and_changes_nothing():
    rb = TensorDictReplayBuffer(storage=GearStorage(10), batch_size=2)
    td = _obs(2)
    td["name"] = "x"
    rb.extend(td)
    snap = _snapshot(rb.storage)
    swapped = TensorDict({"obs": torch.zeros(2, 3), "name": torch.zeros(2)}, [2])
    with pytest.raises(SpecMismatchError, match="key 'name' holds a tensor; the store holds non-tensor data"):
        rb.extend(swapped)
    as_string = TensorDict({}, [2])
    as_string["obs"] = "not a tensor"
    as_string["name"] = "y"
    with pytest.raises(SpecMismatchError, match="key 'obs' holds a NonTensorData; the store holds a tensor"):
        rb.storage[torch.tensor([0, 1])] = as_string
    _assert_unchanged(rb.storage, snap)
    assert list(rb[:]["name"]) == ["x", "x"]
