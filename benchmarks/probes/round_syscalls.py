"""System calls a sharded batch costs the learner and each owner: counts, not times, so they read the same on
a noisy machine as on a quiet one.

One loopback world (as ``sharded_cost.py`` runs it: N owners of 200k steps in all, obs f32[84], action f32[6],
reward, done, and a learner that owns none, ``transport="tcp"``) runs under ``strace -f``; the learner draws
``--batches`` uniform batches of ``--batch`` through ``TensorDictReplayBuffer.sample()`` between two marks
after a warm-up, and the trace between the marks is counted: each system call the learner's thread made per
batch, and the owners' serving threads (those that sent) per request (``futex`` left out: the
interpreter's own locks). ``--ahead N`` samples with ``storage.prefetch = N`` (N batches asked for at once;
``--batches`` then a multiple of N). ``strace`` must be installed.

    .venv/bin/python benchmarks/probes/round_syscalls.py [--owners 1 8] [--batch 256] [--batches 50] [--ahead 0]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness_path  # noqa: F401  (benchmarks/ on sys.path: harness, sharded_cost)
import torch
from harness import free_port, run_ranks, table, write_json
from sharded_cost import STEPS, _fill

_START, _END = "ROUND_SYSCALLS_START", "ROUND_SYSCALLS_END"
_CALL = re.compile(r"^(\d+)\s+([a-z_0-9]+)\(")


def _rank(rank: int, world: int, port: int, owners: int, batch: int, batches: int, ahead: int, out) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import ShardedGearStorage

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    learner = rank == world - 1
    storage = ShardedGearStorage(
        STEPS // owners, owns_shard=not learner, transport="tcp", serve_on="127.0.0.1", timeout=60
    )
    if storage.local is not None:
        _fill(storage.local, STEPS // owners, rank * STEPS)
    dist.barrier()
    if learner:
        storage.prefetch = ahead
        rb = TensorDictReplayBuffer(storage=storage, batch_size=batch)
        for _ in range(200):
            rb.sample()
        os.write(2, f"{_START} {os.getpid()}\n".encode())
        for _ in range(batches):
            rb.sample()
        os.write(2, f"{_END}\n".encode())
        out.put(os.getpid())
    dist.barrier()
    storage.close()
    dist.destroy_process_group()


def _world(owners: int, batch: int, batches: int, ahead: int) -> None:
    """The world itself (run under strace by ``_traced``)."""
    run_ranks(_rank, owners + 1, (owners + 1, free_port(), owners, batch, batches, ahead), f"world {owners}", 600)


def _traced(owners: int, batch: int, batches: int, ahead: int) -> dict[str, object]:
    """Run one world under ``strace -f``; the learner's calls per batch and the owners' per request."""
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace"
        python = [sys.executable, "-S"] if sys.flags.no_site else [sys.executable]  # (another tree's run)
        subprocess.run(
            [
                "strace",
                "-f",
                "-qq",
                "-e",
                "trace=!futex",
                "-o",
                str(trace),
                *python,
                __file__,
                "--world",
                str(owners),
                "--batch",
                str(batch),
                "--batches",
                str(batches),
                "--ahead",
                str(ahead),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        lines = trace.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if _START in line)
    end = next(i for i, line in enumerate(lines) if _END in line and i > start)
    learner = lines[start].split()[0]
    window = [m for line in lines[start + 1 : end] if "<..." not in line and (m := _CALL.match(line)) is not None]
    serving = {m.group(1) for m in window if m.group(1) != learner and m.group(2) == "sendto"}  # owners' threads
    learner_calls = collections.Counter(m.group(2) for m in window if m.group(1) == learner)
    owner_calls = collections.Counter(m.group(2) for m in window if m.group(1) in serving)
    learner_calls.pop("write", None)  # the marks
    per_batch = {k: v / batches for k, v in sorted(learner_calls.items())}
    per_request = {k: v / (batches * owners) for k, v in sorted(owner_calls.items())}
    return {
        "owners": owners,
        "batch": batch,
        "ahead": ahead,
        "learner calls per batch": f"{sum(per_batch.values()):.1f}",
        "learner per owner": f"{sum(per_batch.values()) / owners:.2f}",
        "learner": " ".join(f"{k} {v:.2f}" for k, v in per_batch.items()),
        "owner calls per request": f"{sum(per_request.values()):.2f}",
        "owner": " ".join(f"{k} {v:.2f}" for k, v in per_request.items()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--owners", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--ahead", type=int, default=0, help="storage.prefetch: batches asked for at once")
    parser.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)  # one world, under strace
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.world is not None:
        _world(args.world, args.batch, args.batches, args.ahead)
        return
    started = time.monotonic()
    rows = [_traced(n, args.batch, args.batches, args.ahead) for n in args.owners]
    print(table(rows, list(rows[0])))
    print(f"({time.monotonic() - started:.0f} s)")
    write_json(args.out, {"benchmark": "round_syscalls", "rows": rows})


if __name__ == "__main__":
    main()
