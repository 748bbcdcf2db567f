"""A saved buffer moves between TorchRL's storages and GearStorage through TorchRL's checkpoints, both ways.

Each test saves a buffer whose ring has wrapped (the writer's cursor is not at
0) with ``rb.dumps`` or TorchRL's run checkpoint (``torchrl.checkpoint.Checkpoint``),
loads it into a buffer over the other storage, and checks what a training script
sees next: ``rb[:]`` slot for slot, ``len``, where the next write lands, the
same seeded draws, priorities, and GearStorage's episode index against a
GearStorage that was written the same rows. Damaged or unfitting TorchRL
checkpoints are refused naming the problem, and the storage is left as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from helpers import assert_same_td, make_steps, writer_cursor
from tensordict import LazyStackedTensorDict, TensorDict, tensorclass
from torch.utils._pytree import tree_flatten
from torchrl.checkpoint import Checkpoint
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    PrioritizedSampler,
    ReplayBuffer,
    TensorDictReplayBuffer,
)

from gear_torchrl import CheckpointError, GearPrioritizedSampler, GearStorage, GearUniformSampler, QueueSampler
from gear_torchrl.adapters.checkpointer import GearStorageCheckpointer

CAPACITY = 16
WRITES = (11, 9, 3)  # 20 rows into 16: the ring wraps, the writer's cursor ends at 4 (then 7)


@tensorclass
class Step:
    obs: torch.Tensor
    done: torch.Tensor

    # tensordict is untyped to mypy (no py.typed), so it does not see @tensorclass's dataclass_transform: the part of
    # the generated __init__ these tests call, for the checker only.
    if TYPE_CHECKING:

        def __init__(self, *, obs: torch.Tensor, done: torch.Tensor, batch_size: Sequence[int]) -> None: ...


TORCHRL = {"LazyTensorStorage": LazyTensorStorage, "LazyMemmapStorage": LazyMemmapStorage}


def save(rb, path: Path, via: str) -> None:
    if via == "dumps":
        rb.dumps(path)
    else:
        Checkpoint(format="archive" if via == "archive" else "directory", replay_buffer=rb).save(path)


def load(rb, path: Path, via: str) -> None:
    if via == "dumps":
        rb.loads(path)
    else:
        Checkpoint(replay_buffer=rb).load(path)


def seeded(storage, sampler=None, cls=TensorDictReplayBuffer, **kw):
    return cls(
        storage=storage,
        generator=torch.Generator().manual_seed(3),
        batch_size=6,
        **({} if sampler is None else {"sampler": sampler}),
        **kw,
    )


def wrapped(rb, rows=make_steps):
    for i, n in enumerate(WRITES[:2]):
        rb.extend(rows(n, i))
    return rb


def episodes(storage) -> dict[str, torch.Tensor]:
    """The episode index's tensors (starts, lengths, closed), the same however it was built."""
    return {k: v for k, v in storage.shard.episodes.state().items() if isinstance(v, torch.Tensor)}


def assert_same_next_steps(source, loaded, rows=make_steps) -> None:
    """A training loop goes on alike: the same seeded batch, then the next write lands in the same slots."""
    a, b = source.sample(), loaded.sample()
    assert torch.equal(a["index"], b["index"])
    assert_same_td(a.exclude("index"), b.exclude("index"))
    more = rows(WRITES[2], 2)
    source.extend(more.clone())
    loaded.extend(more.clone())
    assert writer_cursor(source) == writer_cursor(loaded) == 7
    assert_same_td(source[:], loaded[:])


# -- rows, ring order, cursor and draws, both ways ---------------------------------------------------


@pytest.mark.parametrize("via", ["dumps", "checkpoint", "archive"])
@pytest.mark.parametrize("theirs", TORCHRL)
def test_a_torchrl_checkpoint_loads_into_gear_storage(tmp_path, theirs, via):
    source = wrapped(seeded(TORCHRL[theirs](CAPACITY)))
    save(source, tmp_path / "ckpt", via)
    loaded = seeded(GearStorage(CAPACITY))
    loaded.extend(make_steps(5, seed=9))  # a buffer already in use: the load replaces its rows
    load(loaded, tmp_path / "ckpt", via)
    reference = wrapped(seeded(GearStorage(CAPACITY)))  # the same rows written into a GearStorage
    assert len(loaded) == len(source) == CAPACITY
    assert writer_cursor(loaded) == writer_cursor(source) == 4
    assert_same_td(loaded[:], source[:])
    assert loaded.storage._last_cursor_index == reference.storage._last_cursor_index == 3
    assert all(
        torch.equal(a, b) for a, b in zip(episodes(loaded.storage).values(), episodes(reference.storage).values())
    )
    assert_same_next_steps(source, loaded)


