"""Process bodies for the packed-sequence tests over many processes: shard owners and a learner on 127.0.0.1.

Owner ``s`` writes episodes of shared_workers' checksummed steps, each step also carrying
its shard; the learner draws packs through both owners and checks every token against
its checksum, its episode and its shard, then writes what it found to a file.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from sharded_workers import _wait_for
from shared_workers import episode, verify

if TYPE_CHECKING:
    from gear_torchrl.adapters.sharded_storage import TransportName

OWNERS = 2
CAPACITY = 2000
EPISODES = [60, 40]  # per owner: unequal, so both must show up in proportion to their mass
MAX_LEN, BURN_IN, BUDGET = 24, 3, 512


def run_rank(rank: int, world: int, port: int, tmp: str, transport: TransportName) -> None:
    from gear_torchrl import ShardedGearStorage, TrajectoryWriter

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    owner = rank < OWNERS
    storage = ShardedGearStorage(CAPACITY, owns_shard=owner, serve_on="127.0.0.1", timeout=10.0, transport=transport)
    if owner:
        generator = torch.Generator().manual_seed(rank)
        assert storage.local is not None  # an owning rank holds its shard
        writer = TrajectoryWriter(storage.local)
        for e in range(EPISODES[rank]):
            data = episode(rank * 1000 + e, int(torch.randint(3, 60, (1,), generator=generator)), generator)
            data["shard"] = torch.full((data.shape[0],), rank, dtype=torch.int64)
            writer.extend(data)
            writer.end_episode()
    dist.barrier()  # every shard holds its episodes
    tmp_path = Path(tmp)
    try:
        if owner:
            _wait_for(tmp_path / "finish")
        else:
            torch.save(_learn(storage), tmp_path / f"learner_{transport}.pt")
    finally:
        storage.close()
    os._exit(0)


def check_tokens(batch) -> dict:
    """Every real token intact and where the pack says it is; what a test asserts on, returned."""
    seq_id = batch["packed", "seq_id"]
    real = seq_id >= 0
    n_real = int(real.sum())
    verify(batch[real])
    ids, position = seq_id[real], batch["packed", "position"][real]
    lengths = torch.bincount(ids)
    first = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return {
        "tokens": batch.shape[0],
        "real": n_real,
        "padding_last": bool(real[:n_real].all()),
        "one_episode": bool((batch["ep"][real] == batch["ep"][real][first]).all()),
        "consecutive": bool((batch["step"][real] == batch["step"][real][first] + position).all()),
        "one_shard": bool((batch["shard"][real] == batch["shard"][real][first]).all()),
        "max_len": int(lengths.max()),
        "ids_in_order": bool(((ids[1:] - ids[:-1]).clamp(0, 1) == ids[1:] - ids[:-1]).all()),
        "index_marks_padding": bool((batch["index"][~real] == -1).all()),
        "shards": torch.bincount(batch["shard"][real], minlength=OWNERS),
    }


def _learn(storage) -> dict:
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearPackedSequenceSampler, GearPrioritizedPackedSequenceSampler

    uniform = TensorDictReplayBuffer(
        storage=storage, sampler=GearPackedSequenceSampler(MAX_LEN, burn_in=BURN_IN), batch_size=BUDGET
    )
    results: dict = {"uniform": [check_tokens(uniform.sample()) for _ in range(10)]}
    sampler = GearPrioritizedPackedSequenceSampler(CAPACITY, MAX_LEN, burn_in=BURN_IN, alpha=1.0, beta=0.5)
    prioritized = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=BUDGET, priority_key="td_error")
    before = [check_tokens(prioritized.sample()) for _ in range(5)]
    for _ in range(6):  # owner 1's sequences get a large error: they come to fill the packs
        batch = prioritized.sample()
        # Keys no batch drew keep priority 1, so owner 1's drawn keys need a mass that outweighs the ~3,000
        # steps of both shards many times over: with 1000, a pack held 3 of owner 0's sequences in ~1 of 14 runs.
        batch["td_error"] = torch.where(batch["shard"] == 1, 1e6, 1e-3).to(torch.float64)
        prioritized.update_tensordict_priority(batch)
    after = [check_tokens(prioritized.sample()) for _ in range(5)]
    weights = prioritized.sample()["priority_weight"]
    results["prioritized"] = {"before": before, "after": after, "weights_finite": bool(weights.isfinite().all())}
    results["seeded"] = _seeded_draws(storage)
    return results


def _seeded_draws(storage) -> dict:
    """What a seeded learner draws, rule by rule: over tcp the owners pick, over local this process does."""
    from torchrl.data import RandomSampler, TensorDictReplayBuffer

    from gear_torchrl import GearPackedSequenceSampler, GearSequenceSampler

    samplers = {
        "rows": (RandomSampler(), 256),
        "windows": (GearSequenceSampler(8), 256),
        "packed": (GearPackedSequenceSampler(MAX_LEN, burn_in=BURN_IN), BUDGET),
    }
    drawn = {}
    for rule, (sampler, batch_size) in samplers.items():
        rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=batch_size)
        rb.set_rng(torch.Generator().manual_seed(11))
        drawn[rule] = [rb.sample()["index"].as_subclass(torch.Tensor).clone() for _ in range(3)]
    return drawn
