"""The Reverb half of reverb_windows.py: N Reverb servers and one learner sampling 64-step windows.

Runs with the Reverb venv (benchmarks/reverb_requirements.txt), inside a
network namespace of its own, since a Reverb server binds all interfaces:

    unshare -n sh -c 'ip link set lo up && exec .reverb-venv/bin/python benchmarks/reverb_side.py --servers 2'

Each server is a process of its own holding ``--rows`` steps: 1000-step
episodes of obs f32[512] (``--obs``), the same arrays reverb_windows.py gives our shards
(numpy generator seeded with (server, episode)). They are written the way
Reverb documents for sequences: ``client.trajectory_writer`` appends one step
at a time and ``create_item`` makes an item of the last 64 steps at every step
from the 64th of an episode on, so the uniform table holds every window that
lies inside an episode, as GearSequenceSampler(64) samples them.

The learner samples through Reverb's training path: one ``reverb.TrajectoryDataset``
per server (C++ sampler workers streaming items over gRPC, up to
``max_in_flight_samples_per_worker`` requested ahead), interleaved over the
servers in parallel and batched by tf.data into batches of ``--batch`` windows.
A round times ``--seconds`` of ``next(iterator)`` (after warm-up batches) and
prints one JSON line: obs bytes delivered per second. With ``--interactive`` a
round runs for each ``sample`` line read on stdin (``quit`` ends), so that
reverb_windows.py can interleave rounds with ours; otherwise ``--rounds`` run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads (in the functions below)

OBS = 512
EPISODE = 1000
TABLE = "windows"


def episode_obs(shard: int, episode: int, obs: int = OBS) -> np.ndarray:
    """Episode ``episode`` of shard/server ``shard``: the same array on both sides of the comparison."""
    return np.random.default_rng([shard, episode]).standard_normal((EPISODE, obs), dtype=np.float32)


def _server(index: int, rows: int, seq_len: int, obs_floats: int, chunk: int | None, ports, done, stop) -> None:
    import reverb
    import tensorflow as tf

    items = (rows // EPISODE) * (EPISODE - seq_len + 1)
    table = reverb.Table(
        TABLE,
        sampler=reverb.selectors.Uniform(),
        remover=reverb.selectors.Fifo(),
        max_size=items,
        rate_limiter=reverb.rate_limiters.MinSize(1),
        signature={"obs": tf.TensorSpec([seq_len, obs_floats], tf.float32)},
    )
    server = reverb.Server(tables=[table], port=None)
    ports.put((index, server.port))
    client = reverb.Client(f"127.0.0.1:{server.port}")
    start = time.perf_counter()
    with client.trajectory_writer(num_keep_alive_refs=seq_len) as writer:
        if chunk is not None:
            writer.configure(("obs",), num_keep_alive_refs=seq_len, max_chunk_length=chunk)
        for e in range(rows // EPISODE):
            obs = episode_obs(index, e, obs_floats)
            for t in range(EPISODE):
                writer.append({"obs": obs[t]})
                if t >= seq_len - 1:
                    writer.create_item(TABLE, 1.0, {"obs": writer.history["obs"][-seq_len:]})
                if t % seq_len == seq_len - 1:
                    writer.flush(block_until_num_items=seq_len)  # as Reverb asks: bound the pending items
            writer.end_episode()
        writer.flush()
    size = client.server_info()[TABLE].current_size
    done.put((index, size, time.perf_counter() - start))
    stop.wait()
    server.stop()


def _dataset(addresses: list[str], seq_len: int, obs_floats: int, batch: int, in_flight: int, workers: int, mix: str):
    import reverb
    import tensorflow as tf

    dtypes = {"obs": tf.float32}
    shapes = {"obs": tf.TensorShape([seq_len, obs_floats])}

    def one(address):
        return reverb.TrajectoryDataset(
            address, TABLE, dtypes, shapes, max_in_flight_samples_per_worker=in_flight, num_workers_per_iterator=workers
        )

    def obs(sample):
        return sample.data["obs"]

    n = len(addresses)
    if n == 1:
        return one(addresses[0]).map(obs).batch(batch, drop_remainder=True).prefetch(2)
    servers = tf.data.Dataset.from_tensor_slices(addresses)
    if mix == "windows":  # every batch mixes windows of all servers, as a sharded batch does
        windows = servers.interleave(
            lambda a: one(a).map(obs), cycle_length=n, block_length=1, num_parallel_calls=n, deterministic=False
        )
        return windows.batch(batch, drop_remainder=True).prefetch(2)
    # "batches": each server's windows batched apart, whole batches interleaved
    return servers.interleave(
        lambda a: one(a).map(obs).batch(batch, drop_remainder=True),
        cycle_length=n,
        block_length=1,
        num_parallel_calls=n,
        deterministic=False,
    ).prefetch(2)


def sample_round(dataset, seconds: float, warmup: int) -> dict:
    """Times ``seconds`` of batches from a fresh iterator (``warmup`` batches untimed first)."""
    it = iter(dataset)
    for _ in range(warmup):
        next(it).numpy()
    nbytes, batches = 0, 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        obs = next(it).numpy()
        nbytes += obs.nbytes
        batches += 1
    del it
    return {"bytes_per_s": nbytes / elapsed, "batches": batches, "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--rows", type=int, default=64_000, help="steps per server")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--obs", type=int, default=OBS, help="floats per step")
    parser.add_argument("--batch", type=int, default=64, help="windows per learner batch")
    parser.add_argument("--in-flight", type=int, default=128, help="max_in_flight_samples_per_worker")
    parser.add_argument("--workers", type=int, default=-1, help="num_workers_per_iterator (-1: Reverb picks)")
    parser.add_argument(
        "--mix",
        choices=["windows", "batches"],
        default="windows",
        help="with several servers: batches of windows from all (default), or whole batches from each",
    )
    parser.add_argument("--chunk", type=int, default=None, help="constant chunk length (default: auto tuned)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interactive", action="store_true", help="a round per 'sample' line on stdin")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    ports, done, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    servers = [
        ctx.Process(
            target=_server, args=(i, args.rows, args.seq_len, args.obs, args.chunk, ports, done, stop), daemon=True
        )
        for i in range(args.servers)
    ]
    for p in servers:
        p.start()
    start = time.perf_counter()
    port = dict(ports.get(timeout=300) for _ in servers)
    filled = sorted(done.get(timeout=900) for _ in servers)
    insert_s = time.perf_counter() - start
    dataset = _dataset(
        [f"127.0.0.1:{port[i]}" for i in range(args.servers)],
        args.seq_len,
        args.obs,
        args.batch,
        args.in_flight,
        args.workers,
        args.mix,
    )
    print(
        json.dumps(
            {"ready": True, "servers": args.servers, "items": [n for _, n, _ in filled], "insert_s": round(insert_s, 1)}
        ),
        flush=True,
    )
    try:
        if args.interactive:
            for line in sys.stdin:
                if line.strip() != "sample":
                    break
                print(json.dumps(sample_round(dataset, args.seconds, args.warmup)), flush=True)
        else:
            rates = []
            for _ in range(args.rounds):
                result = sample_round(dataset, args.seconds, args.warmup)
                rates.append(result["bytes_per_s"])
                print(json.dumps(result), flush=True)
            print(json.dumps({"servers": args.servers, "median_bytes_per_s": statistics.median(rates)}), flush=True)
    finally:
        stop.set()
        for p in servers:
            p.join(30)


if __name__ == "__main__":
    main()
