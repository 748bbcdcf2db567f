"""``GearStorage(max_size, ndim=2)``: ``[T, num_envs]`` steps, beside ``LazyTensorStorage(max_size, ndim=2)``.

Each TorchRL case runs the same data through both storages, with the same
generator seeds where TorchRL's sampling is deterministic, and compares indices
and batches. Our window sampler is checked against what the data says: every
window stays in one env column and one episode. Bad input is refused with an
error naming the problem, and the store stays as it was.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import SliceKeys, as_dataset, assert_same_td, writer_cursor
from tensordict import NonTensorData, NonTensorStack, TensorDict
from torchrl.data import (
    LazyTensorStorage,
    RandomSampler,
    ReplayBuffer,
    SamplerWithoutReplacement,
    SliceSampler,
    TensorDictReplayBuffer,
)

from gear_torchrl import (
    GearPrioritizedSampler,
    GearPrioritizedSequenceSampler,
    GearSequenceSampler,
    GearStorage,
    TrajectoryWriter,
)

ENVS = 4


class BatchedEnvs:
    """Successive ``[num_envs, T]`` batches as a batched-env collector writes them.

    Each env's trajectories get ids from one counter (TorchRL's ``("collector", "traj_ids")``),
    ``step`` is the time step since the start (the same for every env at a time), ``env`` the column.
    """

    def __init__(self, num_envs: int = ENVS, seed: int = 0, done_prob: float = 0.15, traj_ids: bool = True) -> None:
        self.num_envs, self.done_prob, self.traj_ids = num_envs, done_prob, traj_ids
        self.generator = torch.Generator().manual_seed(seed)
        self.current = torch.arange(num_envs)
        self.next_id = num_envs
        self.time = 0

    def batch(self, steps: int) -> TensorDict:
        done = torch.rand(self.num_envs, steps, generator=self.generator) < self.done_prob
        ids = torch.empty(self.num_envs, steps, dtype=torch.int64)
        for t in range(steps):
            ids[:, t] = self.current
            for e in done[:, t].nonzero().flatten().tolist():
                self.current[e] = self.next_id
                self.next_id += 1
        step = torch.arange(self.time, self.time + steps).expand(self.num_envs, steps)
        self.time += steps
        data = {
            "obs": torch.randn(self.num_envs, steps, 3, generator=self.generator),
            "env": torch.arange(self.num_envs).unsqueeze(1).expand(self.num_envs, steps).clone(),
            "step": step.clone(),
            ("next", "done"): done.unsqueeze(-1),
        }
        if self.traj_ids:
            data["collector", "traj_ids"] = ids
        return TensorDict(data, [self.num_envs, steps])


def _pair(max_size: int, buffer_cls=TensorDictReplayBuffer, sampler=None, seed: int = 0, **kw):
    """The same buffer over LazyTensorStorage(ndim=2) and GearStorage(ndim=2), with equally seeded generators."""
    return [
        buffer_cls(
            storage=cls(max_size, ndim=2),
            sampler=sampler() if sampler else None,
            generator=torch.Generator().manual_seed(seed),
            **kw,
        )
        for cls in (LazyTensorStorage, GearStorage)
    ]


def _assert_same_layout(ours, theirs, cursor: bool = True) -> None:
    a, b = theirs.storage, ours.storage
    assert len(b) == len(a) and len(ours) == len(theirs)
    assert b.shape == a.shape and b._len_along_dim0 == a._len_along_dim0 and b._is_full == a._is_full
    assert not cursor or b._last_cursor_index == a._last_cursor_index


# -- what TorchRL does with a [T, num_envs] storage, both storages side by side ------------------
@pytest.mark.parametrize("buffer_cls", [ReplayBuffer, TensorDictReplayBuffer])
@pytest.mark.parametrize("dim_extend", [1, 0])
def test_extend_and_reads_match_lazy_tensor_storage_through_wraps(dim_extend, buffer_cls):
    envs = BatchedEnvs()
    theirs, ours = _pair(40, buffer_cls, dim_extend=dim_extend)  # 10 time steps of 4 envs
    for steps in (3, 4, 6, 13):  # the last two wrap the time ring; 13 > 10 keeps only the newest 10
        data = envs.batch(steps)
        data = data if dim_extend == 1 else data.transpose(0, 1)  # [T, num_envs] written as it is
        assert torch.equal(ours.extend(data.clone()), theirs.extend(data.clone()))
        _assert_same_layout(ours, theirs)
        assert_same_td(ours[:], theirs[:])
        assert_same_td(ours.storage[:], theirs.storage[:])
    for index in ([1], [0, 3], slice(1, 3), torch.tensor([2, 2, 0])):
        assert_same_td(ours[index], theirs[index])
    t, e = torch.tensor([0, 9, 4, -1]), torch.tensor([3, 0, 2, 1])
    for at in ((t, e), 5, -1, slice(2, 7), torch.tensor([1, 8]), (slice(None), 2), (3, slice(1, None))):
        assert_same_td(ours.storage[at], theirs.storage[at])


def test_non_tensor_leaves_and_pytrees_land_as_lazy_tensor_storage_keeps_them():
    """[T, E] steps land without being flattened first: non-tensor rows and pytree leaves still end up
    at their own (t, e), also when a write wraps the time ring (pytrees: up to the ring's end)."""
    envs = BatchedEnvs(traj_ids=False)
    theirs, ours = _pair(40, TensorDictReplayBuffer, dim_extend=1)
    trees = [ReplayBuffer(storage=cls(40, ndim=2), dim_extend=1) for cls in (LazyTensorStorage, GearStorage)]
    for steps in (3, 6, 4, 9):  # the last two wrap the time ring of 10
        data = envs.batch(steps)
        data["label"] = NonTensorStack(
            *[
                NonTensorStack(*[NonTensorData(f"e{e} t{int(data['step'][e, t])}") for t in range(steps)])
                for e in range(ENVS)
            ]
        )
        ours.extend(data.clone())
        theirs.extend(data.clone())
        labels = [list(time_row) for time_row in ours.storage[:]["label"]]
        assert labels == [[f"e{e} t{int(s)}" for e, s in enumerate(step)] for step in theirs.storage[:]["step"]]
        assert_same_td(ours.storage[:].exclude("label"), theirs.storage[:].exclude("label"))
        if len(trees[0]) + steps * ENVS > 40:
            continue  # LazyTensorStorage(ndim=2) cannot wrap a pytree's time ring (its cursor runs past the end)
        tree = {"obs": data["obs"], "nested": [data["step"], data["next", "done"]]}
        for rb in trees:
            rb.extend(tree)
        for a, b in zip(
            torch.utils._pytree.tree_leaves(trees[0].storage[:]), torch.utils._pytree.tree_leaves(trees[1].storage[:])
        ):
            assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:Using `add\\(\\)`")  # TorchRL's hint for a batch of one step of every env
def test_add_writes_one_time_step_of_every_env():
    envs = BatchedEnvs()
    theirs, ours = _pair(12, ReplayBuffer, dim_extend=1)  # (TensorDictReplayBuffer.add fails on TorchRL's own ndim=2)
    data = envs.batch(5)
    for t in range(5):  # 5 time steps into a ring of 3
        step = data[:, t]
        assert torch.equal(torch.as_tensor(ours.add(step.clone())), torch.as_tensor(theirs.add(step.clone())))
        _assert_same_layout(ours, theirs)
    assert_same_td(ours[:], theirs[:])


@pytest.mark.parametrize("buffer_cls", [ReplayBuffer, TensorDictReplayBuffer])
def test_random_sampler_draws_the_same_steps(buffer_cls):
    envs = BatchedEnvs()
    theirs, ours = _pair(40, buffer_cls, RandomSampler, batch_size=16)
    for steps in (6, 7):
        data = envs.batch(steps)
        ours.extend(data.clone())
        theirs.extend(data.clone())
        for _ in range(3):
            (a, info_a), (b, info_b) = theirs.sample(return_info=True), ours.sample(return_info=True)
            assert isinstance(info_b["index"], tuple) and len(info_b["index"]) == 2
            assert all(torch.equal(x, y) for x, y in zip(info_a["index"], info_b["index"]))
            assert_same_td(b, a)


def test_sampler_without_replacement_covers_every_step_once_as_torchrl_does():
    theirs, ours = _pair(40, sampler=SamplerWithoutReplacement, batch_size=8)
    data = BatchedEnvs().batch(7)
    ours.extend(data.clone())
    theirs.extend(data.clone())
    seen = []
    for _ in range(4):  # 28 steps stored: 3 full batches, then a new epoch
        a, b = theirs.sample(), ours.sample()
        assert_same_td(b, a)
        seen.append(b["index"])
    first_epoch = torch.cat(seen[:3])
    assert len({tuple(i) for i in first_epoch.tolist()}) == 24  # no step twice within an epoch


@pytest.mark.parametrize("strict_length", [False, True])
@pytest.mark.parametrize("variant", ["traj_key", "end_key"])
def test_slice_sampler_reads_the_same_windows(variant, strict_length):
    envs = BatchedEnvs(traj_ids=variant == "traj_key", done_prob=0.1)
    kw: SliceKeys = {"traj_key": ("collector", "traj_ids")} if variant == "traj_key" else {"end_key": ("next", "done")}
    theirs, ours = _pair(
        80, sampler=lambda: SliceSampler(slice_len=4, strict_length=strict_length, **kw), batch_size=24
    )
    for steps in (12, 15):  # the second write wraps the 20 time rows
        data = envs.batch(steps)
        ours.extend(data.clone())
        theirs.extend(data.clone())
        for _ in range(3):
            (a, info_a), (b, info_b) = theirs.sample(return_info=True), ours.sample(return_info=True)
            assert all(torch.equal(x, y) for x, y in zip(info_a["index"], info_b["index"]))
            assert_same_td(b, a)


def test_state_dict_round_trip_and_writes_after_it():
    envs = BatchedEnvs()
    (_, ours) = _pair(40, batch_size=8)
    ours.extend(envs.batch(13))
    restored = TensorDictReplayBuffer(storage=GearStorage(40, ndim=2), batch_size=8)
    restored.load_state_dict(ours.state_dict())
    _assert_same_layout(restored, ours)
    assert_same_td(restored[:], ours[:])
    assert _episodes(restored) == _episodes(ours)
    more = envs.batch(4)
    restored.extend(more.clone())
    ours.extend(more.clone())
    assert_same_td(restored[:], ours[:])
    assert _episodes(restored) == _episodes(ours) == _episodes_from_flags(ours)


@pytest.mark.parametrize("direction", ["torchrl_to_gear", "gear_to_torchrl"])
def test_state_dicts_move_between_lazy_tensor_storage_and_gear_storage(direction):
    envs = BatchedEnvs()
    theirs, ours = _pair(40, batch_size=8)
    data = envs.batch(7)
    source, target_cls = (theirs, GearStorage) if direction == "torchrl_to_gear" else (ours, LazyTensorStorage)
    source.extend(data.clone())
    target = TensorDictReplayBuffer(storage=target_cls(40, ndim=2), batch_size=8)
    target.storage.load_state_dict(source.storage.state_dict())
    assert len(target) == 28 and target.storage.shape == (7, ENVS)
    assert_same_td(target[:], source[:])
    if target_cls is GearStorage:
        assert _episodes(target) == _episodes_from_flags(target)


def test_a_damaged_state_is_refused_and_changes_nothing():
    from gear_torchrl.errors import CheckpointError

    (_, ours) = _pair(40, batch_size=8)
    ours.extend(BatchedEnvs().batch(6))
    state = ours.storage.state_dict()
    target = GearStorage(40, ndim=2)
    TensorDictReplayBuffer(storage=target, batch_size=4).extend(BatchedEnvs(seed=1).batch(2))
    before = target[:].clone()
    for damage, reason in (
        (lambda s: s.update(num_envs=3), "holds 3 env columns, this storage 4"),
        (lambda s: s.update(size=22), "not whole time steps"),
        (lambda s: s["episodes"].update(num_envs=2), "its episode index"),
        (lambda s: s["episodes"]["length"].add_(1), "env column 0"),
    ):
        damaged = {
            **state,
            "episodes": {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state["episodes"].items()},
        }
        damage(damaged)
        with pytest.raises(CheckpointError, match=reason):
            target.load_state_dict(damaged)
        assert target.shape == (2, ENVS) and torch.equal(target[:]["obs"], before["obs"])


def test_checkpoint_round_trip(tmp_path):
    envs = BatchedEnvs()
    (_, ours) = _pair(40, batch_size=8)
    ours.extend(envs.batch(13))
    ours.dumps(tmp_path)
    restored = TensorDictReplayBuffer(storage=GearStorage(40, ndim=2), batch_size=8)
    restored.loads(tmp_path)
    _assert_same_layout(restored, ours)
    assert_same_td(restored[:], ours[:])
    assert _episodes(restored) == _episodes(ours)


def test_empty_then_write_again_matches():
    envs = BatchedEnvs()
    theirs, ours = _pair(40, batch_size=8)
    for buffer in (theirs, ours):
        buffer.extend(BatchedEnvs().batch(8))
        buffer.empty()
    _assert_same_layout(ours, theirs, cursor=False)  # (TorchRL keeps the emptied storage's last cursor)
    assert ours.storage.shard.episodes.num_episodes == 0
    data = envs.batch(5)
    ours.extend(data.clone())
    theirs.extend(data.clone())
    _assert_same_layout(ours, theirs)
    assert_same_td(ours[:], theirs[:])
    assert _episodes(ours) == _episodes_from_flags(ours)


def test_in_place_write_of_an_env_column_reaches_rows_and_episodes():
    envs = BatchedEnvs(traj_ids=False)
    theirs, ours = _pair(40, dim_extend=1)
    data = envs.batch(10)  # full: rb[...] reads every time row
    ours.extend(data.clone())
    theirs.extend(data.clone())
    column = ours[[2]].clone()
    column["next", "done"][:] = False
    column["next", "done"][0, 4] = True
    ours[[2]] = column.clone()
    theirs[[2]] = column.clone()
    assert_same_td(ours[:], theirs[:])
    assert _episodes(ours) == _episodes_from_flags(ours)
    assert [length for env, _, length in _episodes(ours) if env == 2] == [5, 5]


# -- our samplers over [T, num_envs] ----------------------------------------------------------
@pytest.mark.parametrize("strict_length, burn_in", [(True, 0), (False, 2)])
def test_sequence_windows_stay_in_one_env_column_and_one_episode(strict_length, burn_in):
    envs = BatchedEnvs(done_prob=0.1)
    window = burn_in + 4
    rb = TensorDictReplayBuffer(
        storage=GearStorage(120, ndim=2),
        batch_size=20 * window,
        sampler=GearSequenceSampler(seq_len=4, burn_in=burn_in, strict_length=strict_length),
        generator=torch.Generator().manual_seed(1),
    )
    for steps in (20, 17, 9):  # wraps the 30 time rows twice
        rb.extend(envs.batch(steps))
        assert _episodes(rb) == _episodes_from_flags(rb)
        for _ in range(5):
            batch = rb.sample().view(20, window)
            mask = batch["collector", "mask"]
            for w in range(20):
                valid = mask[w]
                env, step, traj = (batch[key][w][valid] for key in ("env", "step", ("collector", "traj_ids")))
                assert valid.any() and (env == env[0]).all() and (traj == traj[0]).all()
                assert torch.equal(step, torch.arange(int(step[0]), int(step[0]) + step.numel()))
                assert not bool(batch["next", "done"][w][valid][:-1].any())  # an episode ends only at a window's end
            stored = rb.storage[tuple(batch["index"][mask].unbind(-1))]  # the coordinates name the rows read
            assert torch.equal(stored["obs"], batch["obs"][mask])


def test_sequence_windows_run_across_the_time_ring_end():
    envs = BatchedEnvs(num_envs=2, done_prob=0.0)  # one endless episode per env
    rb = TensorDictReplayBuffer(
        storage=GearStorage(20, ndim=2),
        sampler=GearSequenceSampler(seq_len=8),
        batch_size=8 * 40,
        generator=torch.Generator().manual_seed(0),
    )
    rb.extend(envs.batch(14))  # 10 time rows: the newest 10 steps, rows 4..9 then 0..3
    batch = rb.sample().view(40, 8)
    time_rows = batch["index"][..., 0]
    assert bool(((time_rows[:, 1:] - time_rows[:, :-1]) % 10 == 1).all())
    assert bool((time_rows[:, 1:] < time_rows[:, :-1]).any())  # some window wraps, and stays in order
    assert bool(((batch["step"][:, 1:] - batch["step"][:, :-1]) == 1).all())


def test_prioritized_sampler_over_env_columns():
    envs = BatchedEnvs()
    rb = TensorDictReplayBuffer(
        storage=GearStorage(40, ndim=2),
        batch_size=16,
        sampler=GearPrioritizedSampler(40, alpha=1.0, beta=0.5),
        generator=torch.Generator().manual_seed(0),
    )
    rb.extend(envs.batch(7))
    batch = rb.sample()
    t, e = batch["index"].unbind(-1)
    assert bool((t < 7).all()) and bool((e < ENVS).all())
    assert torch.equal(batch["env"], e) and torch.equal(rb.storage[(t, e)]["obs"], batch["obs"])
    priority = torch.zeros(16)
    priority[0] = 5.0  # every mass but one step's to zero: only that step is drawn
    rb.update_priority(batch["index"], priority)
    rb.update_priority(
        torch.stack(torch.meshgrid(torch.arange(7), torch.arange(ENVS), indexing="ij"), -1).reshape(-1, 2)[
            (torch.arange(28) != int(t[0]) * ENVS + int(e[0]))
        ],
        torch.zeros(27),
    )
    again = rb.sample()
    assert bool((again["index"] == batch["index"][0]).all())
    again.set("td_error", torch.ones(16))
    rb.update_tensordict_priority(again)  # TorchRL's path: the sample's [N, 2] "index"
    assert rb.sampler.total_mass == pytest.approx(1.0, rel=1e-6)  # that one step, now at priority 1


def test_prioritized_windows_over_env_columns_follow_their_keys_priorities():
    envs = BatchedEnvs()
    rb = TensorDictReplayBuffer(
        storage=GearStorage(40, ndim=2),
        batch_size=12,
        dim_extend=1,
        sampler=GearPrioritizedSequenceSampler(40, seq_len=2, alpha=1.0, reduction="start"),
        generator=torch.Generator().manual_seed(0),
    )
    for steps in (6, 7):  # the second write wraps the time ring of 10
        rb.extend(envs.batch(steps))
    batch = rb.sample()
    for window in batch.reshape(-1, 2).unbind(0):  # one env column, one episode, consecutive steps
        assert (window["env"] == window["env"][0]).all() and (window["step"].diff() == 1).all()
        assert (window["collector", "traj_ids"] == window["collector", "traj_ids"][0]).all()
    t, e = batch["index"].unbind(-1)
    assert torch.equal(batch["env"], e) and torch.equal(rb.storage[(t, e)]["obs"], batch["obs"])
    key = batch["index"][0]  # the first window's first step keys it (no burn-in)
    every = torch.stack(torch.meshgrid(torch.arange(10), torch.arange(ENVS), indexing="ij"), -1).reshape(-1, 2)
    priority = torch.where((every == key).all(-1), 5.0, 0.0)  # every key's mass to zero but that one's
    rb.update_priority(every, priority)
    again = rb.sample()
    assert bool((again["index"].view(-1, 2, 2)[:, 0] == key).all())
    assert torch.equal(again["obs"].view(-1, 2, 3)[0], batch["obs"][:2])
    assert rb.sampler.total_mass == pytest.approx(5.0, rel=1e-5)


def test_a_priority_update_skips_steps_rewritten_since_they_were_drawn():
    envs = BatchedEnvs()
    rb = TensorDictReplayBuffer(
        storage=GearStorage(40, ndim=2),
        batch_size=16,
        sampler=GearPrioritizedSampler(40, alpha=1.0, beta=0.5),
        generator=torch.Generator().manual_seed(0),
    )
    rb.extend(envs.batch(10))  # full: the next write overwrites time rows 0..2
    batch = rb.sample()
    rb.extend(envs.batch(3))
    batch.set("td_error", torch.full((16,), 7.0))
    rb.update_tensordict_priority(batch)
    t, e = batch["index"].unbind(-1)
    masses = rb.sampler.masses(t * ENVS + e)  # (the sampler's own rows are flat: t * num_envs + e)
    rewritten = t < 3
    assert rewritten.any() and (~rewritten).any()
    assert torch.allclose(masses[~rewritten], torch.tensor(7.0, dtype=masses.dtype))
    assert bool((masses[rewritten] < 7.0).all())


def test_writes_of_any_length_keep_rows_and_episodes_as_torchrl_and_the_flags_say():
    generator = torch.Generator().manual_seed(3)
    theirs, ours = _pair(36, dim_extend=1)  # 12 time rows of 3 envs
    envs = BatchedEnvs(num_envs=3, done_prob=0.2, seed=3)
    for _ in range(12):
        data = envs.batch(int(torch.randint(2, 16, (1,), generator=generator)))  # (T=1 trips TorchRL itself)
        ours.extend(data.clone())
        theirs.extend(data.clone())
        _assert_same_layout(ours, theirs)
        assert_same_td(ours[:], theirs[:])
        assert _episodes(ours) == _episodes_from_flags(ours)


def test_a_pickled_copy_reads_the_same_steps():
    import pickle

    rb = TensorDictReplayBuffer(storage=GearStorage(40, ndim=2), batch_size=4)
    rb.extend(BatchedEnvs().batch(6))
    copy = pickle.loads(pickle.dumps(rb.storage))
    assert copy.ndim == 2 and copy.shape == rb.storage.shape
    assert_same_td(copy[:], rb.storage[:])


def test_queue_and_top_k_samplers_give_time_env_coordinates():
    from gear_torchrl import QueueSampler, TopKSampler

    for sampler, expected_steps in (
        (QueueSampler(40), [0, 0, 0, 0, 1, 1, 1, 1]),  # oldest time step first
        (TopKSampler(40, key="step"), [4, 4, 4, 4, 3, 3, 3, 3]),
    ):  # largest "step"
        rb = TensorDictReplayBuffer(storage=GearStorage(40, ndim=2), sampler=sampler, batch_size=8)
        rb.extend(BatchedEnvs().batch(5))
        batch = rb.sample()
        t, e = batch["index"].unbind(-1)
        assert batch["step"].tolist() == expected_steps and torch.equal(batch["env"], e)
        assert torch.equal(rb.storage[(t, e)]["obs"], batch["obs"])


def test_a_data_loader_over_the_storage_passes_over_every_step_once():
    from torch.utils.data import DataLoader

    storage = GearStorage(40, ndim=2)
    TensorDictReplayBuffer(storage=storage, batch_size=4).extend(BatchedEnvs().batch(6))
    seen = torch.cat(
        [
            batch["step"] * ENVS + batch["env"]
            for batch in DataLoader(as_dataset(storage), batch_size=5, shuffle=True, collate_fn=lambda rows: rows)
        ]
    )
    assert sorted(seen.tolist()) == list(range(24))


def test_uniform_selection_names_stored_steps():
    from gear_torchrl.selection.uniform import UniformSpec

    envs = BatchedEnvs()
    storage = GearStorage(40, ndim=2)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=8)
    rb.extend(envs.batch(6))
    t, e = storage.table.select(UniformSpec().build(40), 500, torch.Generator().manual_seed(0)).index
    assert bool((t >= 0).all() & (t < 6).all() & (e >= 0).all() & (e < ENVS).all())
    assert len(set(zip(t.tolist(), e.tolist()))) == 24  # every stored step drawn at least once
    assert torch.equal(storage[(t, e)]["env"], e)


