"""``GearStorage(max_size, ndim=2, shared=True)``: ``[T, num_envs]`` steps that many processes append.

The same shard as a local ``ndim=2`` store (its env-column addressing) with a
shared store's visibility: every process's commits, published with the number
of envs. Checked against what the data says: the live time steps are the
newest written, windows stay in one env column, one episode and one commit,
and a process that brings another number of envs is refused.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from helpers import SliceKeys, assert_same_td
from ndim2_workers import ENVS, EnvSteps, extend_batches
from tensordict import TensorDict
from torchrl.data import (
    LazyTensorStorage,
    RandomSampler,
    SamplerWithoutReplacement,
    SliceSampler,
    TensorDictReplayBuffer,
)

from gear_torchrl import (
    GearPrioritizedSequenceSampler,
    GearSequenceSampler,
    GearStorage,
    GearUniformSampler,
    TrajectoryWriter,
)

pytestmark = pytest.mark.usefixtures("no_shm_leaks")
CTX = mp.get_context("spawn")
JOIN_S = 120


def _buffer(storage: GearStorage, sampler=None, batch_size: int = 8) -> TensorDictReplayBuffer:
    return TensorDictReplayBuffer(
        storage=storage,
        sampler=sampler,
        batch_size=batch_size,
        dim_extend=1,
        generator=torch.Generator().manual_seed(0),
    )


def _time_steps(batches: list[TensorDict], keep: int) -> TensorDict:
    """The newest ``keep`` time steps of ``[num_envs, T]`` batches, as ``[T, num_envs]``."""
    return torch.cat([b.transpose(0, 1) for b in batches])[-keep:]


def test_live_time_steps_are_the_newest_written_oldest_first_through_wraps():
    envs, written = EnvSteps(), []
    shared = GearStorage(40, ndim=2, shared=True)  # 10 time steps of 4 envs
    local = GearStorage(40, ndim=2)
    try:
        ours, theirs = _buffer(shared), _buffer(local)
        for steps in (3, 4, 6, 13):  # the last two wrap the time ring; 13 > 10 keeps the newest 10
            data = envs.batch(steps)
            written.append(data)
            ours.extend(data.clone())
            theirs.extend(data.clone())
            # A shared store evicts a block ahead of its writers (store/commit_log.py): whole time steps here.
            kept, newest = len(shared) // ENVS, min(10, sum(b.shape[1] for b in written))
            assert len(shared) % ENVS == 0 and newest - 2 <= kept <= newest and shared.shape == (kept, ENVS)
            assert_same_td(shared[:].exclude("index"), _time_steps(written, kept))
            assert_same_td(
                shared[torch.tensor([0, kept - 1])].exclude("index"), _time_steps(written, kept)[[0, kept - 1]]
            )
            t, e = torch.tensor([0, kept - 1]), torch.tensor([3, 1])
            assert_same_td(shared[(t, e)].exclude("index"), _time_steps(written, kept)[t, e])
            # With trajectory ids, commits continue episodes: each column's episodes are its done-delimited runs.
            done = _time_steps(written, kept)["next", "done"].squeeze(-1)
            assert shared.shard.episodes.state()["episodes_per_env"] == (done[:-1].sum(0) + 1).tolist()
    finally:
        shared.close()


def _assert_window_in_one_episode(window: TensorDict, traj_ids: bool) -> None:
    """One env, one writer, consecutive steps; one trajectory, or (without ids) one commit, since the next
    rows in the ring may be another process's."""
    for key in ("env", "writer", ("collector", "traj_ids") if traj_ids else "batch"):
        assert (window[key] == window[key][0]).all(), f"a window crosses {key}: {window[key].tolist()}"
    assert (window["step"].diff() == 1).all(), f"a window skips steps: {window['step'].tolist()}"
    assert not window["next", "done"][:-1].any(), "a window runs past an episode's end"


@pytest.mark.parametrize("traj_ids", [True, False])
def test_two_writer_processes_append_time_steps_and_windows_never_cross_them(traj_ids):
    storage = GearStorage(4 * 64, ndim=2, shared=True)
    try:
        writers = [CTX.Process(target=extend_batches, args=(storage.handle, w, 12, traj_ids)) for w in (1, 2)]
        for p in writers:
            p.start()
        for p in writers:
            p.join(JOIN_S)
            assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"
        # 2 x 12 batches of 3-5 steps wrap the ring; eviction runs a block (whole time steps) ahead of writers
        assert len(storage) % ENVS == 0 and 4 * 62 <= len(storage) <= 4 * 64 and storage.shard.num_envs == ENVS
        for sampler in (GearSequenceSampler(seq_len=3), GearPrioritizedSequenceSampler(4 * 64, seq_len=3)):
            batch = _buffer(storage, sampler, batch_size=3 * 64).sample()
            for window in batch.reshape(-1, 3).unbind(0):
                _assert_window_in_one_episode(window, traj_ids)
        rows = _buffer(storage, GearUniformSampler(), batch_size=64).sample()
        assert set(rows["writer"].unique().tolist()) <= {1, 2}
        assert (rows["obs"][:, 0] == rows["step"] * 10 + rows["env"] + 1000 * rows["writer"]).all()
    finally:
        storage.close()


