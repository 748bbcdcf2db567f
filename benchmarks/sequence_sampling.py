"""Sequence windows: GearSequenceSampler against TorchRL's SliceSampler as the store grows.

Windows of 64 steps, 256 per batch, from 1000-step episodes; time per batch
through TensorDictReplayBuffer at each store size, and a plot of both curves.

    .venv/bin/python benchmarks/sequence_sampling.py [--sizes 100000 1000000 10000000] \
        [--out bench_out/sequence.json] [--plot bench_out/sequence.png]
"""

from __future__ import annotations

import argparse
import logging

import torch
from harness import cold_median_seconds, interleaved_medians, median_seconds, table, write_json
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, SliceSampler, TensorDictReplayBuffer

from gear_torchrl import GearSequenceSampler, GearStorage

SEQ_LEN, WINDOWS, EPISODE = 64, 256, 1000


def fill(rb: TensorDictReplayBuffer, steps: int) -> None:
    chunk = 1_000_000
    for first in range(0, steps, chunk):
        n = min(chunk, steps - first)
        done = torch.zeros(n, 1, dtype=torch.bool)
        done[(EPISODE - 1 - first % EPISODE) :: EPISODE] = True
        rb.extend(
            TensorDict({"obs": torch.randn(n, 8), "action": torch.randint(0, 4, (n,)), ("next", "done"): done}, [n])
        )


def measure(size: int, repeats: int) -> dict:
    gear = TensorDictReplayBuffer(
        storage=GearStorage(size), sampler=GearSequenceSampler(SEQ_LEN), batch_size=SEQ_LEN * WINDOWS
    )
    ref = TensorDictReplayBuffer(
        storage=LazyTensorStorage(size),
        batch_size=SEQ_LEN * WINDOWS,
        sampler=SliceSampler(slice_len=SEQ_LEN, end_key=("next", "done")),
    )
    fill(gear, size)
    fill(ref, size)
    # The same turns at every size (10 calls each), so only the store's size changes.
    times = interleaved_medians({"gear": gear.sample, "slice": ref.sample}, repeats=repeats, inner=10, warmup=1)
    # Our own curve, without the contender's footprint in the caches (it scans the whole done column).
    alone = median_seconds(gear.sample, repeats=repeats, inner=20)
    cold = cold_median_seconds(gear.sample, repeats=repeats)
    return {
        "stored_steps": size,
        "gear_ms": round(times["gear"] * 1e3, 3),
        "SliceSampler_ms": round(times["slice"] * 1e3, 3),
        "speedup": round(times["slice"] / times["gear"], 1),
        "gear_alone_ms": round(alone * 1e3, 3),
        "gear_cold_ms": round(cold * 1e3, 3),
    }


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["stored_steps"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(sizes, [r["SliceSampler_ms"] for r in rows], "o-", label="TorchRL SliceSampler + LazyTensorStorage")
    ax.loglog(sizes, [r["gear_ms"] for r in rows], "o-", label="GearSequenceSampler + GearStorage (taking turns)")
    ax.loglog(sizes, [r["gear_cold_ms"] for r in rows], "o--", label="GearSequenceSampler, caches flushed every call")
    ax.set_xlabel("stored steps")
    ax.set_ylabel("ms per batch (256 windows x 64 steps)")
    ax.set_title("Sequence sampling time against store size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    rows = [measure(size, args.repeats) for size in args.sizes]
    print(f"== windows of {SEQ_LEN} steps, {WINDOWS} per batch, {EPISODE}-step episodes (median of {args.repeats}) ==")
    print(table(rows, ["stored_steps", "gear_ms", "SliceSampler_ms", "speedup", "gear_alone_ms", "gear_cold_ms"]))
    flatness = {
        how: round(rows[-1][key] / rows[0][key], 2)
        for how, key in (("interleaved", "gear_ms"), ("alone", "gear_alone_ms"), ("cold", "gear_cold_ms"))
    }
    print(
        f"GearSequenceSampler time at {args.sizes[-1]:,} / at {args.sizes[0]:,}: "
        + ", ".join(f"{v:.2f}x {how}" for how, v in flatness.items())
    )
    write_json(args.out, {"benchmark": "sequence_sampling", "results": rows, "flatness": flatness})
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
