"""Process bodies for the sharded checkpoint test: owners and one learner on 127.0.0.1.

One process group runs three phases, each over a new store. ``save``: owners
write their rows; the learner sets priorities and scores, consumes part of the
queue, draws under a cap, then ``rb.dumps``. ``restore``: new, empty owners;
the learner ``rb.loads`` and reports what it finds. ``other_layout``: one owner
fewer, where loading must be refused. Results go to files in ``tmp``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import stored_ids
from sharded_workers import CAPACITY, ROWS_PER_SHARD, _write_shard, priority_of, sample_until_refused, top_scores
from shared_workers import episode

ALPHA, BETA, EPS = 0.7, 0.5, 1e-8
QUEUE_BATCHES = 3  # of 100 rows, served before the checkpoint
NEW_ROWS = 50  # each owner writes after the restore


def run_rank(rank: int, world: int, owners: int, port: int, tmp: str) -> None:
    """The three phases in one process group, each over a store of its own: ``save`` and ``restore`` on
    ``owners`` owners (the second's start empty), ``other_layout`` on one owner fewer."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    for phase, owning in (("save", owners), ("restore", owners), ("other_layout", owners - 1)):
        _run_phase(rank, owners, owning, phase, Path(tmp))
    os._exit(0)


def _run_phase(rank: int, learner: int, owning: int, phase: str, tmp_path: Path) -> None:
    from gear_torchrl import ShardedGearStorage

    storage = ShardedGearStorage(CAPACITY, owns_shard=rank < owning, serve_on="127.0.0.1", timeout=10.0, name=phase)
    try:
        if phase == "save" and rank < owning:
            _write_shard(storage.local, rank)
        dist.barrier()  # every shard holds its rows (or none, to restore into)
        if rank == learner:
            results = {"save": _save, "restore": _restore, "other_layout": _other_layout}[phase](storage, tmp_path)
            torch.save(results, tmp_path / f"{phase}.pt")
        dist.barrier()  # owners serve until the learner is done
        if phase == "restore" and rank < owning:
            _write_more(storage.local, rank)  # new rows after the restored ones: the cursor moved on
        dist.barrier()
        if phase == "restore" and rank == learner:
            torch.save(_after_new_writes(storage), tmp_path / "after_writes.pt")
        dist.barrier()
    finally:
        storage.close()


def _write_more(local, shard: int) -> None:
    from gear_torchrl import TrajectoryWriter

    data = episode(shard * 1000 + 999, NEW_ROWS)
    data["shard"] = torch.full((NEW_ROWS,), shard, dtype=torch.int64)
    data["pos"] = torch.arange(ROWS_PER_SHARD[shard], ROWS_PER_SHARD[shard] + NEW_ROWS)
    writer = TrajectoryWriter(local)
    writer.extend(data)
    writer.end_episode()


def _buffers(storage):
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearPrioritizedSampler, MaxTimesSampled, QueueSampler, TopKSampler

    def rb(sampler, batch):
        return TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=batch)

    return {
        "prioritized": rb(GearPrioritizedSampler(CAPACITY, ALPHA, BETA), 512),
        "queue": rb(QueueSampler(CAPACITY), 100),
        "topk": rb(TopKSampler(CAPACITY), 20),
        "capped": rb(MaxTimesSampled(GearPrioritizedSampler(CAPACITY, 0.0, 0.0), 2, CAPACITY), 200),
    }


def _state(storage, buffers) -> dict:
    """What must survive: every row, the priorities (seen in a draw's weights), the best rows."""
    len(storage)
    ids = stored_ids(storage)
    rows = storage.get(ids)
    drawn = buffers["prioritized"].sample()
    return {
        "len": len(storage),
        "ids": ids,
        "pos": rows["pos"].clone(),
        "obs": rows["obs"].clone(),
        "drawn_shard": drawn["shard"].clone(),
        "drawn_pos": drawn["pos"].clone(),
        "weights": drawn["priority_weight"].clone(),
        "top": buffers["topk"].sample()["index"].as_subclass(torch.Tensor).clone(),
    }


def _save(storage, tmp: Path) -> dict:
    from gear_torchrl.distributed import global_ids

    buffers = _buffers(storage)
    buffers["prioritized"].sample()  # the owners start keeping priorities and scores
    buffers["topk"].sample()
    len(storage)
    ids = stored_ids(storage)
    shard, pos = global_ids.decode(ids)
    buffers["prioritized"].update_priority(ids, priority_of(shard, pos))
    buffers["topk"].update_priority(ids, top_scores())
    consumed = torch.cat([buffers["queue"].sample()["index"].as_subclass(torch.Tensor) for _ in range(QUEUE_BATCHES)])
    capped = torch.cat([buffers["capped"].sample()["index"].as_subclass(torch.Tensor) for _ in range(6)])
    state = _state(storage, buffers)
    buffers["prioritized"].dumps(tmp / "checkpoint")
    return {**state, "consumed": consumed, "capped": capped}


def _restore(storage, tmp: Path) -> dict:
    from gear_torchrl.errors import CheckpointError

    buffers = _buffers(storage)
    buffers["prioritized"].loads(tmp / "checkpoint")
    state = _state(storage, buffers)
    served, _ = sample_until_refused(buffers["queue"], RuntimeError)
    capped, _ = sample_until_refused(buffers["capped"], RuntimeError)
    try:
        buffers["prioritized"].loads(tmp / "checkpoint")
        again = None
    except (CheckpointError, ValueError) as exc:
        again = str(exc)
    return {**state, "served": _ids(served), "capped_after": _ids(capped), "again": again}


def _ids(batches: list) -> torch.Tensor:
    return torch.cat([b["index"].as_subclass(torch.Tensor) for b in batches] or [torch.empty(0, dtype=torch.int64)])


def _after_new_writes(storage) -> dict:
    storage._shards.rows.clear()
    return {"len": len(storage), "sizes": [storage._shards.rows[s] for s in range(storage.num_shards)]}


def _other_layout(storage, tmp: Path) -> dict:
    try:
        storage.loads(tmp / "checkpoint" / "storage")  # where rb.dumps put the storage's part
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "len": len(storage)}
    return {"type": None, "message": "", "len": len(storage)}