def test_collector_trajectory_ids_delimit_episodes_without_done_flags():
    envs = BatchedEnvs()
    data = envs.batch(12).exclude(("next", "done"))  # only the collector's ids mark trajectories
    rb = TensorDictReplayBuffer(storage=GearStorage(80, ndim=2), batch_size=8)
    rb.extend(data)
    assert rb.storage.shard.traj_key == ("collector", "traj_ids")
    ids = rb[:]["collector", "traj_ids"]
    expected = sorted((env, *_runs(ids[env])[k]) for env in range(ENVS) for k in range(len(_runs(ids[env]))))
    assert sorted((env, start, length) for env, start, length in _episodes(rb)) == expected


# -- refused: clearly, and nothing changes ------------------------------------------------------
def test_a_batch_of_another_number_of_envs_is_refused_and_changes_nothing():
    envs = BatchedEnvs()
    theirs, ours = _pair(40, batch_size=8)
    first = envs.batch(3)
    ours.extend(first.clone())
    theirs.extend(first.clone())
    before, episodes = ours[:].clone(), _episodes(ours)
    with pytest.raises(ValueError, match="holds 4 env columns.*the data has 3"):
        ours.extend(BatchedEnvs(num_envs=3).batch(2))
    assert_same_td(ours[:], before)
    assert _episodes(ours) == episodes
    _assert_same_layout(ours, theirs)
    more = envs.batch(2)  # the next good write lands where it would have
    ours.extend(more.clone())
    theirs.extend(more.clone())
    assert_same_td(ours[:], theirs[:])


