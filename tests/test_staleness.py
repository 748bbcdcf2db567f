"""Staleness around another rule (``selection/fresh.py``), against the rule itself: every row whose version is
at least the consumer version less ``max_staleness``, listed by brute force over the store."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import as_td
from tensordict import TensorDict

from gear_torchrl import GearStorage, TrajectoryWriter
from gear_torchrl.selection.fresh import FreshSelector, FreshSpec
from gear_torchrl.selection.priorities import PrioritySelector, PrioritySpec
from gear_torchrl.selection.rules import spec_from_json
from gear_torchrl.selection.topk import TopKSpec
from gear_torchrl.selection.uniform import UniformSpec

CAPACITY = 48


def _episode(n: int) -> TensorDict:
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict({"obs": torch.randn(n, 2), ("next", "done"): done}, [n])


def _drawable(core: FreshSelector) -> set[int]:
    """The rows the inner rule can still draw."""
    everything = torch.arange(CAPACITY)
    if isinstance(core.inner, PrioritySelector):
        return set(everything[core.inner.masses(everything) > 0].tolist())
    return set(core.inner.pick(None, CAPACITY, None).starts.tolist())  # top-k: every ranked row


def _oracle(storage: GearStorage, max_staleness: int, consumer: int | None) -> set[int]:
    """Every stored row fresh enough for ``consumer``, from the rows themselves."""
    rows = torch.arange(len(storage))
    versions = as_td(storage.get(rows))["policy_version"]
    if consumer is None:
        return set(rows.tolist())
    return set(rows[versions >= consumer - max_staleness].tolist())


@pytest.mark.parametrize("inner", [PrioritySpec(0.0), TopKSpec(None, 1.0)], ids=["uniform", "top_k"])
@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_the_rows_left_to_draw_are_exactly_the_fresh_ones_as_the_ring_turns_and_versions_move(inner, max_staleness):
    g = torch.Generator().manual_seed(max_staleness)
    storage = GearStorage(CAPACITY)
    writers = [TrajectoryWriter(storage) for _ in range(3)]  # generators a few versions apart
    core = FreshSpec(inner, max_staleness).build(CAPACITY)
    consumer = None
    for step in range(40):
        writer = writers[step % 3]
        base = consumer if consumer is not None else 0
        writer.policy_version = base - int(torch.randint(0, max_staleness + 3, (), generator=g))
        writer.extend(_episode(int(torch.randint(2, 7, (), generator=g))))
        writer.end_episode()
        with storage.shard.picking():
            core.follow(storage.shard)
        storage.shard.release()
        if step % 4 == 3:  # the learner took a step
            consumer = (consumer or 0) + int(torch.randint(0, 3, (), generator=g))
            core.set_consumer_version(consumer)
        assert _drawable(core) == _oracle(storage, max_staleness, consumer), f"step {step}"


def test_picks_are_fresh_and_seeded_picks_repeat():
    storage = GearStorage(CAPACITY)
    writer = TrajectoryWriter(storage)
    for version in range(6):
        writer.policy_version = version
        writer.extend(_episode(5))
        writer.end_episode()
    cores = [FreshSpec(PrioritySpec(0.0), 1).build(CAPACITY) for _ in range(2)]
    draws = []
    for core in cores:
        with storage.shard.picking():
            core.follow(storage.shard)
            core.set_consumer_version(5)
            picked = core.pick(storage.shard, 64, torch.Generator().manual_seed(7))
        storage.shard.release()
        assert core.mass(storage.shard) == 10  # versions 4 and 5: five rows each
        draws.append(picked.starts)
    versions = as_td(storage.get(draws[0]))["policy_version"]
    assert bool((versions >= 4).all()) and set(versions.tolist()) == {4, 5}
    assert torch.equal(draws[0], draws[1])


def test_a_fresh_spec_travels_as_json_and_a_state_round_trips():
    spec = FreshSpec(PrioritySpec(0.6, 1e-6), 2, ("meta", "version"))
    assert spec_from_json(json.loads(json.dumps(spec.to_json()))) == spec
    storage = GearStorage(CAPACITY)
    writer = TrajectoryWriter(storage, policy_version=3, version_key=("meta", "version"))
    writer.extend(_episode(6))
    writer.end_episode()
    core = spec.build(CAPACITY)
    with storage.shard.picking():
        core.follow(storage.shard)
    storage.shard.release()
    core.set_consumer_version(5)
    copy = spec.build(CAPACITY)
    copy.assign(copy.checked_state_dict(core.state_dict()))
    assert copy.consumer_version == 5 and torch.equal(copy.version, core.version)
    copy.set_consumer_version(6)  # what the saved state filed still turns stale
    assert copy.mass(storage.shard) == 0 and core.mass(storage.shard) > 0


def test_bad_input_is_refused_naming_the_problem():
    with pytest.raises(ValueError, match="max_staleness must be an integer >= 0"):
        FreshSpec(PrioritySpec(0.0), -2)
    with pytest.raises(TypeError, match="cannot leave stale rows out"):
        FreshSpec(UniformSpec(), 1)
    core = FreshSpec(PrioritySpec(0.0), 1).build(CAPACITY)
    core.set_consumer_version(4)
    with pytest.raises(ValueError, match="goes forward only: it is 4, got 3"):
        core.set_consumer_version(3)
    with pytest.raises(TypeError, match="a consumer version is an integer"):
        core.set_consumer_version(4.5)  # type: ignore[arg-type]
    assert core.consumer_version == 4
    storage = GearStorage(CAPACITY)
    plain = TrajectoryWriter(storage)
    plain.extend(_episode(3))
    plain.end_episode()
    with storage.shard.picking(), pytest.raises(KeyError, match="under 'policy_version', which the data lacks"):
        core.follow(storage.shard)
    storage.shard.release()


def test_priority_updates_of_stale_rows_leave_them_out_and_fresh_ones_take_theirs():
    storage = GearStorage(CAPACITY)
    writer = TrajectoryWriter(storage)
    for version in (0, 1):
        writer.policy_version = version
        writer.extend(_episode(4))
        writer.end_episode()
    core = FreshSpec(PrioritySpec(1.0, 0.0), 0).build(CAPACITY)
    with storage.shard.picking():
        core.follow(storage.shard)
    storage.shard.release()
    core.set_consumer_version(1)  # rows 0-3 (version 0) are stale now
    core.update(torch.tensor([1, 5]), torch.tensor([9.0, 3.0]))
    assert isinstance(core.inner, PrioritySelector)
    masses = core.inner.masses(torch.arange(8))
    assert masses[:4].tolist() == [0.0] * 4 and masses[5].item() == pytest.approx(3.0)