def test_torchrl_random_sampler_reads_live_steps():
    storage = GearStorage(40, ndim=2, shared=True)
    try:
        rb = _buffer(storage, RandomSampler(), batch_size=32)
        envs = EnvSteps()
        for steps in (6, 9):
            rb.extend(envs.batch(steps))
        batch = rb.sample()
        assert batch.shape == torch.Size([32])
        assert (batch["step"] >= 5).all()  # the 10 newest time steps: 5..14
        assert (batch["obs"][:, 0] == batch["step"] * 10 + batch["env"]).all()
    finally:
        storage.close()


def test_another_process_with_another_number_of_envs_is_refused_and_changes_nothing():
    storage = GearStorage(40, ndim=2, shared=True)
    try:
        rb = _buffer(storage)
        rb.extend(EnvSteps().batch(3))
        other = GearStorage(0, handle=storage.handle)  # attaches as ndim=2 from the handle
        assert other.ndim == 2
        with pytest.raises(ValueError, match="holds 4 env columns"):
            _buffer(other).extend(EnvSteps(num_envs=2).batch(3))
        assert len(storage) == 12 and len(other) == 12
        _buffer(other).extend(EnvSteps(seed=1).batch(2))
        assert len(storage) == 20
    finally:
        storage.close()


def test_a_trajectory_writer_is_refused_before_it_stages_anything():
    storage = GearStorage(40, ndim=2, shared=True)
    try:
        with pytest.raises(NotImplementedError, match="TrajectoryWriter appends the steps of one episode"):
            TrajectoryWriter(storage)
        assert len(storage) == 0 and storage.shard.rows_inserted == 0
    finally:
        storage.close()


def test_a_checkpoint_round_trips_to_a_shared_or_local_store_with_the_same_episodes(tmp_path):
    storage = GearStorage(40, ndim=2, shared=True)
    try:
        rb = _buffer(storage)
        envs = EnvSteps(traj_ids=False)
        for steps in (4, 5, 6):  # without trajectory ids: each commit's end ends every column's episode
            rb.extend(envs.batch(steps))
        rb.dumps(tmp_path / "ckpt")
        expected = storage[:]
        episodes = storage.shard.episodes.state()
        for target in (GearStorage(40, ndim=2, shared=True), GearStorage(40, ndim=2)):
            try:
                _buffer(target).loads(tmp_path / "ckpt")
                assert_same_td(target[:], expected)
                loaded = target.shard.episodes.state()
                assert loaded["episodes_per_env"] == episodes["episodes_per_env"]
                assert torch.equal(loaded["length"], episodes["length"])
                assert torch.equal(loaded["closed"], episodes["closed"])
            finally:
                target.close()
    finally:
        storage.close()


@pytest.mark.parametrize("variant", ["traj_key", "end_key"])
def test_torchrl_slice_sampler_reads_windows_of_live_steps(variant):
    """TorchRL's SliceSampler scans ``storage[:]`` for its markers, then reads its windows: both number the
    same live steps (the scan holds them)."""
    storage = GearStorage(4 * 32, ndim=2, shared=True)
    try:
        kwargs: SliceKeys = (
            {"traj_key": ("collector", "traj_ids")} if variant == "traj_key" else {"end_key": ("next", "done")}
        )
        rb = _buffer(storage, SliceSampler(slice_len=4, strict_length=True, **kwargs), batch_size=32)
        envs = EnvSteps(done_prob=0.1)
        for steps in (10, 12, 14):  # wraps the ring of 32 time steps
            rb.extend(envs.batch(steps))
        for window in rb.sample().reshape(-1, 4).unbind(0):
            _assert_window_in_one_episode(window, traj_ids=True)
    finally:
        storage.close()


@pytest.mark.parametrize(
    "sampler",
    [RandomSampler, SamplerWithoutReplacement, lambda: SliceSampler(slice_len=4, traj_key=("collector", "traj_ids"))],
)
def test_before_the_ring_wraps_torchrl_samplers_draw_what_lazy_tensor_storage_draws(sampler):
    """Live time steps numbered oldest first are LazyTensorStorage's slots until the ring wraps."""
    storage = GearStorage(40, ndim=2, shared=True)
    try:
        ours, theirs = (
            TensorDictReplayBuffer(
                storage=s, sampler=sampler(), batch_size=8, dim_extend=1, generator=torch.Generator().manual_seed(0)
            )
            for s in (storage, LazyTensorStorage(40, ndim=2))
        )
        envs = EnvSteps()
        for steps in (3, 4):
            data = envs.batch(steps)
            ours.extend(data.clone())
            theirs.extend(data.clone())
        for _ in range(3):
            assert_same_td(ours.sample(), theirs.sample())
    finally:
        storage.close()