def test_a_batch_missing_a_stored_key_is_refused_and_the_next_write_lands_where_it_would_have():
    from gear_torchrl.errors import SpecMismatchError

    envs = BatchedEnvs()
    theirs, ours = _pair(40, batch_size=8)
    first = envs.batch(4)
    ours.extend(first.clone())
    theirs.extend(first.clone())
    before = ours[:].clone()
    with pytest.raises(SpecMismatchError, match="missing.*obs"):
        ours.extend(envs.batch(3).exclude("obs"))
    assert_same_td(ours[:], before)
    more = envs.batch(3)
    ours.extend(more.clone())
    theirs.extend(more.clone())
    _assert_same_layout(ours, theirs)
    assert_same_td(ours[:], theirs[:])


def test_reads_outside_the_stored_steps_are_refused_naming_the_index():
    storage = GearStorage(40, ndim=2)
    TensorDictReplayBuffer(storage=storage, batch_size=4).extend(BatchedEnvs().batch(3))
    with pytest.raises(IndexError, match="time row index 3 is out of range for 3 time rows"):
        storage[(torch.tensor([0, 3]), torch.tensor([0, 0]))]
    with pytest.raises(IndexError, match="env index 4 is out of range for 4 envs"):
        storage[(torch.tensor([0]), torch.tensor([4]))]
    with pytest.raises(IndexError):
        storage[torch.tensor([5])]


