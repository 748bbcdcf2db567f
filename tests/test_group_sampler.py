"""GearGroupSampler against oracles written from its rules: every drawn group is whole, complete, fresh by
its oldest member and (consume-once) new; every eligible group is drawn; strategies pick what brute force
says; the state survives a checkpoint; bad input is refused and changes nothing."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import warnings

import pytest
import shared_workers as w
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from gear_torchrl import GearGroupSampler, GearStorage, TrajectoryWriter
from gear_torchrl.errors import CheckpointError

SIZE = 4  # members per group


def _group(gid: int, n: int, version: int, reward: torch.Tensor | None = None) -> TensorDict:
    data = w.group_rows(gid, n, torch.rand(n) if reward is None else reward)
    data["policy_version"] = torch.full((n,), version)
    return data


def _groups_of(storage: GearStorage) -> dict[int, dict]:
    """The oracle's view: each stored group id's rows, oldest version and rewards, read back from the storage."""
    n = len(storage)
    found: dict[int, dict] = {}
    if n == 0:
        return found
    rows = storage[torch.arange(n)]
    for row in range(n):
        gid = int(rows["query"][row])
        g = found.setdefault(gid, {"rows": [], "versions": []})
        g["rows"].append(row)
        g["versions"].append(int(rows["policy_version"][row]))
    return found


def _eligible(storage, consumer: int, bound: int, consumed: set[int]) -> set[int]:
    return {
        gid
        for gid, g in _groups_of(storage).items()
        if len(g["rows"]) == SIZE and min(g["versions"]) >= consumer - bound and gid not in consumed
    }


def _batch_groups(batch, per_group: int) -> list[int]:
    """The group ids of a batch laid out group after group (each block is one group, whole)."""
    ids = batch["query"].reshape(-1, per_group)
    assert bool((ids == ids[:, :1]).all()), f"a block mixes groups: {ids.tolist()}"
    return ids[:, 0].tolist()


@pytest.mark.parametrize("shared", [False, True])
def test_only_complete_fresh_groups_are_drawn_and_every_one_is(shared):
    """Groups written a member at a time (some never completed), versions rising, the ring lapping."""
    storage = GearStorage(60, shared=shared)
    sampler = GearGroupSampler(samples_per_group=SIZE, group_size=SIZE, max_staleness=1)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=2 * SIZE)
    rb.set_rng(torch.Generator().manual_seed(0))
    writer = TrajectoryWriter(storage)
    gid = 0
    for version in range(8):
        for g in range(3):
            members = SIZE - 1 if g == 2 else SIZE  # every third group stays incomplete
            for _ in range(members):  # members interleaved with the other groups' would be the same
                writer.extend(_group(gid + g, 1, version))
                writer.end_episode()
        gid += 3
        sampler.consumer_version = version + (version % 2)  # sometimes ahead of the newest data by one
        eligible = _eligible(storage, sampler.consumer_version, 1, set())
        if len(eligible) < 2:
            continue
        drawn: set[int] = set()
        for _ in range(40):
            batch = rb.sample()
            groups = _batch_groups(batch, SIZE)
            assert set(groups) <= eligible, (version, groups, eligible)
            staleness = batch.get("staleness") if "staleness" in batch.keys() else None
            assert staleness is None or int(staleness.max()) <= 1
            drawn |= set(groups)
            for block in batch["index"].reshape(-1, SIZE):
                assert len(set(block.tolist())) == SIZE  # a group's rows, each once
        assert drawn == eligible, (version, drawn, eligible)
    storage.close()


def test_staleness_is_reported_per_row_and_judged_by_the_oldest_member():
    storage = GearStorage(40)
    sampler = GearGroupSampler(num_groups=1, group_size=SIZE, max_staleness=1)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=SIZE)
    rb.extend(torch.cat([_group(7, 3, 5), _group(7, 1, 3)]))  # one member older: stale at consumer 5
    rb.extend(_group(8, SIZE, 4))
    sampler.consumer_version = 5
    batch, info = rb.sample(return_info=True)
    assert batch["query"].tolist() == [8] * SIZE
    assert info["staleness"].tolist() == [1] * SIZE
    sampler.increment_consumer_version()  # 6: group 8 (version 4) is stale too
    with pytest.raises(RuntimeError, match=r"only 0 groups of the 2 stored are eligible .*max_staleness=1"):
        rb.sample()


def test_consume_once_never_repeats_a_group_and_fifo_serves_the_oldest_complete_first():
    storage = GearStorage(100)
    sampler = GearGroupSampler(num_groups=2, group_size=SIZE, consume=True, order="fifo")
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=2 * SIZE)
    completion = []
    for gid in range(6):  # group 1 completes last of the first three
        n = 2 if gid == 1 else SIZE
        rb.extend(_group(gid, n, 0))
        if n == SIZE:
            completion.append(gid)
    rb.extend(_group(1, 2, 0))
    completion.append(1)
    served = []
    while sampler.eligible_groups >= 2:
        served += _batch_groups(rb.sample(), SIZE)
    assert served == completion[:6]
    with pytest.raises(RuntimeError, match="not drawn before"):
        rb.sample()
    random = GearGroupSampler(num_groups=3, group_size=SIZE, consume=True)
    rb = TensorDictReplayBuffer(storage=storage, sampler=random, batch_size=3 * SIZE)
    first, second = _batch_groups(rb.sample(), SIZE), _batch_groups(rb.sample(), SIZE)
    assert len(set(first + second)) == 6  # random order, still each group once


def test_within_a_group_the_strategies_pick_what_brute_force_says():
    storage = GearStorage(100)
    rewards = {gid: torch.randperm(7).double() / 7 for gid in range(3)}
    writes = TensorDictReplayBuffer(storage=storage)
    for i in range(7):  # one member per write, the groups interleaved: recency is write order
        for gid, r in rewards.items():
            writes.extend(_group(gid, 1, 0, r[i : i + 1]))
    rows = storage[torch.arange(len(storage))]
    for strategy in ("reward", "recency", "variance"):
        rb = TensorDictReplayBuffer(
            storage=storage, sampler=GearGroupSampler(samples_per_group=3, strategy=strategy), batch_size=9
        )
        batch = rb.sample()
        for block in batch["index"].reshape(3, 3):
            gid = int(rows["query"][block[0]])
            mine = (rows["query"] == gid).nonzero().squeeze(1)
            got = sorted(block.tolist())
            if strategy == "reward":
                want = sorted(mine[torch.topk(rows["next", "reward"][mine, 0], 3).indices].tolist())
            elif strategy == "recency":
                want = sorted(mine[-3:].tolist())
            else:
                r = rows["next", "reward"][:, 0].double()

                def score(subset, r=r):
                    values = r[list(subset)]
                    return (round(float(values.var(unbiased=False)), 9), float(values.sum()))

                want = sorted(max(itertools.combinations(mine.tolist(), 3), key=score))
            assert got == want, (strategy, gid, got, want)


def test_a_batch_lays_groups_out_as_prompt_group_sampler_does_and_completes_small_groups_with_a_warning():
    storage = GearStorage(50)
    rb = TensorDictReplayBuffer(storage=storage, sampler=GearGroupSampler(num_groups=2), batch_size=8)
    rb.extend(torch.cat([_group(0, 4, 0), _group(1, 2, 0)]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = rb.sample()
    assert sorted(_batch_groups(batch, 4)) == [0, 1]  # group 1 of 2 rows completed with replacement
    assert any("with replacement" in str(c.message) for c in caught)


def test_seeded_draws_repeat():
    storage = GearStorage(200)
    writes = TensorDictReplayBuffer(storage=storage)
    for gid in range(20):
        writes.extend(_group(gid, SIZE, 0))
    draws = []
    for _ in range(2):
        rb = TensorDictReplayBuffer(storage=storage, sampler=GearGroupSampler(num_groups=3), batch_size=6)
        rb.set_rng(torch.Generator().manual_seed(3))
        draws.append([rb.sample()["index"].clone() for _ in range(5)])
    assert all(torch.equal(a, b) for a, b in zip(*draws))


def test_groups_another_process_writes_are_drawn_whole_once_complete():
    storage = GearStorage(200, shared=True)
    sampler = GearGroupSampler(num_groups=2, group_size=SIZE, consume=True, max_staleness=0)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=2 * SIZE)
    plan = [(g, SIZE if g % 3 else SIZE - 1, 2 if g < 6 else 3) for g in range(9)]  # groups 0, 3, 6 incomplete
    writer = mp.get_context("spawn").Process(target=w.write_groups, args=(storage, plan, 0))
    writer.start()
    writer.join(120)
    assert writer.exitcode == 0
    sampler.consumer_version = 3  # groups of version 2 are stale now; 7 and 8 are fresh
    groups = _batch_groups(rb.sample(), SIZE)
    assert sorted(groups) == [7, 8]
    storage.close()


def test_consumed_groups_and_the_consumer_version_survive_a_checkpoint(tmp_path):
    storage = GearStorage(100)
    sampler = GearGroupSampler(num_groups=2, group_size=SIZE, consume=True, max_staleness=2)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=2 * SIZE)
    for gid in range(6):
        rb.extend(_group(gid, SIZE, gid))
    sampler.consumer_version = 5
    served = set(_batch_groups(rb.sample(), SIZE))
    rb.dumps(tmp_path / "ckpt")
    restored = GearGroupSampler(num_groups=2, group_size=SIZE, consume=True, max_staleness=2)
    rb2 = TensorDictReplayBuffer(storage=GearStorage(100), sampler=restored, batch_size=2 * SIZE)
    rb2.loads(tmp_path / "ckpt")
    assert restored.consumer_version == 5
    assert len(served) == 2 and served <= {3, 4, 5}  # versions 3..5 are within 2 of 5
    rb2.extend(_group(6, SIZE, 5))  # a group written after the restore joins the one fresh group left
    again = set(_batch_groups(rb2.sample(), SIZE))
    assert again == ({3, 4, 5} - served) | {6}
    with pytest.raises(RuntimeError, match="only 0 groups"):
        rb2.sample()
    with pytest.raises(CheckpointError, match="held"):
        restored.load_state_dict({**restored.state_dict(), "held": torch.zeros(3, dtype=torch.bool)})
    assert restored.consumer_version == 5


def test_bad_input_is_refused_naming_the_problem_and_changes_nothing():
    with pytest.raises(ValueError, match="samples_per_group=5 is above group_size=4"):
        GearGroupSampler(samples_per_group=5, group_size=4)
    with pytest.raises(TypeError, match="exactly one of num_groups or samples_per_group"):
        GearGroupSampler(num_groups=2, samples_per_group=2)
    with pytest.raises(ValueError, match="max_staleness must be an integer >= -1"):
        GearGroupSampler(num_groups=2, max_staleness=-2)
    with pytest.raises(ValueError, match="unknown strategy"):
        GearGroupSampler(num_groups=2, strategy="best")  # type: ignore[arg-type]
    storage = GearStorage(100)
    sampler = GearGroupSampler(num_groups=1, group_size=SIZE, max_staleness=1)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=SIZE)
    rb.extend(_group(0, SIZE, 0))
    rb.sample()
    with pytest.raises(ValueError, match=r"group 0 under 'query' would hold 5 rows, more than group_size=4"):
        rb.extend(_group(0, 1, 0))  # a member too many: the members disagree on the group's size
    assert sampler.eligible_groups == 1 and _batch_groups(rb.sample(), SIZE) == [0]
    with pytest.raises(ValueError, match="batch_size=4 is not divisible by num_groups=3"):
        TensorDictReplayBuffer(storage=storage, sampler=GearGroupSampler(num_groups=3), batch_size=4).sample()
    sampler.consumer_version = 1
    with pytest.raises(ValueError, match="goes forward only: it is 1, got 0"):
        sampler.consumer_version = 0
    with pytest.raises(TypeError, match="integer"):
        sampler.consumer_version = 1.5  # type: ignore[assignment]
    assert sampler.consumer_version == 1
    no_key = GearStorage(10)
    TensorDictReplayBuffer(storage=no_key).extend(
        TensorDict({"obs": torch.zeros(2, 1), ("next", "done"): torch.ones(2, 1, dtype=torch.bool)}, [2])
    )
    with pytest.raises(KeyError, match="group id under 'prompt'"):
        TensorDictReplayBuffer(
            storage=no_key, sampler=GearGroupSampler(num_groups=1, group_key="prompt"), batch_size=1
        ).sample()
    float_versions = GearStorage(10)
    data = _group(0, SIZE, 0)
    data["policy_version"] = data["policy_version"].float()
    TensorDictReplayBuffer(storage=float_versions).extend(data)
    bounded = GearGroupSampler(num_groups=1, max_staleness=0)
    with pytest.raises(TypeError, match="policy versions, which are integers"):
        TensorDictReplayBuffer(storage=float_versions, sampler=bounded, batch_size=SIZE).sample()
    with pytest.raises(TypeError, match="needs a GearStorage"):
        TensorDictReplayBuffer(
            storage=LazyTensorStorage(10), sampler=GearGroupSampler(num_groups=1), batch_size=1
        ).sample()
