"""Tutorial 8: the sharded replay on a Ray cluster, filled by TorchRL's RayCollector.

Where tutorial 5 launches the job with ``torchrun``, most multi-node RL
places its processes with Ray: TorchRL's ``RayCollector`` and its Ray replay
buffer, and the LLM-RL stacks. Here Ray places the shard owners too:

* ``ShardedGearStorage.on_ray(max_size, num_shards=N)`` starts N owner actors
  (a placement group spread over the nodes), each holding a shard of
  ``max_size`` rows in shared memory and serving it over tcp;
* ``GearRayReplayBuffer(storage=..., sampler=..., batch_size=...)`` is a
  ``TensorDictReplayBuffer`` over it that speaks TorchRL's replay-service
  protocol, so ``RayCollector(..., replay_buffer=rb)`` takes it: each remote
  collector gets a client, which writes its batches straight into the shards
  (shared memory on an owner's node, tcp elsewhere), never through one actor;
* the learner samples ``rb`` with any gear sampler, as under torchrun.

What Ray does for us: placing the owners, restarting them (``max_restarts``,
from their last checkpoint), and telling every process where they are and the
job's secret (actor calls). What it does not: carry rows. They never go
through Ray's object store.

Run it on one machine (a local Ray cluster on 2 CPUs; every server on loopback):

    python tutorials/08_ray.py                                   # what CI runs, smaller
    python tutorials/08_ray.py --address auto --serve-on 0.0.0.0 # on a running cluster

The learner trains a small dynamics model on windows of 8 steps, a few steps
for each batch the collectors write, and reports the rows each shard holds.
"""

from __future__ import annotations

import argparse
import time

import ray
import torch
from torch import nn
from torchrl.collectors.distributed import RayCollector
from torchrl.envs.libs.gym import GymEnv

from gear_torchrl import GearRayReplayBuffer, GearSequenceSampler, ShardedGearStorage


def make_env() -> GymEnv:
    return GymEnv("CartPole-v1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--collectors", type=int, default=2)
    parser.add_argument("--frames", type=int, default=20_000, help="frames the collectors gather in all")
    parser.add_argument("--capacity", type=int, default=50_000, help="rows per shard")
    parser.add_argument("--updates", type=int, default=4, help="learner steps per batch the collectors write")
    parser.add_argument("--address", default=None, help="a running cluster's address (default: start one here)")
    parser.add_argument("--serve-on", default="127.0.0.1", help="the address shard servers bind")
    args = parser.parse_args()

    if args.address is None:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=args.address)
    # Owners reserve no CPU here (2 cores in all); on a real cluster keep the default, 1 each.
    storage = ShardedGearStorage.on_ray(args.capacity, num_shards=args.shards, num_cpus=0, serve_on=args.serve_on)
    seq_len = 8
    rb = GearRayReplayBuffer(storage=storage, sampler=GearSequenceSampler(seq_len), batch_size=32 * seq_len)
    collector = RayCollector(
        [make_env] * args.collectors,
        policy=None,  # random actions: this lesson is about the replay, not the policy
        frames_per_batch=200,
        total_frames=args.frames,
        replay_buffer=rb,
        remote_configs={"num_cpus": 0},
    )
    model = nn.Sequential(nn.Linear(5, 64), nn.ReLU(), nn.Linear(64, 4))  # (obs, action) -> next obs
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    began, losses = time.monotonic(), []
    for _ in collector:  # each turn: the remote collectors wrote a batch straight into the shards
        if len(storage) < 32 * seq_len * 4:  # enough whole windows to start
            continue
        for _ in range(args.updates):
            batch = rb.sample()  # windows from every shard
            x = torch.cat([batch["observation"], batch["action"].float().argmax(-1, keepdim=True)], -1)
            loss = (model(x) - batch["next", "observation"]).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(loss.item())
    elapsed = time.monotonic() - began
    collector.shutdown()

    rows = [stats["rows"] for stats in ray.get([owner.stats.remote() for owner in storage.owners])]
    print(f"learner: {len(losses)} steps in {elapsed:.1f} s, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print("rows per shard: " + ", ".join(f"shard {s} {n}" for s, n in enumerate(rows)))
    print(f"transports: {[storage.transport_of(s) for s in range(storage.num_shards)]}")
    rb.shutdown()  # the owners end and free their memory
    ray.shutdown()


if __name__ == "__main__":
    main()