def test_a_capacity_that_is_not_whole_time_steps_is_refused_before_anything_is_laid_out():
    rb = TensorDictReplayBuffer(storage=GearStorage(10, ndim=2), batch_size=2)
    with pytest.raises(ValueError, match="multiple of the number of envs"):
        rb.extend(BatchedEnvs(num_envs=4).batch(4))  # the writer's cursor went round a ring of 3 time rows
    assert len(rb) == 0 and rb.storage.shape is None and writer_cursor(rb) == 0  # and came back
    rb.extend(BatchedEnvs(num_envs=5).batch(3))  # 10 = 2 time steps of 5 envs
    assert rb.storage.shape == (2, 5) and len(rb) == 10


def test_rows_that_are_not_time_steps_of_envs_are_refused():
    rb = ReplayBuffer(storage=GearStorage(10, ndim=2), batch_size=2, dim_extend=0)
    with pytest.raises(ValueError, match=r"takes \[T, num_envs\] steps"):
        rb.extend(torch.arange(6))
    assert len(rb) == 0 and rb.storage.shape is None


def test_priorities_must_name_steps_by_time_and_env():
    rb = TensorDictReplayBuffer(
        storage=GearStorage(40, ndim=2), batch_size=4, sampler=GearPrioritizedSampler(40, alpha=1.0, beta=0.5)
    )
    rb.extend(BatchedEnvs().batch(5))
    mass = rb.sampler.total_mass
    with pytest.raises(IndexError, match=r"\(time, env\) coordinates"):
        rb.update_priority(torch.tensor([0, 1]), torch.tensor([3.0, 3.0]))
    with pytest.raises(IndexError, match="env index 7 is out of range"):
        rb.update_priority(torch.tensor([[0, 7]]), torch.tensor([3.0]))
    assert rb.sampler.total_mass == mass