@pytest.mark.parametrize("via", ["dumps", "checkpoint", "archive"])
@pytest.mark.parametrize("theirs", TORCHRL)
def test_a_gear_checkpoint_loads_into_torchrl_storages(tmp_path, theirs, via):
    source = wrapped(seeded(GearStorage(CAPACITY)))
    save(source, tmp_path / "ckpt", via)
    loaded = seeded(TORCHRL[theirs](CAPACITY))
    load(loaded, tmp_path / "ckpt", via)
    assert len(loaded) == len(source) == CAPACITY
    assert writer_cursor(loaded) == writer_cursor(source) == 4
    assert_same_td(loaded[:], source[:])
    assert_same_next_steps(source, loaded)


def test_a_partly_filled_store_crosses_and_its_unwritten_slots_read_zeros(tmp_path):
    source = TensorDictReplayBuffer(storage=GearStorage(CAPACITY))
    source.extend(make_steps(5, seed=1))
    source.dumps(tmp_path)
    theirs = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    theirs.loads(tmp_path)
    assert len(theirs) == 5
    assert_same_td(theirs[:], source[:])
    assert not theirs.storage._storage[5:]["obs"].any()
    back = TensorDictReplayBuffer(storage=GearStorage(CAPACITY))
    theirs.dumps(tmp_path / "back")
    back.loads(tmp_path / "back")
    assert len(back) == 5 and writer_cursor(back) == 5
    assert_same_td(back[:], source[:])
    assert all(torch.equal(a, b) for a, b in zip(episodes(back.storage).values(), episodes(source.storage).values()))


def test_a_full_store_names_its_column_files_twice_and_writes_them_once(tmp_path):
    rb = wrapped(TensorDictReplayBuffer(storage=GearStorage(CAPACITY)))
    rb.dumps(tmp_path)
    manifest = json.loads((tmp_path / "storage" / "shard.json").read_text())
    obs = next(i for i, c in enumerate(manifest["spec"]["columns"]) if c["key"] == ["obs"])
    storage = tmp_path / "storage"
    assert os.stat(storage / f"column_{obs}.bin").st_ino == os.stat(storage / "obs.memmap").st_ino


def test_without_the_torchrl_layout_only_gear_files_are_written_and_an_older_torchrl_manifest_goes(tmp_path):
    theirs = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    theirs.extend(make_steps(3, seed=0))
    theirs.dumps(tmp_path)
    ours = TensorDictReplayBuffer(
        storage=GearStorage(CAPACITY), checkpointer=GearStorageCheckpointer(torchrl_layout=False)
    )
    ours.extend(make_steps(6, seed=1))
    ours.dumps(tmp_path)
    assert not (tmp_path / "storage" / "storage_metadata.json").exists()
    loaded = TensorDictReplayBuffer(storage=GearStorage(CAPACITY))
    loaded.loads(tmp_path)
    assert_same_td(loaded[:], ours[:])


def test_the_newer_of_two_checkpoints_in_one_directory_loads(tmp_path):
    ours = wrapped(TensorDictReplayBuffer(storage=GearStorage(CAPACITY)))
    ours.dumps(tmp_path)
    theirs = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    theirs.extend(make_steps(7, seed=5))
    theirs.dumps(tmp_path)  # TorchRL saves over our checkpoint: its files are the newer
    loaded = TensorDictReplayBuffer(storage=GearStorage(CAPACITY))
    loaded.loads(tmp_path)
    assert len(loaded) == 7
    assert_same_td(loaded[:], theirs[:])
    ours.dumps(tmp_path)  # and ours again over TorchRL's
    for storage in (GearStorage(CAPACITY), LazyTensorStorage(CAPACITY)):
        again = TensorDictReplayBuffer(storage=storage)
        again.loads(tmp_path)
        assert_same_td(again[:], ours[:])


