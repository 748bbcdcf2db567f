"""Quick start: GearStorage inside a TorchRL replay buffer, and how fast it samples.

One line changes in an existing TorchRL program: the storage. This script
fills three replay buffers with the same steps (GearStorage, TorchRL's
LazyTensorStorage and LazyMemmapStorage), samples uniform batches from each,
and prints their throughput side by side.

    make quickstart            # or: .venv/bin/python quickstart.py --steps 1000000
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer

from gear_torchrl import GearStorage


def collect(num_steps: int) -> TensorDict:
    """Stand-in for a collector: steps of 84-float observations in 500-step episodes."""
    done = torch.zeros(num_steps, 1, dtype=torch.bool)
    done[499::500] = True
    return TensorDict(
        {
            "observation": torch.randn(num_steps, 84),
            "action": torch.randint(0, 6, (num_steps,)),
            ("next", "reward"): torch.randn(num_steps, 1),
            ("next", "done"): done,
        },
        batch_size=[num_steps],
    )


def samples_per_second(rb: TensorDictReplayBuffer, repeats: int = 7, inner: int = 20) -> float:
    for _ in range(3):
        rb.sample()
    per_batch = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            rb.sample()
        per_batch.append((time.perf_counter() - start) / inner)
    return rb._batch_size / statistics.median(per_batch)


def main() -> None:
    parser = argparse.ArgumentParser(description="GearStorage quick start")
    parser.add_argument("--steps", type=int, default=500_000)
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)

    data = collect(args.steps)
    with tempfile.TemporaryDirectory() as scratch:
        storages = {
            "GearStorage": GearStorage(args.steps),  # <- the one line that changes
            "LazyTensorStorage": LazyTensorStorage(args.steps),
            "LazyMemmapStorage": LazyMemmapStorage(args.steps, scratch_dir=scratch),
        }
        rates = {}
        for name, storage in storages.items():
            rb = TensorDictReplayBuffer(storage=storage, batch_size=args.batch)
            rb.extend(data)
            rates[name] = samples_per_second(rb)

        gear = storages["GearStorage"]
        print(f"{gear}\n")
        print(
            f"Uniform batches of {args.batch} from {args.steps:,} stored steps "
            f"({gear.shard.episodes.num_episodes} episodes):"
        )
        for name, rate in rates.items():
            print(f"  {name:<18} {rate / 1e6:6.2f} M steps/s   GearStorage is {rates['GearStorage'] / rate:4.2f}x this")


if __name__ == "__main__":
    main()
