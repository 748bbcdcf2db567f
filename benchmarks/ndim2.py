"""``[T, num_envs]`` storages (``ndim=2``): GearStorage against LazyTensorStorage, same buffer, same data.

Extends of ``[num_envs, T]`` batches (``dim_extend=1``, as batched-env collectors give
them), uniform steps, and windows (``GearSequenceSampler`` against TorchRL's
``SliceSampler`` over the same storage shape), through a local and a shared
(``shared=True``) GearStorage. Interleaved medians, one thread.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ndim2.py [--envs 16] [--steps 65536] [--out FILE]
"""

from __future__ import annotations

import argparse
import logging

import torch
from harness import interleaved_medians, table, write_json
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, SliceSampler, TensorDictReplayBuffer

from gear_torchrl import GearSequenceSampler, GearStorage


def env_batch(envs: int, t: int, first: int) -> TensorDict:
    """``[envs, t]`` steps of 50-step episodes, as a batched env's collector returns them."""
    step = torch.arange(first, first + t).expand(envs, t)
    done = ((step + torch.arange(envs).unsqueeze(1) * 7) % 50 == 49).unsqueeze(-1)
    return TensorDict(
        {
            "obs": torch.randn(envs, t, 64),
            "action": torch.zeros(envs, t, dtype=torch.long),
            ("next", "done"): done,
            ("next", "reward"): torch.randn(envs, t, 1),
        },
        [envs, t],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=65536, help="steps stored (time rows x envs)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    chunk = env_batch(args.envs, 200, 0)
    fns = {}
    stores = (
        ("GearStorage", GearStorage),
        ("LazyTensorStorage", LazyTensorStorage),
        ("shared GearStorage", lambda n, ndim: GearStorage(n, ndim=ndim, shared=True)),
    )
    for label, make in stores:

        def buffer(sampler=None, batch=256, make=make):
            rb = TensorDictReplayBuffer(
                storage=make(args.steps, ndim=2),
                dim_extend=1,
                batch_size=batch,
                **({} if sampler is None else {"sampler": sampler}),
            )
            for first in range(0, args.steps // args.envs, 200):
                rb.extend(env_batch(args.envs, 200, first))
            return rb

        uniform = buffer()
        windows_sampler = (
            SliceSampler(slice_len=32, end_key=("next", "done"), strict_length=True)
            if label == "LazyTensorStorage"
            else GearSequenceSampler(32, strict_length=True)
        )
        windows = buffer(windows_sampler, batch=64 * 32)
        fns[f"extend [{args.envs}, 200] / {label}"] = lambda rb=uniform: rb.extend(chunk)
        fns[f"256 uniform steps / {label}"] = uniform.sample
        fns[f"64 windows of 32 / {label}"] = windows.sample
    times = interleaved_medians(fns, repeats=args.repeats, inner=10)
    results = []
    for op in (f"extend [{args.envs}, 200]", "256 uniform steps", "64 windows of 32"):
        lazy = times[f"{op} / LazyTensorStorage"]
        for label, suffix in (("GearStorage", ""), ("shared GearStorage", " (shared)")):
            gear = times[f"{op} / {label}"]
            results.append(
                {
                    "op": op + suffix,
                    "gear_ms": round(gear * 1e3, 3),
                    "torchrl_ms": round(lazy * 1e3, 3),
                    "gear_speedup": round(lazy / gear, 2),
                }
            )
    print(f"ndim=2, {args.envs} envs, {args.steps:,} steps stored; one thread, median of {args.repeats}")
    print(table(results, ["op", "gear_ms", "torchrl_ms", "gear_speedup"]))
    write_json(args.out, {"benchmark": "ndim2", "envs": args.envs, "steps": args.steps, "results": results})


if __name__ == "__main__":
    main()