def test_a_shared_store_checkpoint_crosses_oldest_row_first(tmp_path, no_shm_leaks):
    storage = GearStorage(CAPACITY, shared=True)
    try:
        rb = wrapped(TensorDictReplayBuffer(storage=storage))
        rb.dumps(tmp_path)
        theirs = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
        theirs.loads(tmp_path)
        assert len(theirs) == len(rb) > 0  # a full shared ring reads up to 1/64 short of its capacity
        assert_same_td(theirs[:], rb[:])  # a shared store numbers its rows oldest first
        theirs.dumps(tmp_path / "back")
        again = GearStorage(CAPACITY, shared=True)
        try:
            back = TensorDictReplayBuffer(storage=again)
            back.loads(tmp_path / "back")
            assert_same_td(back[:], rb[:])
        finally:
            again.close()
    finally:
        storage.close()


def agents_and_text(n: int, seed: int) -> TensorDict:
    """Multi-agent rows whose agents differ in keys and shapes (a heterogeneous lazy stack), and a string per row."""
    g = torch.Generator().manual_seed(seed)
    agents = LazyStackedTensorDict(
        TensorDict(obs=torch.randn(n, 2, generator=g), batch_size=[n]),
        TensorDict(obs=torch.randn(n, 3, generator=g), hp=torch.rand(n, generator=g), batch_size=[n]),
        stack_dim=1,
    )
    return TensorDict(
        {
            "agents": agents,
            "text": [f"step {seed}.{i}" for i in range(n)],
            ("next", "done"): torch.rand(n, 1, generator=g) < 0.3,
        },
        [n],
    )


@pytest.mark.parametrize("direction", ["torchrl_to_gear", "gear_to_torchrl"])
def test_lazy_stacks_and_strings_cross(tmp_path, direction):
    source_cls, target_cls = (
        (LazyTensorStorage, GearStorage) if direction == "torchrl_to_gear" else (GearStorage, LazyTensorStorage)
    )
    source = wrapped(TensorDictReplayBuffer(storage=source_cls(CAPACITY)), agents_and_text)
    source.dumps(tmp_path)
    loaded = TensorDictReplayBuffer(storage=target_cls(CAPACITY))
    loaded.loads(tmp_path)
    for i in range(2):
        assert_same_td(loaded[:]["agents"].tensordicts[i], source[:]["agents"].tensordicts[i])
    if target_cls is GearStorage:  # TorchRL's own loader fills strings from its first row, whoever saved them
        assert loaded[:]["text"] == source[:]["text"]


# -- [T, num_envs] storages ------------------------------------------------------------------------


def env_steps(time_steps: int, seed: int, envs: int = 4) -> TensorDict:
    """What a batched-env collector writes: ``[num_envs, T]`` (the buffer's dim_extend=1 stores ``[T, num_envs]``)."""
    steps = make_steps(envs * time_steps, seed=seed, done_prob=0.25)
    return steps.reshape(envs, time_steps)


@pytest.mark.parametrize("direction", ["torchrl_to_gear", "gear_to_torchrl"])
def test_ndim2_storages_cross_both_ways(tmp_path, direction):
    def buffer(cls):
        return TensorDictReplayBuffer(storage=cls(40, ndim=2), generator=torch.Generator().manual_seed(3), batch_size=6)

    source_cls, target_cls = (
        (LazyTensorStorage, GearStorage) if direction == "torchrl_to_gear" else (GearStorage, LazyTensorStorage)
    )
    source = buffer(source_cls)
    for seed, steps in enumerate((6, 7)):  # 13 time steps into 10: wrapped, the cursor at 3
        source.extend(env_steps(steps, seed))
    source.dumps(tmp_path)
    loaded = buffer(target_cls)
    loaded.loads(tmp_path)
    assert len(loaded) == len(source) == 40 and loaded.storage.shape == source.storage.shape == (10, 4)
    assert writer_cursor(loaded) == writer_cursor(source) == 3
    assert_same_td(loaded[:], source[:])
    if target_cls is GearStorage:
        reference = buffer(GearStorage)
        for seed, steps in enumerate((6, 7)):
            reference.extend(env_steps(steps, seed))
        assert sorted(zip(*(v.tolist() for v in episodes(loaded.storage).values()))) == sorted(
            zip(*(v.tolist() for v in episodes(reference.storage).values()))
        )
    more = env_steps(2, 9)
    source.extend(more.clone())
    loaded.extend(more.clone())
    assert_same_td(loaded[:], source[:])


