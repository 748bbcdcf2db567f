"""Batches through a DataLoader: GearDataset's workers against sampling directly and against TorchRL's buffer.

For each way of getting batches, in one run: batches/s over ``--batches`` batches
once the first has arrived, and the time from ``iter(loader)`` to the first batch
(worker start-up included). Median of ``--repeats`` rounds; the ways take turns in
every round, so a busy machine slows all alike, and ratios to direct sampling are
the median of each round's ratio. Two consumers: ``consume`` takes the
batch and asks for the next; ``train`` runs a small MLP step on it first, as a
learner would, which is where workers can help: they sample while
this process trains.

- direct: ``rb.sample()`` in this process (GearStorage shared, and TorchRL's
  ``LazyTensorStorage`` + ``RandomSampler``);
- GearDataset(rb, prefetch=2).loader(num_workers=0 | 2): 2 workers hand batches over
  through shared-memory slots (the default), or pickled (``batch_slots=0``, what a
  plain DataLoader does), started as ``loader()`` chooses (fork here) or by spawn;
- TorchRL's buffer in a DataLoader the same way: an ``IterableDataset`` yielding
  ``rb.sample()``, ``DataLoader(batch_size=None, num_workers=0 | 2)``, its workers
  started by TorchRL's default (spawn), batches pickled through the queue.

    .venv/bin/python benchmarks/dataloader.py [--rows 100000] [--batch 512] [--batches 300] [--repeats 3] \
        [--threads 1] [--out bench_out/dataloader.json]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from harness import table, write_json
from tensordict import TensorDict
from torch.utils.data import DataLoader, IterableDataset
from torchrl.data import LazyTensorStorage, RandomSampler, TensorDictReplayBuffer

from gear_torchrl import GearDataset, GearStorage

OBS = 84


def steps(n: int, seed: int) -> TensorDict:
    """Vector-observation transitions: obs f32[84], next obs, action, reward, done (685 B a step)."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(n, OBS, generator=g),
            "action": torch.randint(0, 6, (n,), generator=g),
            "next": {
                "obs": torch.randn(n, OBS, generator=g),
                "reward": torch.randn(n, 1, generator=g),
                "done": torch.rand(n, 1, generator=g) < 0.01,
            },
        },
        [n],
    )


class Sampled(IterableDataset):
    """TorchRL's buffer as a stream of ``rb.sample()``, the way one puts it in a DataLoader by hand."""

    def __init__(self, rb: Any) -> None:
        self.rb = rb

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.rb.sample()


def as_is(batch: Any) -> Any:
    return batch


class Learner:
    """A small MLP trained on each batch's observations: the work a learner does between batches."""

    def __init__(self) -> None:
        self.net = torch.nn.Sequential(torch.nn.Linear(OBS, 256), torch.nn.ReLU(), torch.nn.Linear(256, 6))
        self.opt = torch.optim.SGD(self.net.parameters(), lr=1e-3)

    def __call__(self, batch: Any) -> None:
        loss = self.net(batch["obs"]).logsumexp(-1).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


def ways(gear: Any, torchrl: Any, workers: int) -> dict[str, Callable[[], Iterator[Any]]]:
    """Each way, as a function that starts a fresh stream of batches."""

    def direct(rb: Any) -> Callable[[], Iterator[Any]]:
        return lambda: iter(rb.sample, None)

    return {
        "direct rb.sample / GearStorage": direct(gear),
        "direct rb.sample / LazyTensorStorage": direct(torchrl),
        "GearDataset, 0 workers": lambda: iter(GearDataset(gear, prefetch=2).loader(num_workers=0)),
        f"GearDataset, {workers} workers (slots)": lambda: iter(
            GearDataset(gear, prefetch=2).loader(num_workers=workers)
        ),
        f"GearDataset, {workers} workers (pickled)": lambda: iter(
            GearDataset(gear, prefetch=2).loader(num_workers=workers, batch_slots=0)
        ),
        f"GearDataset, {workers} workers (slots, spawn)": lambda: iter(
            GearDataset(gear, prefetch=2).loader(num_workers=workers, multiprocessing_context="spawn")
        ),
        "TorchRL buffer in a DataLoader, 0 workers": lambda: iter(
            DataLoader(Sampled(torchrl), batch_size=None, collate_fn=as_is, num_workers=0)
        ),
        f"TorchRL buffer in a DataLoader, {workers} workers": lambda: iter(
            DataLoader(Sampled(torchrl), batch_size=None, collate_fn=as_is, num_workers=workers)
        ),
    }


