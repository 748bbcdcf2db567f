"""GearStorage against TorchRL's LazyTensorStorage and LazyMemmapStorage, in one run.

Uniform batches through a TorchRL replay buffer (the user's path), the gather
alone against a plain ``index_select`` of the same bytes (the practical memory
limit; both into preallocated outputs, each call's rows fresh), and memory per
stored step against the raw bytes.

    .venv/bin/python benchmarks/storage_sampling.py [--rows 1000000] [--out bench_out/storage.json]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import shutil
import tempfile

import torch
from harness import interleaved_medians, table, write_json
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    ReplayBuffer,
    TensorDictReplayBuffer,
)

from gear_torchrl import GearStorage
from gear_torchrl.kernels import _C

_INDEX_POOL = 64  # index tensors each call cycles through: 64 batches of rows outrun any cache

LAYOUTS = {
    # name: (row spec, default rows)
    "vector": (
        {
            "obs": ((84,), torch.float32),
            "action": ((), torch.int64),
            "reward": ((), torch.float32),
            "done": ((), torch.bool),
        },
        1_000_000,
    ),
    "atari": (
        {
            "obs": ((4, 84, 84), torch.uint8),
            "action": ((), torch.int64),
            "reward": ((), torch.float32),
            "done": ((), torch.bool),
        },
        50_000,
    ),
}


def make_chunk(layout: dict, n: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, (shape, dtype) in layout.items():
        if dtype == torch.bool:
            out[key] = torch.rand(n, *shape, generator=g) < 0.001
        elif dtype.is_floating_point:
            out[key] = torch.randn(n, *shape, generator=g).to(dtype)
        else:
            out[key] = torch.randint(0, 100, (n, *shape), generator=g, dtype=dtype)
    return TensorDict(out, [n])


def torchrl_storage_bytes(storage) -> int:
    """Bytes held by a LazyTensorStorage / LazyMemmapStorage (its TensorDict's leaves)."""
    return sum(t.numel() * t.element_size() for t in storage._storage.values(True, True))


def index_select_into(columns: list[torch.Tensor], outs: list[torch.Tensor], index: torch.Tensor) -> None:
    """The plain-torch gather: ``index_select`` of every column into its preallocated output."""
    for column, out in zip(columns, outs):
        torch.index_select(column, 0, index, out=out)


def run_layout(name: str, rows: int, batch: int, repeats: int, scratch: str) -> dict:
    layout, _ = LAYOUTS[name]
    raw_row_bytes = sum(torch.Size(s).numel() * d.itemsize for s, d in layout.values())
    factories = {
        "GearStorage": lambda: GearStorage(rows),
        "LazyTensorStorage": lambda: LazyTensorStorage(rows),
        "LazyMemmapStorage": lambda: LazyMemmapStorage(rows, scratch_dir=os.path.join(scratch, name)),
    }
    buffers = {}
    chunk = max(1, min(rows, (256 << 20) // raw_row_bytes))
    for label, make in factories.items():
        rb = TensorDictReplayBuffer(storage=make(), batch_size=batch)
        for first in range(0, rows, chunk):
            rb.extend(make_chunk(layout, min(chunk, rows - first), seed=first))
        buffers[label] = rb
    plain = {label: ReplayBuffer(storage=rb.storage, batch_size=batch) for label, rb in buffers.items()}

    # Each call reads rows of its own (a fresh index from a pool larger than the caches), so that no
    # contender finds the last call's rows cached; the gather and index_select both write into the same
    # preallocated outputs.
    indices = itertools.cycle([torch.randint(0, rows, (batch,)) for _ in range(_INDEX_POOL)])
    shard = buffers["GearStorage"].storage.shard
    outs = [torch.empty((batch, *c.shape[1:]), dtype=c.dtype) for c in shard.columns]
    contenders = {f"TensorDictReplayBuffer.sample / {k}": rb.sample for k, rb in buffers.items()}
    contenders.update({f"ReplayBuffer.sample / {k}": rb.sample for k, rb in plain.items()})
    contenders.update(
        {f"storage.get / {k}": (lambda rb=rb: rb.storage.get(next(indices))) for k, rb in buffers.items()}
    )
    contenders["gather (extension, all columns)"] = lambda: _C.gather(shard.columns, outs, next(indices))
    contenders["index_select (same bytes)"] = lambda: index_select_into(shard.columns, outs, next(indices))
    times = interleaved_medians(contenders, repeats=repeats, inner=10)

    results = []
    for op in ("TensorDictReplayBuffer.sample", "ReplayBuffer.sample", "storage.get"):
        gear = times[f"{op} / GearStorage"]
        for label in factories:
            t = times[f"{op} / {label}"]
            results.append(
                {
                    "layout": name,
                    "op": op,
                    "storage": label,
                    "ms_per_batch": round(t * 1e3, 3),
                    "Msteps_per_s": round(batch / t / 1e6, 2),
                    "gear_speedup": round(t / gear, 2),
                }
            )
    batch_bytes = batch * raw_row_bytes
    gather = {
        "gather_GBps": round(batch_bytes / times["gather (extension, all columns)"] / 1e9, 2),
        "index_select_GBps": round(batch_bytes / times["index_select (same bytes)"] / 1e9, 2),
    }
    gather["gather_vs_index_select"] = round(gather["gather_GBps"] / gather["index_select_GBps"], 2)
    # TensorDictReplayBuffer stores its own int64 "index" key with every step: it is
    # part of the data all three storages hold, so it counts as raw bytes.
    stored_row_bytes = shard.table.row_bytes
    gear_bytes = shard.nbytes + sum(
        t.numel() * t.element_size() for t in (shard.episodes.start, shard.episodes.length, shard.episodes.closed)
    )
    mem = {
        "raw_bytes_per_step": stored_row_bytes,
        "gear_bytes_per_step": round(gear_bytes / rows, 4),
        "gear_overhead_pct": round(100 * (gear_bytes / rows / stored_row_bytes - 1), 4),
        "LazyTensorStorage_bytes_per_step": round(
            torchrl_storage_bytes(buffers["LazyTensorStorage"].storage) / rows, 4
        ),
    }
    del buffers, plain
    return {"layout": name, "rows": rows, "batch": batch, "results": results, "gather": gather, "memory": mem}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--rows", type=int, default=None, help="rows per layout (default: per layout)")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="write results as JSON here")
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    scratch = tempfile.mkdtemp(prefix="gear_bench_")
    try:
        reports = [
            run_layout(name, args.rows or LAYOUTS[name][1], args.batch, args.repeats, scratch) for name in args.layouts
        ]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for r in reports:
        print(f"\n== {r['layout']}: {r['rows']:,} steps, batch {r['batch']} (median of {args.repeats}) ==")
        print(table(r["results"], ["op", "storage", "ms_per_batch", "Msteps_per_s", "gear_speedup"]))
        print(
            f"gather {r['gather']['gather_GBps']} GB/s vs index_select {r['gather']['index_select_GBps']} GB/s "
            f"({r['gather']['gather_vs_index_select']}x)"
        )
        m = r["memory"]
        print(
            f"memory: raw {m['raw_bytes_per_step']} B/step (TorchRL's 'index' key included), GearStorage "
            f"{m['gear_bytes_per_step']} B/step ({m['gear_overhead_pct']}% overhead), LazyTensorStorage "
            f"{m['LazyTensorStorage_bytes_per_step']} B/step"
        )
    write_json(args.out, {"benchmark": "storage_sampling", "reports": reports})


if __name__ == "__main__":
    main()
