"""Rows carry the policy version that produced them: writers stamp it, or the data brings its own.

Over a sharded store the stamp travels in the INSERT like any column
(``test_ray_store.py``, remote writers over tcp).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from gear_torchrl import GearStorage, SpecMismatchError, TrajectoryWriter
from gear_torchrl.store.policy_versions import POLICY_VERSION, checked_version


def _steps(n: int, first: int = 0, *, done: bool = True) -> TensorDict:
    flags = torch.zeros(n, 1, dtype=torch.bool)
    flags[-1] = done
    return TensorDict({"step": torch.arange(first, first + n), ("next", "done"): flags}, [n])


def _stored(storage: GearStorage) -> TensorDict:
    return storage.get(torch.arange(len(storage)))


@pytest.mark.parametrize("shared", [False, True])
def test_a_writer_stamps_the_version_set_for_the_steps_it_writes_next(shared):
    storage = GearStorage(64, shared=shared)
    try:
        target = pickle.loads(pickle.dumps(storage)) if shared else storage  # an actor's attached copy
        writer = TrajectoryWriter(target, policy_version=3)
        writer.extend(_steps(4, done=False))
        writer.policy_version = 4  # new weights arrived mid-episode
        writer.append(_steps(2, 4)[0])
        writer.extend(_steps(1, 5))
        writer.end_episode()
        writer.policy_version = checked_version(np.int64(9))  # numpy's integers are versions too
        writer.extend(_steps(3, 6))
        writer.end_episode()
        rows = _stored(storage)
        assert rows[POLICY_VERSION].dtype == torch.int64
        assert rows[POLICY_VERSION].tolist() == [3, 3, 3, 3, 4, 4, 9, 9, 9]
        assert rows["step"].tolist() == list(range(9))
        if shared:
            target.close()
    finally:
        storage.close()


def test_steps_that_carry_their_own_version_keep_it():
    storage = GearStorage(64)
    writer = TrajectoryWriter(storage)  # no stamp: what TorchRL's PolicyVersion transform wrote stays
    data = _steps(5)
    data[POLICY_VERSION] = torch.tensor([0, 0, 1, 1, 2])
    writer.extend(data)
    writer.end_episode()
    assert _stored(storage)[POLICY_VERSION].tolist() == [0, 0, 1, 1, 2]
    extended = GearStorage(64)
    TensorDictReplayBuffer(storage=extended, batch_size=2).extend(_steps(2).set(POLICY_VERSION, torch.tensor([7, 7])))
    assert _stored(extended)[POLICY_VERSION].tolist() == [7, 7]


def test_another_version_key_and_a_nested_one():
    for key in ("weights_step", ("meta", "version")):
        storage = GearStorage(16)
        writer = TrajectoryWriter(storage, policy_version=2, version_key=key)
        writer.extend(_steps(3))
        writer.end_episode()
        rows = _stored(storage)
        assert rows[key].tolist() == [2, 2, 2]
        assert POLICY_VERSION not in rows.keys()


def test_the_callers_steps_are_not_changed_by_the_stamp():
    writer = TrajectoryWriter(GearStorage(16), policy_version=1)
    data = _steps(3)
    writer.extend(data)
    assert POLICY_VERSION not in data.keys()


@pytest.mark.parametrize("bad", [1.5, 2.0, True, "3", torch.tensor(1.0), torch.tensor([1, 2])])
def test_a_version_that_is_not_one_integer_is_refused(bad):
    writer = TrajectoryWriter(GearStorage(16), policy_version=5)
    with pytest.raises(TypeError, match="writer.policy_version"):
        writer.policy_version = bad
    assert writer.policy_version == 5  # the version set before stays
    with pytest.raises(TypeError, match="writer.policy_version is"):
        TrajectoryWriter(GearStorage(16), policy_version=bad)
    assert checked_version(torch.tensor(4)) == 4


def test_steps_whose_version_column_is_not_integer_are_refused_and_nothing_is_staged():
    storage = GearStorage(16)
    writer = TrajectoryWriter(storage)
    writer.extend(_steps(2, done=False).set(POLICY_VERSION, torch.tensor([1, 1])))
    for column in (torch.tensor([1.0, 2.0]), torch.tensor([True, False])):
        with pytest.raises(SpecMismatchError, match="'policy_version' holds policy versions, which are integers"):
            writer.extend(_steps(2, 2).set(POLICY_VERSION, column))
    assert writer.pending == 2 and len(storage) == 0


def test_stamping_steps_that_carry_a_version_already_is_refused():
    storage = GearStorage(16)
    writer = TrajectoryWriter(storage, policy_version=1)
    with pytest.raises(ValueError, match="carry 'policy_version' already"):
        writer.extend(_steps(2).set(POLICY_VERSION, torch.tensor([0, 0])))
    assert writer.pending == 0 and len(storage) == 0
