"""Prioritized sample + update loop: GearPrioritizedSampler against TorchRL's PrioritizedSampler.

Both on the same 1M stored steps; one iteration = sample a batch through the
replay buffer, then update the batch's priorities (the PER training loop).

    .venv/bin/python benchmarks/prioritized_sampling.py [--rows 1000000] [--out bench_out/prioritized.json]
"""

from __future__ import annotations

import argparse
import logging

import torch
from harness import interleaved_medians, table, write_json
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, PrioritizedSampler, RandomSampler, TensorDictReplayBuffer

from gear_torchrl import GearPrioritizedSampler, GearStorage

FLOOR = "uniform sample alone: GearStorage + RandomSampler"


def steps(n: int) -> TensorDict:
    return TensorDict(
        {
            "obs": torch.randn(n, 84),
            "action": torch.randint(0, 10, (n,)),
            "reward": torch.randn(n),
            "done": torch.rand(n) < 0.001,
        },
        [n],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)

    data = steps(args.rows)
    contenders = {
        "GearStorage + GearPrioritizedSampler": TensorDictReplayBuffer(
            storage=GearStorage(args.rows), sampler=GearPrioritizedSampler(args.rows, 0.7, 0.5), batch_size=args.batch
        ),
        "LazyTensorStorage + PrioritizedSampler (TorchRL)": TensorDictReplayBuffer(
            storage=LazyTensorStorage(args.rows), sampler=PrioritizedSampler(args.rows, 0.7, 0.5), batch_size=args.batch
        ),
        "LazyTensorStorage + GearPrioritizedSampler": TensorDictReplayBuffer(
            storage=LazyTensorStorage(args.rows),
            sampler=GearPrioritizedSampler(args.rows, 0.7, 0.5),
            batch_size=args.batch,
        ),
    }
    for rb in contenders.values():
        rb.extend(data)
        rb.update_priority(torch.arange(args.rows), torch.rand(args.rows) + 0.01)

    def loop(rb):
        def step():
            sample = rb.sample()
            sample["td_error"] = torch.rand(args.batch)
            rb.update_tensordict_priority(sample)

        return step

    def sampler_only(rb):
        def step():
            index, _ = rb.sampler.sample(rb.storage, args.batch)
            rb.sampler.update_priority(index, torch.rand(args.batch))

        return step

    # The floor of any PER loop through this buffer on our storage: the same batch, drawn
    # uniformly (no priorities to draw, weigh or update), gathered and returned by TorchRL's code.
    floor = TensorDictReplayBuffer(storage=GearStorage(args.rows), sampler=RandomSampler(), batch_size=args.batch)
    floor.extend(data)

    fns = {f"loop / {k}": loop(rb) for k, rb in contenders.items()}
    fns.update({f"sampler only / {k}": sampler_only(rb) for k, rb in contenders.items()})
    fns[FLOOR] = floor.sample
    times = interleaved_medians(fns, repeats=args.repeats, inner=5)
    ref = "LazyTensorStorage + PrioritizedSampler (TorchRL)"
    rows = []
    for kind in ("loop", "sampler only"):
        base = times[f"{kind} / {ref}"]
        for name in contenders:
            t = times[f"{kind} / {name}"]
            rows.append(
                {
                    "what": kind,
                    "contender": name,
                    "ms_per_iter": round(t * 1e3, 3),
                    "speedup_vs_torchrl": round(base / t, 2),
                }
            )
    loop_base = times[f"loop / {ref}"]
    rows.append(
        {
            "what": "floor",
            "contender": FLOOR,
            "ms_per_iter": round(times[FLOOR] * 1e3, 3),
            "speedup_vs_torchrl": round(loop_base / times[FLOOR], 2),
        }
    )
    print(f"== prioritized sample+update, {args.rows:,} steps, batch {args.batch} (median of {args.repeats}) ==")
    print(table(rows, ["what", "contender", "ms_per_iter", "speedup_vs_torchrl"]))
    print(f"the floor allows at most {loop_base / times[FLOOR]:.2f}x TorchRL's loop, before any priority work")
    write_json(args.out, {"benchmark": "prioritized_sampling", "rows": args.rows, "batch": args.batch, "results": rows})


if __name__ == "__main__":
    main()
