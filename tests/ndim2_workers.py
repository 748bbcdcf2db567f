"""``[num_envs, T]`` batches with known contents, and process bodies for the shared ``ndim=2`` tests."""

from __future__ import annotations

import torch
from tensordict import TensorDict

ENVS = 4


class EnvSteps:
    """Successive ``[num_envs, T]`` batches of one writer, as a batched-env collector writes them.

    Every step says where it came from: ``writer``, ``batch``, ``env``, ``step`` (time since the writer's start),
    and ``obs[..., 0] = step * 10 + env + 1000 * writer``. Trajectory ids are unique across writers.
    """

    def __init__(
        self, num_envs: int = ENVS, writer: int = 0, seed: int = 0, done_prob: float = 0.2, traj_ids: bool = True
    ) -> None:
        self.num_envs, self.writer, self.done_prob, self.traj_ids = num_envs, writer, done_prob, traj_ids
        self.generator = torch.Generator().manual_seed(seed + 7919 * writer)
        self.episode = torch.zeros(num_envs, dtype=torch.int64)
        self.time = 0
        self.batches = 0

    def batch(self, steps: int) -> TensorDict:
        done = torch.rand(self.num_envs, steps, generator=self.generator) < self.done_prob
        env = torch.arange(self.num_envs).unsqueeze(1).expand(self.num_envs, steps)
        step = torch.arange(self.time, self.time + steps).expand(self.num_envs, steps)
        episode = self.episode.unsqueeze(1) + torch.cumsum(done, 1) - done.long()  # a done step ends its episode
        self.episode += done.sum(1)
        self.time += steps
        obs = torch.zeros(self.num_envs, steps, 3)
        obs[..., 0] = (step * 10 + env + 1000 * self.writer).float()
        data = {
            "obs": obs,
            "env": env.clone(),
            "step": step.clone(),
            "writer": torch.full((self.num_envs, steps), self.writer),
            "batch": torch.full((self.num_envs, steps), self.batches),
            ("next", "done"): done.unsqueeze(-1),
        }
        self.batches += 1
        if self.traj_ids:
            data["collector", "traj_ids"] = self.writer * 10**6 + env * 10**4 + episode
        return TensorDict(data, [self.num_envs, steps])


def extend_batches(handle, writer: int, batches: int, traj_ids: bool) -> None:
    """Attach to a shared ``ndim=2`` store and extend it with ``batches`` batches of 3 to 5 time steps."""
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearStorage

    rb = TensorDictReplayBuffer(storage=GearStorage(0, handle=handle), dim_extend=1)
    envs = EnvSteps(writer=writer, traj_ids=traj_ids)
    for k in range(batches):
        rb.extend(envs.batch(3 + k % 3))
