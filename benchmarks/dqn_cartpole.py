"""A small workload end to end: DQN on CartPole on a CPU, GearStorage against LazyTensorStorage.

Tutorial 2's loop (TorchRL's collector, Q-network, DQN loss and soft target
updates; prioritized replay, priorities written back after every step), run
for a fixed number of frames without evaluations, so both storages do the
same work: ``--frames`` collected, ``--updates`` gradient steps per 100 frames.
Ours: ``GearStorage`` + ``GearPrioritizedSampler``; TorchRL's:
``LazyTensorStorage`` + ``PrioritizedSampler``, same alpha and beta. Reported:
seconds end to end and the replay's share of them (``extend``, ``sample`` and
``update_tensordict_priority``), median of ``--repeats`` runs; the two take
turns, same seeds, and their ratios are the median of the ratios run by run.
One torch thread, as in the tutorial.

    .venv/bin/python benchmarks/dqn_cartpole.py [--frames 10000] [--repeats 3] [--out bench_out/dqn_cartpole.json]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from harness import table, write_json
from tensordict.nn import TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictReplayBuffer
from torchrl.envs import GymEnv, StepCounter, TransformedEnv
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate

from gear_torchrl import GearPrioritizedSampler, GearStorage

CAPACITY = 50_000


def buffers() -> dict[str, Callable[[], TensorDictReplayBuffer]]:
    return {
        "GearStorage + GearPrioritizedSampler": lambda: TensorDictReplayBuffer(
            storage=GearStorage(CAPACITY), sampler=GearPrioritizedSampler(CAPACITY, alpha=0.6, beta=0.4), batch_size=128
        ),
        "LazyTensorStorage + PrioritizedSampler": lambda: TensorDictReplayBuffer(
            storage=LazyTensorStorage(CAPACITY),
            sampler=PrioritizedSampler(CAPACITY, alpha=0.6, beta=0.4),
            batch_size=128,
        ),
    }


def run(make_rb: Callable[[], TensorDictReplayBuffer], frames: int, updates: int, seed: int) -> dict[str, float]:
    """One training run; seconds in all and in the replay buffer's calls."""
    torch.manual_seed(seed)
    env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter())
    env.set_seed(seed)
    actor = QValueActor(
        MLP(in_features=4, out_features=2, num_cells=[128, 128]), in_keys=["observation"], spec=env.action_spec
    )
    explore = TensorDictSequential(
        actor, EGreedyModule(env.action_spec, eps_init=1.0, eps_end=0.05, annealing_num_steps=frames // 3)
    )
    loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True, double_dqn=True, loss_function="smooth_l1")
    loss.make_value_estimator(gamma=0.99)
    target_update = SoftUpdate(loss, eps=0.98)
    optimizer = torch.optim.Adam(loss.parameters(), lr=5e-4)
    rb = make_rb()
    collector = Collector(
        env,
        explore,
        frames_per_batch=100,
        total_frames=frames,
        init_random_frames=1_000,
        auto_register_policy_transforms=False,
    )
    replay = 0.0
    start = time.perf_counter()
    for batch in collector:
        t = time.perf_counter()
        rb.extend(batch.reshape(-1))
        replay += time.perf_counter() - t
        explore[1].step(batch.numel())
        if len(rb) < 1_000:
            continue
        for _ in range(updates):
            t = time.perf_counter()
            sample = rb.sample()
            replay += time.perf_counter() - t
            loss_td = loss(sample)
            optimizer.zero_grad()
            loss_td["loss"].backward()
            optimizer.step()
            target_update.step()
            t = time.perf_counter()
            rb.update_tensordict_priority(sample)
            replay += time.perf_counter() - t
    total = time.perf_counter() - start
    collector.shutdown()
    return {"total_s": total, "replay_s": replay}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=10_000)
    parser.add_argument("--updates", type=int, default=50, help="gradient steps per 100 collected frames")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write results as JSON here")
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in buffers()}
    for seed in range(args.repeats):
        for name, make in buffers().items():
            runs[name].append(run(make, args.frames, args.updates, seed))
    gear = runs["GearStorage + GearPrioritizedSampler"]
    rows: list[dict[str, Any]] = []
    for name, results in runs.items():
        total = statistics.median(r["total_s"] for r in results)
        replay = statistics.median(r["replay_s"] for r in results)
        # Ratios run by run (same seed, back to back), then their median: a slow moment of
        # the machine then weighs on one pair, not on one side.
        rows.append(
            {
                "replay buffer": name,
                "total_s": round(total, 1),
                "replay_s": round(replay, 2),
                "replay_share": f"{100 * replay / total:.0f}%",
                "total_vs_gear": round(
                    statistics.median(r["total_s"] / g["total_s"] for r, g in zip(results, gear)), 3
                ),
                "replay_vs_gear": round(
                    statistics.median(r["replay_s"] / g["replay_s"] for r, g in zip(results, gear)), 2
                ),
                "runs_total_s": [round(r["total_s"], 1) for r in results],
                "runs_replay_s": [round(r["replay_s"], 2) for r in results],
            }
        )
    updates = (args.frames - 1_000) // 100 * args.updates
    print(
        f"\n== DQN on CartPole, {args.frames:,} frames, {updates:,} updates of batch 128, median of {args.repeats} =="
    )
    print(table(rows, ["replay buffer", "total_s", "replay_s", "replay_share", "total_vs_gear", "replay_vs_gear"]))
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}")
    write_json(
        args.out,
        {
            "benchmark": "dqn_cartpole",
            "frames": args.frames,
            "updates_per_100_frames": args.updates,
            "repeats": args.repeats,
            "load_average": load,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
