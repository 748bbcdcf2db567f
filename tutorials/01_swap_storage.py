"""Tutorial 1: swap GearStorage into an existing TorchRL replay buffer.

Below is an ordinary TorchRL training loop: a replay buffer of transitions, a
learner that samples batches and takes gradient steps. Moving it to
gear_torchrl changes one line, the storage; everything else, samplers and
writers included, stays TorchRL's. The script runs the same loop with both
storages, in interleaved rounds (medians), and prints what the swap bought.

    .venv/bin/python tutorials/01_swap_storage.py [--steps 1000000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from measured import compared, interleaved_medians  # tutorials/measured.py: medians, and words that match
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from gear_torchrl import GearStorage


def make_buffer(storage, batch_size: int) -> TensorDictReplayBuffer:
    # This is the whole change:
    #   before:  TensorDictReplayBuffer(storage=LazyTensorStorage(n), batch_size=...)
    #   after:   TensorDictReplayBuffer(storage=GearStorage(n), batch_size=...)
    return TensorDictReplayBuffer(storage=storage, batch_size=batch_size)


def collect(num_steps: int) -> TensorDict:
    """What a collector would hand us: observations, actions, rewards, done flags."""
    done = torch.rand(num_steps, 1) < 1 / 200
    return TensorDict(
        {
            "observation": torch.randn(num_steps, 84),
            "action": torch.randint(0, 6, (num_steps,)),
            ("next", "observation"): torch.randn(num_steps, 84),
            ("next", "reward"): torch.randn(num_steps, 1),
            ("next", "done"): done,
        },
        [num_steps],
    )


def train(rb: TensorDictReplayBuffer, q_net: torch.nn.Module, updates: int) -> float:
    """A learner's loop: sample, compute a loss, step. Returns seconds per update."""
    optimizer = torch.optim.SGD(q_net.parameters(), lr=1e-3)
    start = time.perf_counter()
    for _ in range(updates):
        batch = rb.sample()
        q = q_net(batch["observation"]).gather(1, batch["action"].unsqueeze(1))
        target = batch["next", "reward"] + 0.99 * q_net(batch["next", "observation"]).max(1, keepdim=True).values
        loss = torch.nn.functional.smooth_l1_loss(q, target.detach())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return (time.perf_counter() - start) / updates


def main() -> None:
    parser = argparse.ArgumentParser(description="Swap GearStorage into a TorchRL replay buffer")
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--updates", type=int, default=50, help="updates per storage per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each timing both storages in turn")
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.manual_seed(0)

    data = collect(args.steps)
    q_net = torch.nn.Linear(84, 6)  # small on purpose: the loop's cost is the replay buffer's
    buffers = {
        "LazyTensorStorage": make_buffer(LazyTensorStorage(args.steps), args.batch),
        "GearStorage": make_buffer(GearStorage(args.steps), args.batch),
    }
    for rb in buffers.values():
        rb.extend(data)
        train(rb, q_net, 10)  # warm up
    seconds = interleaved_medians(
        {name: lambda rb=rb: train(rb, q_net, args.updates) for name, rb in buffers.items()}, args.rounds
    )
    for name, s in seconds.items():
        print(f"{name:<18} {s * 1e3:7.3f} ms per update ({args.batch / s / 1e6:5.2f} M sampled steps/s)")
    speed = compared(1 / seconds["GearStorage"], 1 / seconds["LazyTensorStorage"])
    print(
        f"Same training code, one line changed: updates {speed} with GearStorage "
        f"(medians of {args.rounds} interleaved rounds)"
    )


if __name__ == "__main__":
    main()