@pytest.mark.parametrize(
    "kwargs", [{"device": "cuda"}, {"device": "cuda", "memory": "device"}, {"device": "cuda", "shared": True}]
)
def test_gpu_ndim2_stores_are_refused_with_why(kwargs):
    with pytest.raises(NotImplementedError, match="on the CPU so far"):
        GearStorage(40, ndim=2, **kwargs)


def test_what_does_not_follow_env_columns_yet_is_refused():
    storage = GearStorage(40, ndim=2)
    TensorDictReplayBuffer(storage=storage, batch_size=4).extend(BatchedEnvs().batch(5))
    with pytest.raises(NotImplementedError, match="TrajectoryWriter appends the steps of one episode"):
        writer = TrajectoryWriter(storage)
        writer.extend(BatchedEnvs().batch(3)[0])
        writer.end_episode()
    rb = TensorDictReplayBuffer(
        storage=storage, sampler=GearSequenceSampler(seq_len=2, cross_ring_end=False), batch_size=4
    )
    with pytest.raises(NotImplementedError, match="cross_ring_end=False"):
        rb.sample()
    assert len(storage) == 20


# -- item 11: a 1-D store given [num_envs, T] rows says so ---------------------------------------
def test_a_1d_store_given_env_batches_warns_and_windows_name_ndim2(caplog):
    rb = TensorDictReplayBuffer(storage=GearStorage(100), sampler=GearSequenceSampler(seq_len=2), batch_size=4)
    with caplog.at_level(logging.WARNING, logger="gear_torchrl.store.shard"):
        rb.extend(BatchedEnvs().batch(6))  # 4 rows of [6] steps each
    assert "are not single steps" in caplog.text and "ndim=2" in caplog.text
    with pytest.raises(RuntimeError, match=r"GearStorage\(max_size, ndim=2\)"):
        rb.sample()


