"""Random write/read/empty/checkpoint sequences: GearStorage and LazyTensorStorage never disagree."""

from __future__ import annotations

import torch
from helpers import assert_same_td, make_steps
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrl.data import LazyTensorStorage, ReplayBuffer

from gear_torchrl import GearStorage

ops = st.one_of(
    st.tuples(st.just("extend"), st.integers(1, 40)),
    st.tuples(st.just("add"), st.integers(0, 0)),
    st.tuples(st.just("write_at"), st.integers(1, 5)),
    st.tuples(st.just("read"), st.integers(1, 30)),
    st.tuples(st.just("empty"), st.integers(0, 0)),
    st.tuples(st.just("state_dict"), st.integers(0, 0)),
)


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 33), program=st.lists(ops, min_size=1, max_size=25), seed=st.integers(0, 2**16))
def test_random_programs_match_the_oracle(capacity, program, seed):
    gear = ReplayBuffer(storage=GearStorage(capacity))
    ref = ReplayBuffer(storage=LazyTensorStorage(capacity))
    g = torch.Generator().manual_seed(seed)
    for step, (op, n) in enumerate(program):
        if op == "extend":
            data = make_steps(n, seed=step)
            gear.extend(data)
            ref.extend(data)
        elif op == "add":
            data = make_steps(1, seed=step)[0]
            gear.add(data)
            ref.add(data)
        elif op == "write_at" and len(ref):
            index = torch.randint(0, len(ref), (n,), generator=g).unique()
            data = make_steps(index.numel(), seed=step)
            gear.storage[index] = data
            ref.storage[index] = data
        elif op == "read" and len(ref):
            index = torch.randint(-len(ref), len(ref), (n,), generator=g)
            assert_same_td(gear.storage.get(index), ref.storage.get(index))
        elif op == "empty":
            gear.empty()
            ref.empty()
        elif op == "state_dict":
            restored = ReplayBuffer(storage=GearStorage(capacity))
            restored.load_state_dict(gear.state_dict())
            gear = restored
        assert len(gear) == len(ref)
        if len(ref):
            assert_same_td(gear.storage.get(slice(None)), ref.storage.get(slice(None)))
            episodes = gear.storage.shard.episodes.live()
            assert int(episodes.length.sum()) == len(gear)
