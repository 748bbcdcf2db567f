"""Several learners on one sharded store, against TorchRL's remote buffer on Ray serving as many.

What a job gets when more than one learner draws from the same replay: steps/s summed
over the learners, each learner's CPU per batch, and what the serving side spends per
request. One loopback job per (owners, learners): ranks ``0..owners-1`` own a shard each
(the 200k steps of ``sharded_cost.py`` split over them), the next ``learners`` ranks own
none and draw uniform batches through ``TensorDictReplayBuffer`` over tcp, with and
without ``prefetch``. With ``--ray-site``, the first learner also starts TorchRL 0.14.1's
remote buffers holding the same 200k steps (``service_backend="ray"``, transports ``ray``
and ``distributed``, one actor per transport and batch size, as in ``sharded_cost.py``)
and hands every learner a client of its own (``RayReplayBuffer.clients``), which it
reaches by joining the Ray cluster: how TorchRL has several consumers share one buffer.
``--rule prioritized``: every learner draws prioritized rows and posts a priority update
per batch (as ``sharded_cost.py --rule prioritized``), all on the owners' one table per
rule; Ray is left out (its buffer is compared on uniform rows).

Contenders take turns: in a turn every learner draws the same number of batches from one
contender at once, between two barriers of the learners' group. Per contender and batch
size, medians of the rounds: steps/s (every learner's rows over the slowest learner's wall
time), learner CPU per batch (its process, every thread; mean over learners), and the
serving side's CPU per request (each owner, or the Ray actor: every thread, from
``/proc``; a batch is one request to each owner).

    .venv/bin/python benchmarks/many_learners.py --ray-site .ray-site [--owners 1 2] [--learners 1 2] \
        [--rule rows|prioritized]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time

import torch
from harness import free_port, run_ranks, table, write_json
from sharded_cost import STEPS, _fill, _samplers, _sampling, _thread_cpu_ns, ray_actor_pid, ray_buffers, use_ray_site

SECONDS_PER_TURN = 0.3  # how long the learners draw from one contender in one round


def _ours(rb, storage, prefetch: bool, rule: str):
    step = _sampling(rb, rule)

    def sample(b: int):
        storage.prefetch = prefetch
        return step(b)

    return sample


def _ray_contenders(learner: int, learners: int, store, batches: list[int]) -> tuple[dict, list]:
    """name -> (this learner's sample, the actor's pid per batch size); learner 0 starts the buffers and
    hands each other learner a pickled client through the job's store. Also what must stay alive."""
    import ray

    if learner == 0:
        buffers = ray_buffers(batches)
        pids = {t: {b: ray_actor_pid(rb) for b, rb in by_batch.items()} for t, by_batch in buffers.items()}
        clients = {(t, b): rb.clients(learners) for t, by_batch in buffers.items() for b, rb in by_batch.items()}
        for (t, b), theirs in clients.items():
            for other in range(1, learners):
                store.set(f"ray/{t}/{b}/{other}", pickle.dumps(theirs[other]))
        store.set("ray/pids", pickle.dumps(pids))
        store.set("ray/address", ray.get_runtime_context().gcs_address)
        mine = {key: theirs[0] for key, theirs in clients.items()}
        keep: list = [buffers]
    else:
        ray.init(address=store.get("ray/address").decode(), log_to_driver=False)
        pids = pickle.loads(store.get("ray/pids"))
        mine = {(t, b): pickle.loads(store.get(f"ray/{t}/{b}/{learner}")) for t in pids for b in batches}
        keep = []
    contenders = {}
    for t in pids:
        contenders[f"torchrl-ray-{t}"] = ((lambda b, t=t: mine[(t, b)].sample(b)), {b: [pids[t][b]] for b in batches})
    return contenders, keep


