"""Prioritized sample + update on the GPU against TorchRL's PrioritizedSampler (CPU trees).

Batch 4096 over 10M rows: draw a batch, then write new priorities for it,
the PER loop's sampler work. Median of repetitions, synchronized.

    python benchmarks/gpu_prioritized_sampling.py [--rows 10000000] [--out gpu_prioritized.json]
"""
from __future__ import annotations

import argparse
import logging

import torch
from harness import cuda_median_seconds, table, write_json
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, PrioritizedSampler

from gear_torchrl import GearPrioritizedSampler


def loop(sampler, storage, batch, device):
    def step():
        index, _ = sampler.sample(storage, batch)
        sampler.update_priority(index, torch.rand(batch, device=device) + 0.01)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    n = args.rows
    storage = LazyTensorStorage(n)
    storage.set(torch.arange(n), TensorDict({"x": torch.zeros(n, dtype=torch.uint8)}, [n]))
    priorities = torch.rand(n) + 0.01
    contenders = {
        "GearPrioritizedSampler(device='cuda')": (lambda: GearPrioritizedSampler(n, 0.7, 0.5, device="cuda"), "cuda"),
        "GearPrioritizedSampler (CPU trees)": (lambda: GearPrioritizedSampler(n, 0.7, 0.5), "cpu"),
        "TorchRL PrioritizedSampler (CPU trees)": (lambda: PrioritizedSampler(n, 0.7, 0.5), "cpu"),
    }
    times = {}
    for name, (make, device) in contenders.items():
        try:
            sampler = make()
            sampler.mark_update(torch.arange(n))
            sampler.update_priority(torch.arange(n), priorities)
            times[name] = cuda_median_seconds(loop(sampler, storage, args.batch, device), inner=10)
        except Exception as err:  # torchrl's C++ trees need the torch they were built for
            print(f"{name}: not measured here ({type(err).__name__}: {err})")
    base = times.get("TorchRL PrioritizedSampler (CPU trees)", times["GearPrioritizedSampler (CPU trees)"])
    rows = [{"contender": k, "ms_per_iter": round(t * 1e3, 3), "x_vs_torchrl": round(base / t, 2)}
            for k, t in times.items()]
    print(f"== {torch.cuda.get_device_name()}: sample + update, batch {args.batch} over {n:,} rows ==")
    print(table(rows, ["contender", "ms_per_iter", "x_vs_torchrl"]))
    write_json(args.out, {"benchmark": "gpu_prioritized_sampling", "device": torch.cuda.get_device_name(),
                          "rows": n, "batch": args.batch, "results": rows})


if __name__ == "__main__":
    main()
