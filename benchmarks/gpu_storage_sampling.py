"""Uniform batches onto the GPU through TorchRL's buffer: GearStorage(device="cuda") against TorchRL.

Peers, same data, same batches: TorchRL's LazyTensorStorage on the CPU with
each batch moved to the GPU (``.to("cuda")``, the common path), and
LazyTensorStorage(device="cuda") holding everything in GPU memory. The
contenders take turns (median of 9 turns of 20 batches each), so a noisy
neighbour on a shared machine slows them alike.

    python benchmarks/gpu_storage_sampling.py [--rows 1000000] [--out gpu_storage.json]
"""

from __future__ import annotations

import argparse
import logging

import torch
from harness import interleaved_medians, table, write_json
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from gear_torchrl import GearStorage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--obs", type=int, nargs="+", default=[84])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    n, shape = args.rows, tuple(args.obs)
    data = TensorDict(
        {
            "obs": torch.randn(n, *shape),
            "action": torch.randint(0, 9, (n,)),
            "reward": torch.randn(n),
            "done": torch.rand(n) < 0.001,
        },
        [n],
    )
    buffers = {
        "GearStorage(cuda, host memory)": TensorDictReplayBuffer(
            storage=GearStorage(n, device="cuda"), batch_size=args.batch
        ),
        "GearStorage(cuda, host memory, hot_rows=n/4)": TensorDictReplayBuffer(
            storage=GearStorage(n, device="cuda", hot_rows=n // 4), batch_size=args.batch
        ),
        "GearStorage(cuda, device memory)": TensorDictReplayBuffer(
            storage=GearStorage(n, device="cuda", memory="device"), batch_size=args.batch
        ),
        "LazyTensorStorage(cpu) + .to(cuda)": TensorDictReplayBuffer(
            storage=LazyTensorStorage(n), batch_size=args.batch
        ),
        "LazyTensorStorage(cuda)": TensorDictReplayBuffer(
            storage=LazyTensorStorage(n, device="cuda"), batch_size=args.batch
        ),
    }
    for rb in buffers.values():
        rb.extend(data)
    fns = {k: rb.sample for k, rb in buffers.items()}
    fns["LazyTensorStorage(cpu) + .to(cuda)"] = lambda: (
        buffers["LazyTensorStorage(cpu) + .to(cuda)"].sample().to("cuda", non_blocking=True)
    )
    times = interleaved_medians(fns, repeats=9, inner=20, finish=torch.cuda.synchronize)
    base = times["LazyTensorStorage(cpu) + .to(cuda)"]
    rows = [
        {
            "contender": k,
            "ms_per_batch": round(t * 1e3, 3),
            "Msteps_per_s": round(args.batch / t / 1e6, 2),
            "x_vs_cpu_plus_to_cuda": round(base / t, 2),
        }
        for k, t in times.items()
    ]
    print(f"== {torch.cuda.get_device_name()}: batch {args.batch} from {n:,} steps of obs f32{list(shape)} ==")
    print(table(rows, ["contender", "ms_per_batch", "Msteps_per_s", "x_vs_cpu_plus_to_cuda"]))
    write_json(
        args.out,
        {
            "benchmark": "gpu_storage_sampling",
            "device": torch.cuda.get_device_name(),
            "rows": n,
            "batch": args.batch,
            "obs": list(shape),
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
