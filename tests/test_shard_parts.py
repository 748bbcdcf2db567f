"""A shard is a ring built from two parts: its addressing and its visibility (store/visibility.py)."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch

from gear_torchrl.store.addressing import EnvColumns, StepRows
from gear_torchrl.store.own_writes import OwnWrites
from gear_torchrl.store.shard import Shard
from gear_torchrl.store.shared_commits import SharedCommits, shared_part, shared_shard


def _steps(n: int, first: int = 0) -> dict[str, torch.Tensor]:
    return {"obs": torch.arange(first, first + n, dtype=torch.float32).unsqueeze(1)}


def _read(shard: Shard, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """``shard.read``: rows written as a dict of tensors come back as one."""
    got = shard.read(rows)
    assert isinstance(got, dict), type(got)
    return got


def test_a_dropped_shard_is_freed_without_the_cycle_collector():
    """Its visibility refers back weakly: the columns go as soon as the last user lets go."""
    gc.disable()
    try:
        shard = Shard(8)
        shard.write(torch.arange(4), _steps(4), append=True)
        gone = weakref.ref(shard)
        del shard
        assert gone() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))], ids=["deepcopy", "pickle"])
def test_a_copied_shard_reads_and_writes_its_own_rows(clone):
    shard = Shard(8)
    shard.write(torch.arange(4), _steps(4), append=True)
    twin = clone(shard)
    assert twin.visibility.shard.capacity == 8 and twin.size == 4
    twin.write(torch.arange(4, 6), _steps(2, first=10), append=True)
    assert _read(twin, torch.arange(6))["obs"].reshape(-1).tolist() == [0, 1, 2, 3, 10, 11]
    assert shard.size == 4 and _read(shard, torch.arange(4))["obs"].reshape(-1).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("addressing", [StepRows, EnvColumns])
def test_every_combination_of_parts_is_a_shard(addressing):
    local = Shard(8, addressing=addressing)
    shared = shared_shard(8, addressing=addressing)
    try:
        assert isinstance(local.visibility, OwnWrites) and isinstance(shared.visibility, SharedCommits)
        assert type(local.addressing) is type(shared.addressing) is addressing
        assert shared_part(shared) is shared.visibility
        with pytest.raises(TypeError, match="no shared commit log"):
            shared_part(local)
    finally:
        shared.close()


def test_only_own_writes_take_writes_in_place():
    shared = shared_shard(8)
    try:
        shared.write(torch.arange(4), _steps(4), append=True)
        assert not shared.slice_views_possible
        with pytest.raises(NotImplementedError, match="appends only"):
            shared.write(torch.arange(2), _steps(2), append=False)
        with pytest.raises(NotImplementedError, match="cannot be set"):
            shared.set_size(2)
        assert _read(shared, torch.arange(4))["obs"].reshape(-1).tolist() == [0, 1, 2, 3]
    finally:
        shared.close()
