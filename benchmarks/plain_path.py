"""The plain tensor path through TorchRL's buffer: uniform sample, get, extend, add (GearStorage, LazyTensorStorage).

A third contender is a GearStorage with a rate limiter whose rule never blocks
(``limiter.attach(rb)``): what checking and counting add to each call; a fourth
a shared GearStorage (named shared memory, the commit log's read sections).

What a store of plain tensors costs per call, for comparing one version of
gear_torchrl with another (run each with its own PYTHONPATH, in turns). Times
are process CPU time on one thread, the median of interleaved repetitions: on
a shared machine other jobs stretch wall-clock time (this one saw 10x swings
under a load of 10 on 2 cores), far less the CPU time a call itself spends.

    .venv/bin/python benchmarks/plain_path.py [--rows 1000000] [--batch 4096] [--repeats 9] [--out FILE]
"""

from __future__ import annotations

import argparse
import logging
import math
import time

import torch
from harness import interleaved_medians, table, write_json
from storage_sampling import LAYOUTS, make_chunk
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import gear_torchrl
from gear_torchrl import GearStorage, RateLimiter

LIMITED = "GearStorage + RateLimiter"
SHARED = "GearStorage(shared=True)"
CONTENDERS = {
    "GearStorage": GearStorage,
    "LazyTensorStorage": LazyTensorStorage,
    LIMITED: GearStorage,
    SHARED: lambda n: GearStorage(n, shared=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="capacity, filled before sampling")
    parser.add_argument("--batch", type=int, default=4096, help="rows per sample and per extend")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=None, help="write results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    layout, _ = LAYOUTS["vector"]
    chunk = make_chunk(layout, args.batch, seed=0)
    step = chunk[0].clone()
    contenders = {}
    for label, make in CONTENDERS.items():
        rb = TensorDictReplayBuffer(storage=make(args.rows), batch_size=args.batch)
        if label == LIMITED:  # a rule that never blocks: what checking and counting cost
            RateLimiter(1.0, 1, -math.inf, math.inf).attach(rb)
        for first in range(0, args.rows, 65536):
            rb.extend(make_chunk(layout, min(65536, args.rows - first), seed=first))
        contenders[f"sample / {label}"] = rb.sample
        # rows every store holds at all times (a wrapped shared store frees 1/64 of its ring ahead of its writers)
        index = torch.randint(0, len(rb) * 63 // 64, (args.batch,), generator=torch.Generator().manual_seed(0))
        contenders[f"get / {label}"] = lambda rb=rb, index=index: rb.storage.get(index)
        contenders[f"extend / {label}"] = lambda rb=rb: rb.extend(chunk)
        contenders[f"add / {label}"] = lambda rb=rb: rb.add(step)
    times = interleaved_medians(contenders, repeats=args.repeats, inner=20, warmup=1, clock=time.process_time)
    results = []
    for op in ("sample", "get", "extend", "add"):
        gear = times[f"{op} / GearStorage"]
        for label in CONTENDERS:
            t = times[f"{op} / {label}"]
            results.append(
                {"op": op, "storage": label, "us_cpu": round(t * 1e6, 1), "gear_speedup": round(t / gear, 2)}
            )
    print(
        f"gear_torchrl from {gear_torchrl.__file__}; {args.rows:,} rows, batch {args.batch} (extend), one step "
        f"(add); CPU time on one thread, median of {args.repeats}"
    )
    print(table(results, ["op", "storage", "us_cpu", "gear_speedup"]))
    write_json(args.out, {"benchmark": "plain_path", "rows": args.rows, "batch": args.batch, "results": results})


if __name__ == "__main__":
    main()