@pytest.mark.parametrize(
    "saved_ndim, saved_size, target, problem",
    [
        (2, 40, lambda: GearStorage(40), r"ndim=2.*GearStorage\(40, ndim=2\)"),
        (1, 40, lambda: GearStorage(40, ndim=2), r"ndim=1.*GearStorage\(40\)"),
        (1, 32, lambda: GearStorage(40), r"slots \[32\]; this storage holds 40 steps"),
    ],
)
def test_another_shape_of_storage_is_refused_naming_the_one_to_load_into(
    tmp_path, saved_ndim, saved_size, target, problem
):
    source = TensorDictReplayBuffer(storage=LazyTensorStorage(saved_size, ndim=saved_ndim))
    source.extend(env_steps(5, 0) if saved_ndim == 2 else make_steps(7, 0))
    source.dumps(tmp_path)
    with pytest.raises(CheckpointError, match=problem):
        TensorDictReplayBuffer(storage=target()).loads(tmp_path)


# -- priorities --------------------------------------------------------------------------------------


def torchrl_masses(sampler) -> torch.Tensor:
    return torch.tensor([sampler._sum_tree[i] for i in range(CAPACITY)], dtype=torch.float64)


def masses(sampler) -> torch.Tensor:
    """Each row's ``(p + eps) ** alpha``, whichever sampler holds it."""
    if isinstance(sampler, GearPrioritizedSampler):
        return sampler.masses(torch.arange(CAPACITY))
    return torchrl_masses(sampler)


PRIORITY_PAIRS = {
    "LazyTensorStorage+PrioritizedSampler -> GearStorage+PrioritizedSampler": (
        (LazyTensorStorage, PrioritizedSampler),
        (GearStorage, PrioritizedSampler),
    ),
    "GearStorage+PrioritizedSampler -> LazyTensorStorage+PrioritizedSampler": (
        (GearStorage, PrioritizedSampler),
        (LazyTensorStorage, PrioritizedSampler),
    ),
    "LazyTensorStorage+PrioritizedSampler -> GearStorage+GearPrioritizedSampler": (
        (LazyTensorStorage, PrioritizedSampler),
        (GearStorage, GearPrioritizedSampler),
    ),
    "GearStorage+GearPrioritizedSampler -> LazyTensorStorage+PrioritizedSampler": (
        (GearStorage, GearPrioritizedSampler),
        (LazyTensorStorage, PrioritizedSampler),
    ),
    "LazyMemmapStorage+PrioritizedSampler -> GearStorage+GearPrioritizedSampler": (
        (LazyMemmapStorage, PrioritizedSampler),
        (GearStorage, GearPrioritizedSampler),
    ),
}


@pytest.mark.parametrize("via", ["dumps", "checkpoint"])
@pytest.mark.parametrize("pair", PRIORITY_PAIRS)
def test_priorities_cross_with_the_rows(tmp_path, pair, via):
    (source_storage, source_sampler), (target_storage, target_sampler) = PRIORITY_PAIRS[pair]
    source = wrapped(seeded(source_storage(CAPACITY), source_sampler(CAPACITY, 0.7, 0.5)))
    source.update_priority(torch.arange(CAPACITY), torch.linspace(0.5, 8.0, CAPACITY))
    save(source, tmp_path / "ckpt", via)
    loaded = seeded(target_storage(CAPACITY), target_sampler(CAPACITY, 0.7, 0.5))
    load(loaded, tmp_path / "ckpt", via)
    assert_same_td(loaded[:], source[:])
    assert torch.allclose(masses(loaded.sampler), masses(source.sampler), rtol=1e-6)
    assert float(loaded.sampler.default_priority) == pytest.approx(float(source.sampler.default_priority))
    assert loaded.sampler._beta == source.sampler._beta
    if type(loaded.sampler) is type(source.sampler) is PrioritizedSampler:  # one algorithm: the same draws
        a, b = source.sample(), loaded.sample()
        assert torch.equal(a["index"], b["index"])
        assert torch.allclose(a["priority_weight"], b["priority_weight"])
    more = make_steps(3, seed=4)  # new rows take the largest priority in both
    source.extend(more.clone())
    loaded.extend(more.clone())
    assert torch.allclose(masses(loaded.sampler), masses(source.sampler), rtol=1e-6)


