"""The episode index stays equal to a brute-force split of the stored steps."""

from __future__ import annotations

import pytest
import torch
from episode_model import model_episodes
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from gear_torchrl import GearStorage
from gear_torchrl.store.addressing import EnvColumns
from gear_torchrl.store.env_episodes import EnvEpisodes
from gear_torchrl.store.shard import Shard


def steps_td(first: int, dones: list[bool], traj: list[int] | None = None) -> TensorDict:
    n = len(dones)
    td = TensorDict({"step": torch.arange(first, first + n), ("next", "done"): torch.tensor(dones).view(n, 1)}, [n])
    if traj is not None:
        td["traj"] = torch.tensor(traj)
    return td


def live_tuples(shard: Shard):
    v = shard.episodes.live()
    return list(zip(v.start.tolist(), v.length.tolist(), v.closed.tolist()))


def check_against_model(capacity, batches, use_traj=False):
    shard = Shard(capacity, traj_key="traj" if use_traj else None)
    history = []
    g = 0
    for dones, trajs in batches:
        shard.write(
            torch.arange(g, g + len(dones)) % capacity, steps_td(g, dones, trajs if use_traj else None), append=True
        )
        history += [(g + i, d, trajs[i] if use_traj else None) for i, d in enumerate(dones)]
        g += len(dones)
        assert live_tuples(shard) == model_episodes(history, capacity)
        assert sum(length for _, length, _ in live_tuples(shard)) == shard.size


def test_trim_and_drop_across_the_ring_end():
    check_against_model(
        8,
        [
            ([False, False, True, False, False], None),
            ([False, True, False, False, True, False], None),
            ([False] * 3, None),
        ],
    )


def test_episode_longer_than_the_ring_stays_one_open_episode():
    check_against_model(5, [([False] * 3, None), ([False] * 4, None), ([False] * 12, None), ([True], None)])


def test_write_bigger_than_capacity_with_an_end_in_the_dropped_part():
    check_against_model(4, [([False, False], None), ([False, True, False, False, False, False, False], None)])


def test_trajectory_ids_split_episodes():
    check_against_model(
        10, [([False] * 4, [1, 1, 2, 2]), ([False] * 3, [2, 3, 3]), ([False] * 6, [4] * 6)], use_traj=True
    )


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 12),
    batches=st.lists(st.lists(st.booleans(), min_size=1, max_size=20), min_size=1, max_size=8),
)
def test_incremental_index_equals_model(capacity, batches):
    check_against_model(capacity, [(b, None) for b in batches])


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(1, 12),
    batches=st.lists(
        st.lists(st.tuples(st.booleans(), st.integers(0, 2)), min_size=1, max_size=15), min_size=1, max_size=6
    ),
)
def test_incremental_index_equals_model_with_traj_ids(capacity, batches):
    check_against_model(capacity, [([d for d, _ in b], [t for _, t in b]) for b in batches], use_traj=True)


@settings(max_examples=120, deadline=None)
@given(
    capacity=st.integers(1, 12),
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 2)), min_size=1, max_size=40),
    use_traj=st.booleans(),
)
def test_one_step_writes_equal_model_and_log_every_change(capacity, steps, use_traj):
    """One-step appends (``rb.add``) take their own path: same episodes, and readers hear of every change."""
    check_against_model(capacity, [([d], [t]) for d, t in steps], use_traj=use_traj)
    shard = Shard(capacity, traj_key="traj" if use_traj else None)
    for g, (done, traj) in enumerate(steps):
        index = shard.episodes
        before = (index.start.clone(), index.length.clone(), index.closed.clone(), index.position)
        shard.write(torch.tensor([g % capacity]), steps_td(g, [done], [traj] if use_traj else None), append=True)
        changed = index.changed_since(before[3])
        if changed is None or index.start.numel() != before[0].numel():
            continue  # slots remapped: readers rebuild
        differs = (index.start != before[0]) | (index.length != before[1]) | (index.closed != before[2])
        assert set(differs.nonzero().flatten().tolist()) <= set(changed.tolist())


def test_in_place_write_rebuilds_the_index():
    storage = GearStorage(10)
    storage.set(torch.arange(6), steps_td(0, [False] * 6))
    assert live_tuples(storage.shard) == [(0, 6, False)]
    storage[2] = steps_td(2, [True])[0]
    assert live_tuples(storage.shard) == [(0, 3, True), (3, 3, False)]


def test_per_episode_memory_grows_with_episodes_not_rows():
    storage = GearStorage(100_000)
    storage.set(torch.arange(50_000), steps_td(0, ([False] * 999 + [True]) * 50))
    assert storage.shard.episodes.num_episodes == 50
    assert storage.shard.episodes.start.numel() <= 64


# -- a [T, num_envs] store: every env column is its own index, all updated in one pass ---------------
def env_steps_td(first: int, dones: list[list[bool]], traj: list[list[int]] | None) -> TensorDict:
    """``len(dones)`` time steps of ``len(dones[0])`` envs, as the flat rows ``t * envs + e``."""
    steps, envs = len(dones), len(dones[0])
    td = TensorDict(
        {
            "step": torch.arange(first, first + steps).repeat_interleave(envs),
            ("next", "done"): torch.tensor(dones).view(steps * envs, 1),
        },
        [steps * envs],
    )
    if traj is not None:
        td["traj"] = torch.tensor(traj).view(steps * envs)
    return td