def measure(start: Callable[[], Iterator[Any]], batches: int, learner: Learner | None) -> tuple[float, float]:
    """(seconds to the first batch, batches/s after it) for one fresh stream."""
    began = time.perf_counter()
    stream = start()
    batch = next(stream)
    first = time.perf_counter() - began
    began = time.perf_counter()
    for _ in range(batches):
        if learner is not None:
            learner(batch)
        batch = next(stream)
    rate = batches / (time.perf_counter() - began)
    del stream, batch
    gc.collect()  # stop the workers before the next way starts
    return first, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--batches", type=int, default=300, help="batches timed per stream, after the first")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["consume", "train"], choices=["consume", "train"])
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads here (with workers on 2 cores, more make every step wait on the others)",
    )
    parser.add_argument("--out", default=None, help="write results as JSON here")
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    storage = GearStorage(args.rows, shared=True)
    gear = TensorDictReplayBuffer(storage=storage, batch_size=args.batch)
    torchrl = TensorDictReplayBuffer(
        storage=LazyTensorStorage(args.rows), sampler=RandomSampler(), batch_size=args.batch
    )
    for first in range(0, args.rows, 10_000):
        chunk = steps(min(10_000, args.rows - first), seed=first)
        gear.extend(chunk)
        torchrl.extend(chunk)
    try:
        results = []
        for mode in args.modes:
            torch.manual_seed(0)
            learner = Learner() if mode == "train" else None
            contenders = ways(gear, torchrl, args.workers)
            firsts: dict[str, list[float]] = {name: [] for name in contenders}
            rates: dict[str, list[float]] = {name: [] for name in contenders}
            for _ in range(args.repeats):
                for name, start in contenders.items():
                    first, rate = measure(start, args.batches, learner)
                    firsts[name].append(first)
                    rates[name].append(rate)
            base = rates["direct rb.sample / GearStorage"]
            for name in contenders:
                rate = statistics.median(rates[name])
                # Ratio to direct sampling round by round, then the median: a slow moment of
                # the machine weighs on one round, not on one way.
                ratio = statistics.median(r / b for r, b in zip(rates[name], base))
                results.append(
                    {
                        "mode": mode,
                        "way": name,
                        "batches_per_s": round(rate),
                        "vs_direct_gear": round(ratio, 2),
                        "first_batch_s": round(statistics.median(firsts[name]), 3),
                        "runs_batches_per_s": [round(r) for r in rates[name]],
                        "runs_first_batch_s": [round(f, 3) for f in firsts[name]],
                    }
                )
    finally:
        storage.close()
    print(
        f"\n== batch {args.batch} of {args.rows:,} steps, {args.batches} batches per stream, "
        f"median of {args.repeats} =="
    )
    print(table(results, ["mode", "way", "batches_per_s", "vs_direct_gear", "first_batch_s"]))
    load = {"before": load_before, "after": os.getloadavg()}
    print(
        f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}: other processes share "
        "these cores when it is above the workers' count"
    )
    write_json(
        args.out,
        {
            "benchmark": "dataloader",
            "rows": args.rows,
            "batch": args.batch,
            "batches": args.batches,
            "workers": args.workers,
            "repeats": args.repeats,
            "threads": args.threads,
            "load_average": load,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