def _learn(
    storage,
    learner: int,
    learners: int,
    group,
    store,
    owner_pids: list[int],
    batches: list[int],
    rounds: int,
    rule: str,
) -> dict | None:
    """Take turns with every contender; learner 0 returns the medians (the others None)."""
    import logging

    import torch.distributed as dist
    from torchrl.data import TensorDictReplayBuffer

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    sampler = _samplers(rule)[1]
    rb = TensorDictReplayBuffer(storage=storage, batch_size=batches[0], **({"sampler": sampler} if sampler else {}))
    served = {b: owner_pids for b in batches}
    contenders = {
        "sharded": (_ours(rb, storage, False, rule), served),
        "prefetch": (_ours(rb, storage, True, rule), served),
    }
    keep: list = []
    if os.environ.get("GEAR_BENCH_RAY_SITE") and rule == "rows":
        ray_contenders, keep = _ray_contenders(learner, learners, store, batches)
        contenders.update(ray_contenders)
    calls = {}
    for b in batches:  # warm up; learner 0 sizes each turn to about SECONDS_PER_TURN of ours
        for sample, _ in contenders.values():
            for _ in range(3):
                sample(b)
        if learner == 0:
            start = time.perf_counter()
            for _ in range(5):
                contenders["sharded"][0](b)
            store.set(f"calls/{b}", str(max(5, int(SECONDS_PER_TURN / ((time.perf_counter() - start) / 5)))))
        calls[b] = int(store.get(f"calls/{b}"))
    mine: list[tuple[str, int, float, float, float]] = []  # (name, batch, wall, cpu, serving cpu)
    for _ in range(rounds):
        for b in batches:
            for name, (sample, pids) in contenders.items():
                dist.barrier(group=group)
                serving0 = [_thread_cpu_ns(p) for p in pids[b]]
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for _ in range(calls[b]):
                    sample(b)
                wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
                dist.barrier(group=group)  # every learner done: the serving side's CPU covers all requests
                serving = statistics.mean((_thread_cpu_ns(p) - s) / 1e9 for p, s in zip(pids[b], serving0))
                mine.append((name, b, wall, cpu, serving))
    everyone: list = [None] * learners
    dist.all_gather_object(everyone, mine, group=group)
    del keep  # the Ray buffers outlive every learner's last batch
    if learner != 0:
        return None
    turns: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for turn in zip(*everyone):  # the same turn on every learner
        name, b = turn[0][0], turn[0][1]
        requests = learners * calls[b]
        turns.setdefault((name, b), []).append(
            (
                learners * calls[b] * b / max(t[2] for t in turn),
                statistics.mean(t[3] for t in turn) / calls[b],
                turn[0][4] / requests,
            )
        )
    return {
        f"{name}/{b}": {
            "steps_per_s": statistics.median(r[0] for r in runs),
            "learner_us": statistics.median(r[1] for r in runs) * 1e6,
            "serving_us": statistics.median(r[2] for r in runs) * 1e6,
        }
        for (name, b), runs in turns.items()
    }


def _rank(rank: int, owners: int, learners: int, port: int, batches: list[int], rounds: int, rule: str, out) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from gear_torchrl import ShardedGearStorage

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=owners + learners,
        timeout=timedelta(seconds=900),
    )
    group = dist.new_group(list(range(owners, owners + learners)))
    storage = ShardedGearStorage(
        STEPS // owners, owns_shard=rank < owners, transport="tcp", serve_on="127.0.0.1", timeout=60
    )
    store = dist.distributed_c10d._get_default_store()
    if storage.local is not None:
        _fill(storage.local, STEPS // owners, rank * STEPS)
        store.set(f"pid/{rank}", str(os.getpid()))
    dist.barrier()
    if rank >= owners:
        pids = [int(store.get(f"pid/{r}")) for r in range(owners)]
        result = _learn(storage, rank - owners, learners, group, store, pids, batches, rounds, rule)
        if result is not None:
            out.put(result)
    dist.barrier()
    storage.close()
    dist.destroy_process_group()


def run_job(owners: int, learners: int, batches: list[int], rounds: int, rule: str = "rows") -> dict:
    return run_ranks(
        _rank,
        owners + learners,
        (owners, learners, free_port(), batches, rounds, rule),
        f"{owners} owners, {learners} learners",
        1800,
    )


def _row(owners: int, learners: int, b: int, result: dict) -> dict:
    ours, ahead = result[f"sharded/{b}"], result[f"prefetch/{b}"]
    row = {
        "owners": owners,
        "learners": learners,
        "batch": b,
        "M steps/s": f"{ours['steps_per_s'] / 1e6:.3f}",
        "prefetch": f"{ahead['steps_per_s'] / 1e6:.3f}",
        "learner us": f"{ours['learner_us']:.0f}",
        "owner us": f"{ours['serving_us']:.0f}",
    }
    for transport in ("ray", "distributed"):
        theirs = result.get(f"torchrl-ray-{transport}/{b}")
        if theirs is not None:
            row.update(
                {
                    f"{transport}: M steps/s": f"{theirs['steps_per_s'] / 1e6:.3f}",
                    f"{transport}: learner us": f"{theirs['learner_us']:.0f}",
                    f"{transport}: actor us": f"{theirs['serving_us']:.0f}",
                    f"ours / {transport}": f"{ours['steps_per_s'] / theirs['steps_per_s']:.1f} "
                    f"({ahead['steps_per_s'] / theirs['steps_per_s']:.1f})",
                }
            )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--owners", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--rule",
        choices=["rows", "prioritized"],
        default="rows",
        help="uniform rows, or prioritized rows with a priority update per batch",
    )
    parser.add_argument(
        "--ray-site",
        default=None,
        help="a folder holding Ray (pip install --target): adds TorchRL's remote buffer on Ray",
    )
    parser.add_argument("--out", default="bench_out/many_learners.json")
    args = parser.parse_args()
    if args.ray_site:
        use_ray_site(args.ray_site)
        # Every learner joins the first one's cluster with the token ``ray.init`` keeps in ~/.ray/auth_token.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    rows = []
    for owners in args.owners:
        for learners in args.learners:
            result = run_job(owners, learners, args.batches, args.rounds, args.rule)
            rows += [_row(owners, learners, b, result) for b in args.batches]
            print(table(rows[-len(args.batches) :], list(rows[-1])), flush=True)
    print(table(rows, list(rows[0])))
    write_json(
        args.out, {"benchmark": "many_learners", "rule": args.rule, "steps": STEPS, "rounds": args.rounds, "rows": rows}
    )


if __name__ == "__main__":
    main()