@settings(max_examples=120, deadline=None)
@given(
    time_capacity=st.integers(1, 8),
    envs=st.integers(1, 4),
    use_traj=st.booleans(),
    batches=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 2**32 - 1)), min_size=1, max_size=8),
)
def test_env_columns_each_equal_the_model_and_readers_hear_of_every_change(time_capacity, envs, use_traj, batches):
    shard = Shard(time_capacity * envs, traj_key="traj" if use_traj else None, addressing=EnvColumns)
    addressing = shard.addressing
    assert isinstance(addressing, EnvColumns)
    addressing.lay_out(envs)
    history: list[list[tuple[int, bool, int | None]]] = [[] for _ in range(envs)]
    g = 0
    for steps, seed in batches:
        gen = torch.Generator().manual_seed(seed)
        dones = (torch.rand(steps, envs, generator=gen) < 0.3).tolist()
        trajs = torch.randint(0, 2, (steps, envs), generator=gen).tolist() if use_traj else None
        index = shard.episodes
        assert isinstance(index, EnvEpisodes), type(index)  # env columns' episodes
        before = (index.start.clone(), index.length.clone(), index.closed.clone(), index.position)
        rows = (torch.arange(g * envs, (g + steps) * envs)) % (time_capacity * envs)
        shard.write(rows, env_steps_td(g, dones, trajs), append=True)
        for e in range(envs):
            history[e] += [(g + t, dones[t][e], trajs[t][e] if trajs else None) for t in range(steps)]
        g += steps
        view = index.live()
        assert view.env is not None
        for e in range(envs):
            mine = view.env == e
            got = list(zip(view.start[mine].tolist(), view.length[mine].tolist(), view.closed[mine].tolist()))
            assert got == model_episodes(history[e], time_capacity), f"env column {e}"
        # Every stored step is found in its own episode, at its offset; rows_of lists them back.
        live_slots = torch.arange(envs * index.slots)[index.slot_is_live(torch.arange(envs * index.slots))]
        rows = index.rows_of(live_slots)
        slots, offset, found = index.locate(rows)
        owner = live_slots.repeat_interleave(index.length[live_slots])
        assert bool(found.all()) and torch.equal(slots, owner)
        assert torch.equal(
            offset,
            torch.cat(
                [torch.arange(n) for n in index.length[live_slots].tolist()] or [torch.empty(0, dtype=torch.int64)]
            ),
        )
        assert sorted(rows.tolist()) == sorted(set(rows.tolist())) and rows.numel() == min(g, time_capacity) * envs
        changed = index.changed_since(before[3])
        if changed is None or index.start.numel() != before[0].numel():
            continue  # the records were remapped: readers rebuild
        differs = (index.start != before[0]) | (index.length != before[1]) | (index.closed != before[2])
        assert set(differs.nonzero().flatten().tolist()) <= set(changed.tolist())


def test_the_kernel_refuses_records_without_room_and_changes_nothing():
    from gear_torchrl.kernels import _C

    start, length = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64)
    closed, dead = torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.bool)
    first, nxt = torch.tensor([0]), torch.tensor([1])  # one live episode, closed
    length[0, 0] = 3
    ends = torch.tensor([[True], [True], [False]])  # three new episodes: four live, two slots
    with pytest.raises(RuntimeError, match="needs room for 4 episodes, its records have 2 slots"):
        _C.episodes_append(start, length, closed, dead, first, nxt, torch.arange(3, 6), ends, 0, 8)
    assert first.tolist() == [0] and nxt.tolist() == [1] and length.tolist() == [[3, 0]]
    # One new step, overwriting the three stored ones: the old episode goes, the new one takes the next slot.
    changed = _C.episodes_append(start, length, closed, dead, first, nxt, torch.tensor([3]), ends[2:], 3, 8)
    assert (first.tolist(), nxt.tolist()) == ([1], [2]) and start[0, 1] == 3 and length[0, 1] == 1
    assert sorted(changed.tolist()) == [0, 1] and not closed[0, 1]


def _leaves_of(dones: list[bool]):
    from gear_torchrl.store.ring import as_leaves
    from gear_torchrl.store.table_spec import TableSpec

    td = steps_td(0, dones)
    return as_leaves(td, False, TableSpec.from_data(td, 1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40), st.booleans())
def test_an_extend_is_cut_at_its_episode_ends_into_at_most_three_routed_parts(dones, continues):
    """``episode_parts``: the parts rebuild the extend in order; every part but an unfinished last one ends an
    episode; an open episode's rest is a part of its own (it goes to its shard), the whole episodes after it
    are one part, and only the trailing unfinished episode is left open."""
    from gear_torchrl.adapters.sharded_writes import episode_parts

    leaves = _leaves_of(dones)
    parts = episode_parts(leaves, [("next", "done")], continues=continues)
    step = leaves.spec.position("step")
    rebuilt = torch.cat([p.values[step] for p, _ in parts])
    assert torch.equal(rebuilt, torch.arange(len(dones))) and sum(p.n for p, _ in parts) == len(dones)
    ends = [i for i, d in enumerate(dones) if d]
    bounds = [0]
    for p, _ in parts:
        bounds.append(bounds[-1] + p.n)
    for (part, closes), first, stop in zip(parts, bounds, bounds[1:]):
        assert part.n > 0
        assert closes == dones[stop - 1], "a part ends an episode exactly when its last step does"
        if not closes:
            assert not any(dones[first:stop]) and stop == len(dones), "only a trailing unfinished part stays open"
    expected = (1 if continues and len(ends) > 1 else 0) + (1 if ends else 0) + (0 if dones[-1] else 1)
    assert len(parts) == expected
    if continues and len(ends) > 1:
        assert bounds[1] == ends[0] + 1, "the open episode's rest goes alone to its shard"


def test_rows_that_carry_no_end_key_are_one_unit():
    from gear_torchrl.adapters.sharded_writes import episode_parts

    parts = episode_parts(_leaves_of([False, False, False]), [("next", "terminated")], continues=True)
    assert [(p.n, closes) for p, closes in parts] == [(3, True)]
