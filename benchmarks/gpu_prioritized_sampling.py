"""Prioritized sample + update on the GPU against TorchRL's PrioritizedSampler (CPU trees).

Batch 4096 over 10M rows: draw a batch, then write new priorities for it,
the PER loop's sampler work. Median of repetitions, synchronized.

    python benchmarks/gpu_prioritized_sampling.py [--rows 10000000] [--out gpu_prioritized.json]
        [--torchrl-site DIR] [--device cuda]

Where TorchRL's sampler does not run, its ratio column reads "not measured" (``null``
in the JSON): no other contender stands in for the peer. ``--device cpu`` runs the
script without a GPU, to check the script, not to quote.

TorchRL's trees are C++ built against one torch: where this machine's torch
differs from the pinned one (the lent GPU image), pass ``--torchrl-site``, a
folder holding a torchrl and tensordict built for this torch (pip install
--target); TorchRL's sampler is then timed there, in a subprocess of this run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

import torch
from harness import cuda_median_seconds, median_seconds, table, write_json

TORCHRL = "TorchRL PrioritizedSampler (CPU trees)"


def loop(sampler, storage, batch, device):
    def step():
        index, _ = sampler.sample(storage, batch)
        sampler.update_priority(index, torch.rand(batch, device=device) + 0.01)

    return step


def seconds_per_iteration(make, rows: int, batch: int, device: str) -> float:
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage

    storage = LazyTensorStorage(rows)
    storage.set(torch.arange(rows), TensorDict({"x": torch.zeros(rows, dtype=torch.uint8)}, [rows]))
    sampler = make()
    sampler.mark_update(torch.arange(rows))
    sampler.update_priority(torch.arange(rows), torch.rand(rows) + 0.01)
    timer = cuda_median_seconds if device == "cuda" else median_seconds
    return timer(loop(sampler, storage, batch, device), inner=10)


def torchrl_seconds(rows: int, batch: int) -> float:
    from torchrl.data import PrioritizedSampler

    return seconds_per_iteration(lambda: PrioritizedSampler(rows, 0.7, 0.5), rows, batch, "cpu")


def torchrl_seconds_elsewhere(site: str, rows: int, batch: int) -> float:
    """TorchRL's sampler timed in a subprocess that imports torchrl from ``site``."""
    path = [site, os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    out = subprocess.run(
        [sys.executable, __file__, "--torchrl-only", "--rows", str(rows), "--batch", str(batch)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def ratio_rows(times: dict[str, float], peer: str) -> list[dict]:
    """One row per contender: milliseconds per iteration and the ratio against ``peer``'s time, or
    ``"not measured"`` (``None`` in the JSON) where ``peer`` did not run: no other contender stands in for it."""
    base = times.get(peer)
    return [
        {"contender": k, "ms_per_iter": round(t * 1e3, 3), "x_vs_torchrl": round(base / t, 2) if base else None}
        for k, t in times.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--out", default=None)
    parser.add_argument("--torchrl-site", default=None, help="time TorchRL's sampler with the torchrl found here")
    parser.add_argument("--device", default="cuda", help="where GearPrioritizedSampler runs (cpu: the script's check)")
    parser.add_argument("--torchrl-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    n, batch = args.rows, args.batch
    if args.torchrl_only:
        print(json.dumps({"seconds": torchrl_seconds(n, batch)}))
        return
    from gear_torchrl import GearPrioritizedSampler

    device = args.device
    gear = lambda: GearPrioritizedSampler(n, 0.7, 0.5, device=device)  # noqa: E731
    contenders = {f"GearPrioritizedSampler(device='{device}')": (gear, device)}
    if device != "cpu":
        contenders["GearPrioritizedSampler (CPU trees)"] = (lambda: GearPrioritizedSampler(n, 0.7, 0.5), "cpu")
    times = {name: seconds_per_iteration(make, n, batch, device) for name, (make, device) in contenders.items()}
    try:
        times[TORCHRL] = (
            torchrl_seconds_elsewhere(args.torchrl_site, n, batch) if args.torchrl_site else torchrl_seconds(n, batch)
        )
    except Exception as err:  # torchrl's C++ trees need the torch they were built for
        print(f"{TORCHRL}: not measured here ({type(err).__name__}: {err}); see --torchrl-site")
    rows = ratio_rows(times, TORCHRL)
    machine = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"== {machine}: sample + update, batch {batch} over {n:,} rows ==")
    shown = [{**r, "x_vs_torchrl": "not measured" if r["x_vs_torchrl"] is None else r["x_vs_torchrl"]} for r in rows]
    print(table(shown, ["contender", "ms_per_iter", "x_vs_torchrl"]))
    write_json(
        args.out,
        {
            "benchmark": "gpu_prioritized_sampling",
            "device": machine,
            "rows": n,
            "batch": batch,
            "torchrl_site": args.torchrl_site,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