def test_a_torchrl_sampler_of_another_capacity_is_refused_and_changes_nothing(tmp_path):
    source = wrapped(
        TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY), sampler=PrioritizedSampler(2 * CAPACITY, 0.7, 0.5))
    )
    source.dumps(tmp_path)
    target = in_use_target()
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=f"capacity {2 * CAPACITY}, this sampler has {CAPACITY}"):
        target.loads(tmp_path)
    assert_unchanged(target, before)


def test_a_sampler_that_keeps_nothing_crosses_and_one_without_a_saved_state_is_refused(tmp_path):
    source = wrapped(seeded(LazyTensorStorage(CAPACITY)))  # RandomSampler: it saves nothing
    source.dumps(tmp_path)
    uniform = seeded(GearStorage(CAPACITY), GearUniformSampler())
    uniform.loads(tmp_path)
    assert torch.equal(uniform.sample()["index"], source.sample()["index"])
    queue = TensorDictReplayBuffer(storage=GearStorage(CAPACITY), sampler=QueueSampler(CAPACITY), batch_size=2)
    queue.extend(make_steps(3, seed=8))
    rows = queue.storage.get(slice(None)).clone()
    with pytest.raises(
        CheckpointError,
        match="no QueueSampler state.*the buffer's sampler saved nothing.*"
        r"rb.storage.loads",
    ):
        queue.loads(tmp_path)
    assert_same_td(queue.storage.get(slice(None)), rows)


# -- pytrees and tensorclasses -------------------------------------------------------------------------


def pytree_rows(n: int, seed: int) -> list:
    """Rows one by one, as TorchRL's own pytree tests write them: ``rb.extend`` of a list stacks them."""
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "a": torch.randint(10, (), generator=g),
            "b": {"c": [torch.randn(2, generator=g), (torch.randn(2, 3, generator=g),)]},
            30: torch.randn(1, generator=g),
        }
        for _ in range(n)
    ]


def same_tree(a, b) -> bool:
    (la, ta), (lb, tb) = tree_flatten(a), tree_flatten(b)
    return ta == tb and all(torch.equal(x, y) for x, y in zip(la, lb))


def test_extending_with_a_list_of_pytree_rows_stacks_them_as_torchrl_does():
    theirs, ours = ReplayBuffer(storage=LazyTensorStorage(CAPACITY)), ReplayBuffer(storage=GearStorage(CAPACITY))
    rows = pytree_rows(5, seed=0)
    theirs.extend(rows)
    ours.extend(rows)
    assert len(ours) == len(theirs) == 5
    assert same_tree(ours[:], theirs[:])
    with pytest.raises(ValueError, match="row 1 of the list has another pytree structure"):
        ours.extend([rows[0], {"a": rows[1]["a"]}])
    assert len(ours) == 5


@pytest.mark.parametrize("direction", ["gear_to_gear", "gear_to_torchrl", "torchrl_to_gear"])
def test_pytree_rows_cross_through_dumps(tmp_path, direction):
    source_cls = LazyTensorStorage if direction == "torchrl_to_gear" else GearStorage
    target_cls = LazyTensorStorage if direction == "gear_to_torchrl" else GearStorage
    source = ReplayBuffer(storage=source_cls(CAPACITY))
    source.extend(pytree_rows(11, seed=0))
    source.extend(pytree_rows(9, seed=1))
    source.dumps(tmp_path)
    loaded = ReplayBuffer(storage=target_cls(CAPACITY))
    loaded.extend(pytree_rows(1, seed=2))  # TorchRL's pytree checkpoints record no structure: the target knows it
    loaded.loads(tmp_path)
    assert len(loaded) == CAPACITY and writer_cursor(loaded) == writer_cursor(source) == 4
    assert same_tree(loaded[:], source[:])


