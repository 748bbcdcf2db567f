"""Ray task and actor bodies for the Ray tests (Ray workers import them by module name: tests/ is on their path).

Writers fill a store on Ray; learners sample it with ``sharded_workers``' learner
functions, so the oracles of the torchrun tests (``sharded_oracles``) check them.
"""

from __future__ import annotations

import os
from typing import Any

import ray
import sharded_workers as w
import torch
from tensordict import TensorDict

from gear_torchrl import GearStorage, TrajectoryWriter


@ray.remote(num_cpus=0)
def fill_shard_in_place(storage, shard: int) -> int:
    """Write ``sharded_workers``' episodes of ``shard`` into that shard, attached through its shared memory."""
    descriptor = storage.descriptors[shard]
    local = GearStorage(descriptor.capacity, handle=descriptor.store_handle())
    writer = TrajectoryWriter(local)
    for data in w.shard_episodes(shard):
        writer.extend(data)
        writer.end_episode()
    rows = len(local)
    local.close()
    return rows


@ray.remote(num_cpus=0)
def learn(storage) -> dict:
    """Every gear sampler over the store, from a Ray task on this node (what the oracles check)."""
    return {
        "transports": [storage.transport_of(s) for s in range(storage.num_shards)],
        "len": len(storage),
        "uniform": w._uniform_counts(storage),
        "windows": w._window_counts(storage),
        "prioritized": w._prioritized(storage),
        "queue": w._queue(storage),
        "topk": w._topk(storage),
        "seeded": w._seeded_draws(storage),
    }


def episode(writer_id: int, number: int, length: int) -> TensorDict:
    """Steps of one episode, each naming its writer, its episode and its step, the last one done."""
    done = torch.zeros(length, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict(
        {
            "writer": torch.full((length,), writer_id),
            "ep": torch.full((length,), number),
            "step": torch.arange(length),
            "obs": torch.randn(length, 3),
            ("next", "done"): done,
        },
        [length],
    )


class WriterActor:
    """An actor writing episodes into a store with a TrajectoryWriter or ``rb.extend``."""

    def __init__(self, storage, writer_id: int) -> None:
        self.storage, self.writer_id = storage, writer_id
        self.writer = TrajectoryWriter(storage)

    def pid(self) -> int:
        return os.getpid()

    def through_shared_memory(self) -> list[bool]:
        sink = self.storage.episode_sink()
        return [sink.through_shared_memory(s) for s in sink.candidates]

    def write(self, episodes: int, length: int, *, chunk: bool = False) -> int:
        for e in range(episodes):
            data = episode(self.writer_id, e, length)
            if chunk:  # two appends, one commit
                self.writer.extend(data[: length // 2])
                self.writer.extend(data[length // 2 :])
            else:
                self.writer.extend(data)
            self.writer.end_episode()
        return self.writer.rows_written

    def write_versions(self, episodes: int, length: int) -> int:
        """Episodes whose first half is stamped policy version ``e`` and second half ``e + 1`` (weights that
        arrived mid-episode, as in partial rollouts)."""
        for e in range(episodes):
            data = episode(self.writer_id, e, length)
            self.writer.policy_version = e
            self.writer.extend(data[: length // 2])
            self.writer.policy_version = e + 1
            self.writer.extend(data[length // 2 :])
            self.writer.end_episode()
        self.writer.policy_version = None
        return self.writer.rows_written

    def extend(self, episodes: int, length: int) -> int:
        """``rb.extend`` of whole episodes, each in two halves (the first ends no episode)."""
        from torchrl.data import TensorDictReplayBuffer

        rb = TensorDictReplayBuffer(storage=self.storage, batch_size=1)
        for e in range(episodes):
            data = episode(self.writer_id, e, length)
            rb.extend(data[: length // 2])
            rb.extend(data[length // 2 :])
        return episodes * length

    def extend_across(self, episodes: int, length: int, batch: int) -> int:
        """``rb.extend`` of ``episodes`` back to back in batches of ``batch`` steps, cut across episodes."""
        from tensordict import cat
        from torchrl.data import TensorDictReplayBuffer

        rb = TensorDictReplayBuffer(storage=self.storage, batch_size=1)
        steps = cat([episode(self.writer_id, e, length) for e in range(episodes)])
        for first in range(0, len(steps), batch):
            rb.extend(steps[first : first + batch])
        return len(steps)

    def stage(self, steps: int) -> int:
        """Stage steps of an episode and never end it (the test kills this actor)."""
        self.writer.extend(episode(self.writer_id, 0, steps))
        return self.writer.pending


Writer: Any = ray.remote(num_cpus=0)(WriterActor)  # its handles' methods have .remote, which no type says