# -- oracles ------------------------------------------------------------------------------------
def _episodes(rb) -> list[tuple[int, int, int]]:
    """``(env, start time row, length)`` of every live episode in the storage's index."""
    view = rb.storage.shard.episodes.live()
    return sorted(zip(view.env.tolist(), view.start.tolist(), view.length.tolist()))


def _episodes_from_flags(rb) -> list[tuple[int, int, int]]:
    """The same, derived from the stored done flags and trajectory ids, oldest step first in each column."""
    storage = rb.storage
    steps, envs = storage.shape
    cursor = storage._last_cursor_index
    order = (torch.arange(steps) + (cursor + 1 if storage._is_full else 0)) % steps
    data = storage[:][order]
    out = []
    for env in range(envs):
        ends = data["next", "done"][:, env].reshape(-1).clone()
        if ("collector", "traj_ids") in data.keys(True):
            ids = data["collector", "traj_ids"][:, env]
            ends[:-1] |= ids[1:] != ids[:-1]
        start = 0
        for t in range(steps):
            if bool(ends[t]) or t == steps - 1:
                out.append((env, int(order[start]), t + 1 - start))
                start = t + 1
    return sorted(out)


def _runs(ids: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, length)`` of runs of equal ids (a column not wrapped yet)."""
    runs, start = [], 0
    for t in range(1, ids.numel() + 1):
        if t == ids.numel() or ids[t] != ids[start]:
            runs.append((start, t - start))
            start = t
    return runs


def test_a_rate_limiter_counts_steps_of_every_env():
    """Inserts and samples are steps ((time, env) pairs), so the rule reads as for a 1-D store."""
    import threading
    import time

    from gear_torchrl import GearUniformSampler, MinSize, RateLimiterTimeout, SampleToInsertRatio

    rb = TensorDictReplayBuffer(
        storage=GearStorage(64, ndim=2, rate_limiter=MinSize(24, timeout=0.2)),
        sampler=GearUniformSampler(),
        dim_extend=1,
        batch_size=8,
    )
    envs = BatchedEnvs(num_envs=4)
    rb.extend(envs.batch(5))  # [4 envs, 5 time steps]: 20 steps
    assert rb.storage.rate_limiter.inserts == 20
    with pytest.raises(RateLimiterTimeout, match="sampling needs 24 inserted rows"):
        rb.sample()
    rb.extend(envs.batch(2))  # (TorchRL's TensorDictReplayBuffer cannot extend ndim=2 by one time step)
    assert rb.sample().batch_size == torch.Size([8]) and rb.storage.rate_limiter.samples == 8

    limiter = SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=8, error_buffer=8.0, timeout=10)
    rb = TensorDictReplayBuffer(
        storage=GearStorage(64, ndim=2, rate_limiter=limiter), sampler=GearUniformSampler(), dim_extend=1, batch_size=8
    )
    envs = BatchedEnvs(num_envs=4)
    rb.extend(envs.batch(4))  # 16 steps: diff 16 = offset 8 + 8, the most the rule allows
    done = threading.Event()

    def insert() -> None:
        rb.extend(envs.batch(2))
        done.set()

    inserter = threading.Thread(target=insert)
    inserter.start()
    time.sleep(0.3)
    assert not done.is_set() and len(rb) == 16  # 8 more steps must wait for 8 samples
    rb.sample()
    inserter.join(timeout=10)
    assert done.is_set() and len(rb) == 24 and limiter.inserts == 24 and limiter.samples == 8
