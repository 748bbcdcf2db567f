"""Many writer processes, one sampling learner: a shared GearStorage against TorchRL's shared buffer.

Writers (spawned processes) append whole episodes as fast as they can for a
fixed time while this process samples batches. Ours: ``GearStorage(shared=True)``
written through ``TrajectoryWriter``. TorchRL's: ``TensorDictReplayBuffer(
LazyMemmapStorage, shared=True)`` written with ``rb.extend``, the buffer a
collector shares with its workers. Reported per writer count: aggregate inserted
steps/s (median of rounds) and the learner's batches/s under that load against
its idle rate, both systems in the same run, rounds interleaved.

    .venv/bin/python benchmarks/shared_insert.py [--writers 1 2 4] [--seconds 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time

import torch
from harness import table, write_json
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

from gear_torchrl import GearStorage, TrajectoryWriter

CTX = mp.get_context("spawn")


def episode(length: int, obs_dim: int) -> TensorDict:
    done = torch.zeros(length, 1, dtype=torch.bool)
    done[-1] = True
    return TensorDict(
        {
            "obs": torch.randn(length, obs_dim),
            "action": torch.randint(0, 6, (length,)),
            "next": {"obs": torch.randn(length, obs_dim), "reward": torch.randn(length, 1), "done": done},
        },
        [length],
    )


def write_rounds(system: str, target, rounds: int, seconds: float, ep_len: int, obs_dim: int, barrier, out) -> None:
    torch.set_num_threads(1)
    data = episode(ep_len, obs_dim)
    writer = TrajectoryWriter(target) if system == "gear" else None
    for _ in range(rounds):
        barrier.wait()
        rows, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            if writer is not None:
                writer.extend(data)
                writer.end_episode()
            else:
                target.extend(data)
            rows += ep_len
        out.put(rows / (time.perf_counter() - start))
        barrier.wait()


def sample_for(rb, seconds: float) -> float:
    batches, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        rb.sample()
        batches += 1
    return batches / (time.perf_counter() - start)


def build(system: str, capacity: int, batch: int, ep_len: int, obs_dim: int, scratch: str):
    """(the object writers get, the learner's buffer, cleanup)."""
    if system == "gear":
        storage = GearStorage(capacity, shared=True)
        rb = TensorDictReplayBuffer(storage=storage, batch_size=batch)
        writer = TrajectoryWriter(storage)
        writer.extend(episode(ep_len, obs_dim))
        writer.end_episode()
        return storage, rb, storage.close
    rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(capacity, scratch_dir=scratch), batch_size=batch, shared=True)
    rb.extend(episode(ep_len, obs_dim))
    return rb, rb, lambda: None


def run(system: str, writers: int, args, scratch: str) -> dict:
    target, rb, cleanup = build(system, args.capacity, args.batch, args.ep_len, args.obs_dim, scratch)
    try:
        idle = [sample_for(rb, args.seconds) for _ in range(args.rounds)]
        barrier, out = CTX.Barrier(writers + 1), CTX.Queue()
        procs = [
            CTX.Process(
                target=write_rounds,
                args=(system, target, args.rounds, args.seconds, args.ep_len, args.obs_dim, barrier, out),
            )
            for _ in range(writers)
        ]
        for p in procs:
            p.start()
        inserts, loaded = [], []
        for _ in range(args.rounds):
            barrier.wait(timeout=300)
            loaded.append(sample_for(rb, args.seconds))
            barrier.wait(timeout=300)
            inserts.append(sum(out.get(timeout=60) for _ in procs))
        for p in procs:
            p.join(60)
        return {
            "inserts": statistics.median(inserts),
            "idle": statistics.median(idle),
            "loaded": statistics.median(loaded),
        }
    finally:
        cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--ep-len", type=int, default=200)
    parser.add_argument("--obs-dim", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for writers in args.writers:
            gear = run("gear", writers, args, scratch)
            base = run("torchrl", writers, args, f"{scratch}/{writers}")
            rows.append(
                {
                    "writers": writers,
                    "gear steps/s": f"{gear['inserts']:.3g}",
                    "torchrl steps/s": f"{base['inserts']:.3g}",
                    "insert ratio": f"{gear['inserts'] / base['inserts']:.2f}x",
                    "gear learner loaded/idle": f"{gear['loaded'] / gear['idle']:.2f}",
                    "torchrl learner loaded/idle": f"{base['loaded'] / base['idle']:.2f}",
                    "gear batches/s (loaded)": f"{gear['loaded']:.0f}",
                    "torchrl batches/s (loaded)": f"{base['loaded']:.0f}",
                }
            )
            print(table(rows[-1:], list(rows[-1])), flush=True)
    print()
    print(table(rows, list(rows[0])))
    write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
