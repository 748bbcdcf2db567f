"""A learner's split of a batch's priority updates across owners: ``_C.split_updates`` (checks, stable grouping
by owner, each owner's POST_UPDATE framed) against the same work in tensor ops and ``wire.encode``, as
``ShardSet.update`` did it before (session 26).

Batches of ``--batch`` updates over 1 and 8 owners of 25,000 rows each, the priorities checked as floats;
each figure is the median over ``--repeats`` of this process's CPU time per call, the contenders taking
turns (one thread):

    .venv/bin/python benchmarks/probes/update_split.py [--batch 256] [--repeats 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import time

import _harness_path  # noqa: F401  (benchmarks/ on sys.path: harness, sharded_cost)
import torch
from harness import interleaved_medians, machine, table, write_json

from gear_torchrl.distributed import wire
from gear_torchrl.distributed.shard_client import rule_meta, update_message
from gear_torchrl.kernels import _C
from gear_torchrl.selection.checked_inputs import as_priority, refuse_out_of_range, shaped_priority
from gear_torchrl.selection.priorities import PrioritySpec

ROWS = 25_000
RULE = PrioritySpec(alpha=0.6)


def in_tensor_ops(shards: torch.Tensor, rows: torch.Tensor, priority: torch.Tensor) -> list[bytes]:
    """The split as tensor ops: a stable sort by owner, then each owner's rows checked and its message encoded."""
    priority = as_priority(priority, rows.numel())
    order = torch.argsort(shards, stable=True)
    ids, counts = torch.unique_consecutive(shards[order], return_counts=True)
    sizes = counts.tolist()
    parts = zip(ids.tolist(), rows[order].split(sizes), priority[order].split(sizes))
    frames = []
    for _, owner_rows, owner_priority in parts:
        lo, hi = torch.aminmax(owner_rows)
        refuse_out_of_range(int(lo), int(hi), ROWS, None)
        frames.append(wire.encode(update_message(RULE, owner_rows, owner_priority, None, posted=True)))
    return frames


def in_one_call(shards: torch.Tensor, rows: torch.Tensor, priority: torch.Tensor, owners: int) -> list[bytes]:
    priority = shaped_priority(priority, rows.numel())
    return _C.split_updates(shards, rows, priority, None, [ROWS] * owners, wire.Op.POST_UPDATE, rule_meta(RULE))[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows_out = []
    for owners in (1, 8):
        generator = torch.Generator().manual_seed(owners)
        shards = torch.randint(0, owners, (args.batch,), generator=generator)
        rows = torch.randint(0, ROWS, (args.batch,), generator=generator)
        priority = torch.rand(args.batch, generator=generator) + 0.1
        assert in_tensor_ops(shards, rows, priority) == in_one_call(shards, rows, priority, owners)
        got = interleaved_medians(
            {
                "tensor ops": functools.partial(in_tensor_ops, shards, rows, priority),
                "one call": functools.partial(in_one_call, shards, rows, priority, owners),
            },
            repeats=args.repeats,
            inner=200,
            clock=time.process_time,
        )
        rows_out.append(
            {
                "owners": owners,
                "batch": args.batch,
                "tensor ops us": f"{got['tensor ops'] * 1e6:.1f}",
                "one call us": f"{got['one call'] * 1e6:.1f}",
                "speedup": f"{got['tensor ops'] / got['one call']:.1f}",
            }
        )
    print(table(rows_out, list(rows_out[0])))
    write_json(args.out, {"benchmark": "update_split", "machine": machine(), "rows": rows_out})


if __name__ == "__main__":
    main()