def test_a_torchrl_pytree_checkpoint_into_an_empty_gear_storage_says_what_to_do(tmp_path):
    source = ReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    source.extend(pytree_rows(4, seed=0))
    source.dumps(tmp_path)
    with pytest.raises(CheckpointError, match="does not record the tree's structure: extend this buffer"):
        ReplayBuffer(storage=GearStorage(CAPACITY)).loads(tmp_path)


@pytest.mark.parametrize("direction", ["torchrl_to_gear", "gear_to_torchrl"])
def test_a_storage_of_one_tensor_crosses(tmp_path, direction):
    source_cls, target_cls = (
        (LazyTensorStorage, GearStorage) if direction == "torchrl_to_gear" else (GearStorage, LazyTensorStorage)
    )
    source = ReplayBuffer(storage=source_cls(CAPACITY))
    source.extend(torch.randn(20, 3))
    source.dumps(tmp_path)
    loaded = ReplayBuffer(storage=target_cls(CAPACITY))
    if target_cls is LazyTensorStorage:
        loaded.extend(torch.zeros(1, 3))  # TorchRL fills only an initialized storage from such files
    loaded.loads(tmp_path)
    assert torch.equal(loaded[:], source[:])


def module_rows(n: int, seed: int) -> Step:
    g = torch.Generator().manual_seed(seed)
    return Step(obs=torch.randn(n, 3, generator=g), done=torch.rand(n, 1, generator=g) < 0.3, batch_size=[n])


def local_class() -> type:
    @tensorclass
    class LocalStep:
        obs: torch.Tensor
        done: torch.Tensor

    return LocalStep


LOCAL_STEP = local_class()  # one class: TorchRL's loader finds it by name among every class defined so far


@pytest.mark.parametrize(
    "direction, where",
    [
        ("gear_to_gear", "inside a function"),
        ("gear_to_torchrl", "inside a function"),
        ("torchrl_to_gear", "inside a function"),
        ("gear_to_torchrl", "module level"),
        ("torchrl_to_gear", "module level"),
    ],
)
def test_tensorclass_rows_cross_through_dumps(tmp_path, direction, where):
    cls = Step if where == "module level" else LOCAL_STEP

    def rows(n: int, seed: int):
        plain = module_rows(n, seed)
        return cls(obs=plain.obs, done=plain.done, batch_size=[n])

    source_cls = LazyTensorStorage if direction == "torchrl_to_gear" else GearStorage
    target_cls = LazyTensorStorage if direction == "gear_to_torchrl" else GearStorage
    source = wrapped(ReplayBuffer(storage=source_cls(CAPACITY)), rows)
    source.dumps(tmp_path)
    loaded = ReplayBuffer(storage=target_cls(CAPACITY))
    loaded.loads(tmp_path)
    assert type(loaded[:]) is cls
    assert_same_td(loaded[:]._tensordict, source[:]._tensordict)
    assert writer_cursor(loaded) == 4
    if target_cls is GearStorage:
        more = rows(3, 7)  # the loaded store takes the class's rows on
        loaded.extend(more)
        assert type(loaded[:]) is cls and torch.equal(loaded[4:7].obs, more.obs)


# -- refused: damaged or unfitting TorchRL checkpoints, the buffer left as it was --------------------------


def in_use_target() -> TensorDictReplayBuffer:
    rb = TensorDictReplayBuffer(
        storage=GearStorage(CAPACITY), sampler=GearPrioritizedSampler(CAPACITY, 0.7, 0.5), batch_size=4
    )
    rb.extend(make_steps(6, seed=7, done_prob=0.3))
    rb.update_priority(torch.arange(6), torch.rand(6) + 0.5)
    return rb


def snapshot(rb) -> dict:
    state = rb.storage.state_dict()
    return {
        "rows": rb.storage.get(slice(None)).clone(),
        "len": len(rb),
        "cursor": writer_cursor(rb),
        "episodes": {k: v.clone() for k, v in episodes(rb.storage).items()},
        "head": state["head"],
        "mass": rb.sampler.masses(torch.arange(CAPACITY)).clone(),
    }


