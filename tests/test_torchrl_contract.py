"""TorchRL's public storage contract, run over GearStorage and LazyTensorStorage side by side.

Each case is written from TorchRL's documented behaviour: what a user does with
``LazyTensorStorage`` must do the same on ``GearStorage``, or fail clearly where
our store cannot (a shared store takes appends only).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer

from gear_torchrl import GearStorage

STORAGES = [LazyTensorStorage, GearStorage]


def _filled(storage_cls, buffer_cls=ReplayBuffer, n: int = 10):
    rb = buffer_cls(storage=storage_cls(n), batch_size=4)
    rb.extend(TensorDict({"a": torch.zeros(n), ("next", "done"): torch.zeros(n, 1, dtype=torch.bool)}, [n]))
    return rb


# -- in-place writes through the buffer reach the rows (never silently dropped) --------------
@pytest.mark.parametrize("storage_cls", STORAGES)
def test_update_set_and_set_at_write_through(storage_cls):
    rb = _filled(storage_cls)
    rb.update_(TensorDict({"a": torch.full((10,), 7.0)}, [10]))
    assert torch.equal(rb[:]["a"], torch.full((10,), 7.0))
    rb.set_("a", torch.arange(10.0))
    assert torch.equal(rb[:]["a"], torch.arange(10.0))
    rb.set_at_("a", torch.tensor([-1.0, -2.0]), torch.tensor([3, 4]))
    assert rb[:]["a"][3:5].tolist() == [-1.0, -2.0]
    assert rb.sample()["a"].shape == (4,)


def test_in_place_done_flags_reach_the_episode_index():
    rb = _filled(GearStorage)
    assert rb.storage.shard.episodes.num_episodes == 1  # one open episode of 10 steps
    done = torch.zeros(10, 1, dtype=torch.bool)
    done[[3, 9]] = True
    rb.set_(("next", "done"), done)
    view = rb.storage.shard.episodes.live()
    assert view.length.tolist() == [4, 6] and bool(view.closed.all())


def test_in_place_writes_a_shared_store_cannot_take_are_refused_and_change_nothing():
    storage = GearStorage(10, shared=True)
    try:
        rb = _filled(lambda n: storage)
        for write in (
            lambda: rb.update_(TensorDict({"a": torch.ones(10)}, [10])),
            lambda: rb.set_("a", torch.ones(10)),
            lambda: rb.set_at_("a", torch.ones(2), torch.tensor([0, 1])),
        ):
            with pytest.raises(NotImplementedError, match="did not reach the stored rows"):
                write()
        assert torch.equal(rb[:]["a"], torch.zeros(10))
    finally:
        storage.close()


@pytest.mark.parametrize("storage_cls", STORAGES)
def test_update_if_present_patches_live_records_only(storage_cls):
    from torchrl.data import TensorDictRoundRobinWriter

    rb = TensorDictReplayBuffer(
        storage=storage_cls(10), writer=TensorDictRoundRobinWriter(track_generations=True), batch_size=4
    )
    rb.extend(TensorDict({"obs": torch.zeros(10, 3), "v": torch.full((10,), 5)}, [10]))
    sample = rb.sample()
    rb.extend(TensorDict({"obs": torch.zeros(2, 3), "v": torch.full((2,), 5)}, [2]))  # slots 0, 1 reused
    result = rb.update_if_present(
        index=sample["index"], generation=sample["index_generation"], patch={"obs": torch.ones(4, 3)}
    )
    reused = sample["index"] < 2
    assert result.updated.tolist() == (~reused).tolist()
    stored = rb[:]["obs"][sample["index"]]
    assert bool((stored[~reused] == 1).all()) and bool((stored[reused] == 0).all())
    with pytest.raises(KeyError):
        rb.update_if_present(
            index=sample["index"], generation=sample["index_generation"], patch={"missing": torch.ones(4)}
        )


# -- LazyTensorStorage's keywords --------------------------------------------------------------
@pytest.mark.parametrize("storage_cls", STORAGES)
def test_lazy_tensor_storage_keywords_are_accepted(storage_cls):
    for kwargs in ({"compilable": True}, {"ndim": 1}, {"consolidated": True}, {"cleanup_memmap": False}):
        rb = _filled(lambda n, kw=kwargs: storage_cls(n, **kw))
        assert len(rb) == 10 and rb.sample()["a"].shape == (4,)


def test_shared_init_shares_the_rows_from_the_start():
    storage = GearStorage(10, shared_init=True)
    try:
        assert storage.shared
        attached = GearStorage(0, handle=storage.handle)  # what a worker process gets when it unpickles it
        attached.set(torch.arange(3), TensorDict({"a": torch.ones(3)}, [3]))
        assert torch.equal(storage[:]["a"], torch.ones(3))
        attached.close()
    finally:
        storage.close()


def test_unsupported_layouts_are_refused_clearly():
    assert GearStorage(100, ndim=2).ndim == 2  # [T, num_envs]: tests/test_ndim2.py
    with pytest.raises(NotImplementedError, match="ndim=3.*ndim=1.*ndim=2"):
        GearStorage(100, ndim=3)
    with pytest.raises(ValueError, match="compilable"):
        GearStorage(100, compilable=True, shared=True)


# -- SliceSampler's names and its refusal of data without episode markers -----------------------
def _episodes_td(n_episodes: int = 20, length: int = 10, done_key=("next", "done")) -> TensorDict:
    done = torch.zeros(n_episodes, length, 1, dtype=torch.bool)
    done[:, -1] = True
    return TensorDict(
        {"ep": torch.arange(n_episodes).repeat_interleave(length), done_key: done.reshape(-1, 1)}, [n_episodes * length]
    )


def test_sequence_sampler_takes_slice_samplers_names():
    from torchrl.data import SliceSampler

    from gear_torchrl import GearSequenceSampler

    for sampler in (
        SliceSampler(slice_len=4, traj_key="ep"),
        GearSequenceSampler(slice_len=4, traj_key="ep"),
        GearSequenceSampler(num_slices=8, slice_len=4, strict_length=True, end_key=("next", "done")),
    ):
        windows = isinstance(sampler, GearSequenceSampler)
        storage = GearStorage(400, traj_key="ep") if windows else LazyTensorStorage(400)
        rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=32)
        rb.extend(_episodes_td())
        ep = rb.sample()["ep"].view(8, 4)
        assert bool((ep == ep[:, :1]).all())
    with pytest.raises(TypeError, match="one of seq_len"):
        GearSequenceSampler(seq_len=4, slice_len=4)


def test_sequence_sampler_refuses_keys_the_storage_does_not_delimit_episodes_with():
    from gear_torchrl import GearSequenceSampler

    rb = TensorDictReplayBuffer(
        storage=GearStorage(400), sampler=GearSequenceSampler(slice_len=4, traj_key="ep"), batch_size=32
    )
    rb.extend(_episodes_td())
    with pytest.raises(ValueError, match="traj_key='ep'"):
        rb.sample()
    typo = TensorDictReplayBuffer(
        storage=GearStorage(400, end_keys=[("next", "dnoe")]), sampler=GearSequenceSampler(4), batch_size=32
    )
    typo.extend(_episodes_td())
    with pytest.raises(KeyError, match="windows would cross episodes"):
        typo.sample()


def test_collector_trajectory_ids_delimit_episodes_by_default():
    from gear_torchrl import GearSequenceSampler

    td = _episodes_td()
    del td["next"]
    td["collector", "traj_ids"] = td["ep"]  # no done flags: a batched collector's rows, env after env
    rb = TensorDictReplayBuffer(storage=GearStorage(400), sampler=GearSequenceSampler(4), batch_size=64)
    rb.extend(td)
    assert rb.storage.shard.episodes.num_episodes == 20
    ep = rb.sample()["ep"].view(16, 4)
    assert bool((ep == ep[:, :1]).all())


# -- stale priorities: TorchRL's standard update path carries the draw's generations -------------
def test_update_tensordict_priority_skips_rows_rewritten_since_they_were_drawn():
    from gear_torchrl import GearPrioritizedSampler

    rb = TensorDictReplayBuffer(
        storage=GearStorage(8),
        sampler=GearPrioritizedSampler(8, alpha=1.0, beta=1.0),
        batch_size=8,
        priority_key="td_error",
    )
    rb.extend(TensorDict({"a": torch.arange(8.0)}, [8]))
    batch = rb.sample()
    rb.extend(TensorDict({"a": torch.full((4,), -1.0)}, [4]))  # rows 0-3 now hold new data
    batch["td_error"] = torch.full((8,), 50.0)
    rb.update_tensordict_priority(batch)
    masses = rb.sampler.masses(torch.arange(8))
    rewritten = batch["index"] < 4
    assert bool((masses[batch["index"][~rewritten]] > 40).all())  # kept rows took the update
    assert bool((masses[torch.arange(4)] < 40).all())  # rewritten rows kept their new default priority
    again = rb.sample()  # a fresh draw: its update lands on every row
    again["td_error"] = torch.full((8,), 60.0)
    rb.update_tensordict_priority(again)
    assert bool((rb.sampler.masses(again["index"]) > 55).all())


# -- moving a saved buffer between LazyTensorStorage and GearStorage, both ways ---------------------
@pytest.mark.parametrize(
    "source_cls,target_cls",
    [(LazyTensorStorage, GearStorage), (GearStorage, LazyTensorStorage), (GearStorage, GearStorage)],
)
def test_a_state_dict_moves_between_the_two_storages(source_cls, target_cls):
    source = ReplayBuffer(storage=source_cls(10), batch_size=4)
    done = (torch.arange(16) % 4 == 3).unsqueeze(-1)
    source.extend(TensorDict({"a": torch.arange(16.0), ("next", "done"): done}, [16]))  # the ring wraps
    target = ReplayBuffer(storage=target_cls(10), batch_size=4)
    target.storage.load_state_dict(source.storage.state_dict())
    assert len(target) == 10
    assert torch.equal(target.storage[:]["a"], source.storage[:]["a"])
    assert torch.equal(target.storage[:]["next", "done"], source.storage[:]["next", "done"])
    target.extend(TensorDict({"a": torch.full((2,), -1.0), ("next", "done"): torch.ones(2, 1, dtype=torch.bool)}, [2]))
    assert target.sample()["a"].shape == (4,)


def test_a_torchrl_state_that_does_not_fit_is_refused_and_changes_nothing():
    from gear_torchrl import CheckpointError

    big = LazyTensorStorage(20)
    big.set(torch.arange(15), TensorDict({"a": torch.arange(15.0)}, [15]))
    small = _filled(GearStorage)
    with pytest.raises(CheckpointError, match="15 rows"):
        small.storage.load_state_dict(big.state_dict())
    assert torch.equal(small[:]["a"], torch.zeros(10))


@pytest.mark.parametrize("storage_cls", STORAGES)
def test_an_emptied_buffer_takes_new_keys(storage_cls):
    rb = _filled(storage_cls)
    rb.empty()
    rb.extend(TensorDict({"b": torch.ones(4, 2)}, [4]))
    assert len(rb) == 4 and torch.equal(rb[:]["b"], torch.ones(4, 2))


@pytest.mark.parametrize("storage_cls", STORAGES)
def test_torchrl_sequence_sample_unit_reads_episode_ends(storage_cls):
    from torchrl.data.replay_buffers.sample_units import Sequence

    rb = TensorDictReplayBuffer(
        storage=storage_cls(200), batch_size=8, sample_unit=Sequence(length=4, episode_boundary="pad")
    )
    rb.extend(_episodes_td(20, 10))
    batch, info = rb.sample(return_info=True)
    assert batch.shape == (32,)
    ep = batch["ep"].view(8, 4)
    valid = info["validity_mask"].view(8, 4)
    assert bool(((ep == ep[:, :1]) | ~valid).all())  # padding repeats the last valid step; no window crosses
    assert storage_cls is not GearStorage or torch.equal(
        rb.storage.get(("next", "done")), rb.storage[:]["next", "done"]
    )


# -- TorchRL's own checkpointers ------------------------------------------------------------------
def _ted(n: int) -> TensorDict:
    done = (torch.arange(n) % 5 == 4).unsqueeze(-1)
    obs = torch.arange(n, dtype=torch.float32).unsqueeze(-1)
    return TensorDict(
        {
            "obs": obs,
            "action": torch.arange(n) % 3,
            "done": torch.zeros(n, 1, dtype=torch.bool),
            "terminated": torch.zeros(n, 1, dtype=torch.bool),
            "next": {"obs": obs + 1, "reward": torch.ones(n, 1), "done": done, "terminated": done},
        },
        [n],
    )


@pytest.mark.parametrize(
    "checkpointer", ["FlatStorageCheckpointer", "NestedStorageCheckpointer", "TensorStorageCheckpointer"]
)
@pytest.mark.parametrize("storage_cls", STORAGES)
def test_torchrl_checkpointers_round_trip(storage_cls, checkpointer, tmp_path):
    import torchrl.data.replay_buffers.checkpointers as checkpointers

    def buffer():
        storage = storage_cls(30)
        storage.checkpointer = getattr(checkpointers, checkpointer)()
        return ReplayBuffer(storage=storage, batch_size=4)

    rb = buffer()
    rb.extend(_ted(20))
    rb.dumps(tmp_path)
    restored = buffer()
    restored.loads(tmp_path)
    assert len(restored) == 20
    assert torch.equal(restored[:]["next", "obs"], rb[:]["next", "obs"])
    assert torch.equal(restored[:]["obs"], rb[:]["obs"])
