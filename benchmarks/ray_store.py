"""The sharded store on Ray against TorchRL's Ray replay buffer, on one local Ray cluster.

Sampling: a learner (the driver) draws uniform batches from ``ShardedGearStorage.on_ray``
with 1, 2 and 4 owner actors and from TorchRL's ``ReplayBuffer(storage=LazyTensorStorage,
service_backend="ray")`` (one actor; every batch through Ray's object store), each
holding the same steps (obs f32[84], action f32[6], reward, done: ``sharded_cost``'s
rows), taking turns (interleaved rounds, medians): steps per second of wall time and the
learner's CPU per batch (every thread of the driver).

Placement: the same learner draws from N owner actors (``on_ray``) and from N owner
ranks of a torchrun-style job it joins as the last rank (``ShardedGearStorage(owns_shard=
False)``, spawned on 127.0.0.1), both ``transport="auto"``, the same rows per shard, taking
turns: the learner's CPU per batch under each (Ray only places the owners; the reads are
the same).

Inserts: 1, 2 and 4 writer actors append 1000-step episodes, ours with a
``TrajectoryWriter`` over a store forced onto tcp (``transport="tcp"``: every
episode an INSERT to an owner, as from another node), TorchRL's with its client's
``extend``: steps per second of all writers together (medians of rounds), once both
stores are full (a replay buffer's steady state: every insert overwrites old rows).

    .venv/bin/python benchmarks/ray_store.py [--owners 1 2 4] [--writers 1 2 4] [--rounds 5] \
        --out bench_out/ray_store.json
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import ray  # noqa: E402
import torch  # noqa: E402
from harness import free_port, interleaved_medians, sharded_rank, table, write_json  # noqa: E402
from sharded_cost import EPISODE, _rows  # noqa: E402
from sharded_cost import _fill as _fill_shard  # noqa: E402

STEPS = 200_000


def _gear_store(owners: int, transport: str = "auto"):
    from gear_torchrl import ShardedGearStorage

    return ShardedGearStorage.on_ray(
        STEPS // owners + EPISODE, num_shards=owners, num_cpus=0, serve_on="127.0.0.1", transport=transport
    )


def _torchrl_buffer():
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    return ReplayBuffer(
        storage=functools.partial(LazyTensorStorage, STEPS),
        service_backend="ray",
        transport="ray",
        service_backend_options={"remote_config": {"num_cpus": 0}},
    )


def _fill(extend, steps: int) -> None:
    for first in range(0, steps, 10 * EPISODE):
        extend(_rows(10 * EPISODE, first))


def sampling(owners: list[int], batches: list[int], rounds: int) -> list[dict]:
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import TrajectoryWriter

    theirs = _torchrl_buffer()
    _fill(theirs.extend, STEPS)
    results = []
    for n in owners:
        storage = _gear_store(n)
        writer = TrajectoryWriter(storage)
        for first in range(0, STEPS, EPISODE):  # whole episodes, routed over the shards
            writer.extend(_rows(EPISODE, first))
            writer.end_episode()
        ours = TensorDictReplayBuffer(storage=storage)
        for b in batches:
            fns = {"gear": functools.partial(ours.sample, b), "torchrl": functools.partial(theirs.sample, b)}
            wall = interleaved_medians(fns, repeats=rounds, inner=20, warmup=3)
            cpu = interleaved_medians(fns, repeats=rounds, inner=20, warmup=1, clock=time.process_time)
            results.append(
                {
                    "owners": n,
                    "batch": b,
                    "gear_steps_per_s": b / wall["gear"],
                    "torchrl_steps_per_s": b / wall["torchrl"],
                    "ratio": wall["torchrl"] / wall["gear"],
                    "gear_cpu_us": cpu["gear"] * 1e6,
                    "torchrl_cpu_us": cpu["torchrl"] * 1e6,
                }
            )
        storage.close()
    theirs.shutdown()
    return results


def _torchrun_owner(rank: int, world: int, port: int, rows: int) -> None:
    """An owner rank of the torchrun-style job: fill its shard, serve until the learner is done."""
    import torch.distributed as dist

    storage = sharded_rank(rank, world, port, rows, timeout_s=600, transport="auto")
    _fill_shard(storage.local, rows, rank * rows)
    dist.barrier()  # filled
    dist.barrier()  # the learner is done
    storage.close()
    dist.destroy_process_group()


def placement(owners: list[int], batches: list[int], rounds: int) -> list[dict]:
    import multiprocessing as mp

    import torch.distributed as dist
    from torchrl.data import TensorDictReplayBuffer

    results = []
    for n in owners:
        rows, port = STEPS // n, free_port()
        ctx = mp.get_context("spawn")
        ranks = [ctx.Process(target=_torchrun_owner, args=(r, n + 1, port, rows)) for r in range(n)]
        for p in ranks:
            p.start()
        torchrun = sharded_rank(n, n + 1, port, rows, timeout_s=600, transport="auto")
        on_ray = _gear_store(n)
        try:
            for shard in range(n):  # the same rows per shard as the torchrun owners write
                _fill_shard(on_ray.episode_sink().sink_of(shard).storage, rows, shard * rows)
            dist.barrier()
            buffers = {
                "ray": TensorDictReplayBuffer(storage=on_ray),
                "torchrun": TensorDictReplayBuffer(storage=torchrun),
            }
            for b in batches:
                fns = {name: functools.partial(rb.sample, b) for name, rb in buffers.items()}
                cpu = interleaved_medians(fns, repeats=rounds, inner=50, warmup=3, clock=time.process_time)
                results.append(
                    {
                        "owners": n,
                        "batch": b,
                        "ray_cpu_us": cpu["ray"] * 1e6,
                        "torchrun_cpu_us": cpu["torchrun"] * 1e6,
                        "ratio": cpu["ray"] / cpu["torchrun"],
                        "transports": sorted({s.transport_of(i) for s in (on_ray, torchrun) for i in range(n)}),
                    }
                )
        finally:
            dist.barrier()
            on_ray.close()
            torchrun.close()
            dist.destroy_process_group()
            for p in ranks:
                p.join(60)
    return results


@ray.remote(num_cpus=0)
class _GearWriter:
    def __init__(self, storage) -> None:
        from gear_torchrl import TrajectoryWriter

        self.writer = TrajectoryWriter(storage)
        self.episode = _rows(EPISODE, 0)

    def write(self, episodes: int) -> int:
        for _ in range(episodes):
            self.writer.extend(self.episode)
            self.writer.end_episode()
        return episodes * EPISODE


@ray.remote(num_cpus=0)
class _TorchRLWriter:
    def __init__(self, client) -> None:
        self.client = client
        self.episode = _rows(EPISODE, 0)

    def write(self, episodes: int) -> int:
        for _ in range(episodes):
            self.client.extend(self.episode)
        return episodes * EPISODE


def inserts(writers: list[int], rounds: int, episodes: int) -> list[dict]:
    storage = _gear_store(max(writers), transport="tcp")
    theirs = _torchrl_buffer()
    results = []
    full = -(-(STEPS + max(writers) * EPISODE) // EPISODE)  # episodes that fill either store once
    for n in writers:
        contenders = {
            "gear": [_GearWriter.remote(storage) for _ in range(n)],
            "torchrl": [_TorchRLWriter.remote(theirs.client()) for _ in range(n)],
        }
        warm = -(-full // n) if n == writers[0] else 1  # first: fill both rings, so rounds overwrite rows
        for actors in contenders.values():
            ray.get([a.write.remote(warm) for a in actors])
        rates: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(rounds):
            for name, actors in contenders.items():
                began = time.perf_counter()
                steps = sum(ray.get([a.write.remote(episodes) for a in actors]))
                rates[name].append(steps / (time.perf_counter() - began))
        gear, torchrl = (statistics.median(rates[k]) for k in ("gear", "torchrl"))
        results.append(
            {"writers": n, "gear_steps_per_s": gear, "torchrl_steps_per_s": torchrl, "ratio": gear / torchrl}
        )
        for actors in contenders.values():
            for a in actors:
                ray.kill(a)
    storage.close()
    theirs.shutdown()
    return results


def _print(rows: list[dict]) -> None:
    print(table([{k: f"{v:.3g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows], list(rows[0])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--owners", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--episodes", type=int, default=10, help="episodes each writer appends per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    torch.manual_seed(0)
    sampled = sampling(args.owners, args.batches, args.rounds)
    _print(sampled)
    placed = placement(args.owners, args.batches, args.rounds)
    _print(placed)
    inserted = inserts(args.writers, args.rounds, args.episodes)
    _print(inserted)
    write_json(args.out, {"args": vars(args), "sampling": sampled, "placement": placed, "inserts": inserted})
    ray.shutdown()


if __name__ == "__main__":
    main()