def assert_unchanged(rb, before: dict) -> None:
    after = snapshot(rb)
    assert_same_td(after.pop("rows"), before["rows"])
    for key, value in after.items():
        same = (
            all(torch.equal(value[k], before[key][k]) for k in value)
            if isinstance(value, dict)
            else torch.equal(value, before[key])
            if isinstance(value, torch.Tensor)
            else value == before[key]
        )
        assert same, f"the refused load changed the buffer's {key}"
    rb.sample()  # still a working buffer


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    blob = json.loads(path.read_text())
    edit(blob)
    path.write_text(json.dumps(blob))


def edit_meta(key: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda root: edit_json(root / "storage" / "meta.json", lambda m: edit(m[key]) if key else edit(m))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-5])


DAMAGE = {
    "manifest not JSON": (
        lambda p: (p / "storage" / "storage_metadata.json").write_text("{"),
        r"storage_metadata.json",
    ),
    "manifest without TorchRL's fields": (
        lambda p: (p / "storage" / "storage_metadata.json").write_text("{}"),
        r"is_pytree",
    ),
    "len beyond the slots": (
        lambda p: edit_json(p / "storage" / "storage_metadata.json", lambda m: m.__setitem__("len", 99)),
        r"99",
    ),
    "negative len": (
        lambda p: edit_json(p / "storage" / "storage_metadata.json", lambda m: m.__setitem__("len", -1)),
        r"len -1",
    ),
    "a data file missing": (lambda p: (p / "storage" / "obs.memmap").unlink(), r"obs.memmap is missing"),
    "a data file truncated": (lambda p: truncate(p / "storage" / "obs.memmap"), r"obs.memmap holds 251 bytes"),
    "meta.json missing": (lambda p: (p / "storage" / "meta.json").unlink(), r"no meta.json"),
    "a column of another dtype": (edit_meta("obs", lambda m: m.__setitem__("dtype", "torch.float64")), r"obs"),
    "a key this storage lacks": (
        lambda p: (
            edit_meta("", lambda m: m.__setitem__("extra", {**m["action"]}))(p),
            shutil.copy(p / "storage" / "action.memmap", p / "storage" / "extra.memmap"),
        ),
        r"only the checkpoint has \['extra'\]",
    ),
    "rows of an undefined class": (
        edit_meta("", lambda m: m.__setitem__("_type", "<class 'nowhere.Missing'>")),
        r"nowhere.Missing.*not defined",
    ),
    "writer cursor past the slots": (
        lambda p: edit_json(p / "writer" / "metadata.json", lambda m: m.__setitem__("cursor", 40)),
        r"cursor 40",
    ),
    "priorities truncated": (lambda p: truncate(p / "sampler" / "sumtree.memmap"), r"sumtree.memmap.*bytes"),
    "a NaN priority": (lambda p: np.full(CAPACITY, np.nan).tofile(p / "sampler" / "sumtree.memmap"), r"mass holds nan"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_torchrl_checkpoint_is_refused_and_changes_nothing(tmp_path, damage):
    source = wrapped(
        TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY), sampler=PrioritizedSampler(CAPACITY, 0.7, 0.5))
    )
    source.dumps(tmp_path)
    apply, problem = DAMAGE[damage]
    apply(tmp_path)
    target = in_use_target()
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=problem):
        target.loads(tmp_path)
    assert_unchanged(target, before)


def test_what_torchrl_cannot_load_fails_there_naming_the_way_across(tmp_path):
    GearStorage(CAPACITY).dumps(tmp_path)  # an empty store: TorchRL's checkpointer has no layout for one
    with pytest.raises(
        RuntimeError, match="gear_torchrl: the saved GearStorage held no rows.*Load this checkpoint into a GearStorage"
    ):
        LazyTensorStorage(CAPACITY).loads(tmp_path)
    ours = GearStorage(CAPACITY)
    ours.loads(tmp_path)
    assert len(ours) == 0 and not ours.initialized


def test_an_empty_directory_names_both_checkpoints_it_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match="shard.json.*storage_metadata.json"):
        GearStorage(CAPACITY).loads(tmp_path)
