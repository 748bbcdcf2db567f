"""What each owner added costs a learner: stores over 1, 2, 4 and 8 owners in one job, measured in the same turns.

``sharded_cost.py`` runs one job per world, one after another; on a shared machine whose slow phases last
seconds, two worlds measured a minute apart differ by as much as the growth asked about (at most +25% of
learner CPU per batch from 1 to 8 owners). Here one job of 8 owner processes and a learner builds a
``ShardedGearStorage`` over each of the first 1, 2, 4 and 8 owners (a process group each), and the learner
samples every store in interleaved turns, so each world's figure comes from the same seconds as the others'.
An owner outside the store being sampled sits idle, as it would in a world of fewer owners. Each store holds
the same 200k steps (obs f32[84], action f32[6], reward, done) split over its owners, and is sampled through
``TensorDictReplayBuffer.sample()``: with the default options (``prefetch="auto"``), plain (``prefetch=0``)
and asking for ``--ahead`` batches at once (``prefetch=N``), next
to the raw floor over the same owners (``sharded_cost.py``'s: one framed reply of the batch's bytes per
owner, no selection) and ``LazyTensorStorage`` in the learner's process. Reported: the learner's process
CPU time per batch (median of ``--rounds`` turns), its growth from one owner, the owners' CPU per request,
steps per second, and the learner's preemptions per batch. ``--rule windows`` draws 64-step windows
(``GearSequenceSampler``; TorchRL's ``SliceSampler`` locally) instead of uniform rows.

    .venv/bin/python benchmarks/probes/owner_growth.py [--owners 1 2 4 8] [--batch 256] [--rounds 5] [--ahead 4 8] \
        [--rule windows]
"""

from __future__ import annotations

import argparse
import os

import _harness_path  # noqa: F401  (benchmarks/ on sys.path: harness, sharded_cost)
import torch
from harness import free_port, run_ranks, table, write_json
from sharded_cost import EPISODE, STEPS, _fill, _measure, _raw_batch, _raw_server, _rows, _samplers


def _rank(
    rank: int, world: int, port: int, owner_counts: list[int], batch: int, rounds: int, ahead: list[int], out
) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from gear_torchrl import ShardedGearStorage

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    learner = rank == world - 1
    stores = {}
    for owners in owner_counts:  # every rank makes every group, in the same order
        group = dist.new_group(ranks=[*range(owners), world - 1])
        if learner or rank < owners:
            stores[owners] = ShardedGearStorage(
                STEPS // owners, owns_shard=not learner, transport="tcp", group=group, serve_on="127.0.0.1", timeout=60
            )
            if not learner:
                _fill(stores[owners].local, STEPS // owners, (rank + 1) * STEPS)
    store = dist.distributed_c10d._get_default_store()
    if not learner:
        store.set(f"pid/{rank}", str(os.getpid()))
        store.set(f"raw/{rank}", str(_raw_server(STEPS // max(owner_counts))))
    dist.barrier()
    if learner:
        pids = [int(store.get(f"pid/{r}")) for r in range(world - 1)]
        raw = [int(store.get(f"raw/{r}")) for r in range(world - 1)]
        _learner(stores, pids, raw, batch, rounds, ahead, out)
    dist.barrier()
    for s in stores.values():
        s.close()
    dist.destroy_process_group()


def _learner(stores: dict, pids: list[int], raw: list[int], batch: int, rounds: int, ahead: list[int], out) -> None:
    import logging

    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    rule = os.environ.get("GEAR_BENCH_RULE", "rows")
    local = TensorDictReplayBuffer(storage=LazyTensorStorage(STEPS), sampler=_samplers(rule)[0], batch_size=batch)
    for first in range(0, STEPS, 10 * EPISODE):
        local.extend(_rows(10 * EPISODE, first))
    contenders, served_by = {"LazyTensorStorage": local.sample}, {"LazyTensorStorage": {batch: []}}
    for owners, storage in stores.items():
        ours = _samplers(rule)[1]  # a sampler of its own for each store
        rb = TensorDictReplayBuffer(storage=storage, batch_size=batch, **({"sampler": ours} if ours else {}))
        for depth in ["auto", 0, *ahead]:

            def sample(b: int, storage=storage, rb=rb, depth=depth):
                storage.prefetch = depth
                return rb.sample(b)

            contenders[_name(owners, _label(depth))] = sample
        contenders[_name(owners, "raw")] = _raw_batch(raw[:owners])
        served_by.update({_name(owners, label): {batch: pids[:owners]} for label in _labels(ahead)})
    _measure(contenders, served_by, contenders[_name(max(stores), "plain")], [batch], rounds, out)


def _label(depth: int | str) -> str:
    return "default" if depth == "auto" else "plain" if depth == 0 else f"ahead {depth}"


def _labels(ahead: list[int]) -> list[str]:
    """Each store's contenders: default options, plain, asking for each depth of batches at once, and the raw
    floor."""
    return [_label("auto"), _label(0), *(_label(n) for n in ahead), "raw"]


def _name(owners: int, label: str) -> str:
    return f"{owners} {label}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--owners", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--ahead", type=int, nargs="+", default=[4, 8], help="batches asked for at once by each 'ahead N' contender"
    )
    parser.add_argument(
        "--rule", choices=["rows", "windows"], default="rows", help="uniform rows, or 64-step windows (4 in 256 steps)"
    )
    parser.add_argument("--out", default="bench_out/owner_growth.json")
    args = parser.parse_args()
    os.environ["GEAR_BENCH_RULE"] = args.rule
    owners = sorted(args.owners)
    world = max(owners) + 1
    result = run_ranks(
        _rank, world, (world, free_port(), owners, args.batch, args.rounds, args.ahead), "owner_growth", 1800
    )
    b = args.batch
    local = result[f"LazyTensorStorage/{b}"]
    rows = []
    for k in owners:
        row = {"owners": k, "batch": b, "local us": f"{local['learner_us']:.0f}"}
        for label in _labels(args.ahead):
            got, first = result[f"{_name(k, label)}/{b}"], result[f"{_name(owners[0], label)}/{b}"]
            row.update(
                {
                    f"{label} learner us": f"{got['learner_us']:.0f}",
                    f"{label} growth": f"{got['learner_us'] / first['learner_us'] - 1:+.0%}",
                    f"{label} owner us": f"{got['owner_us']:.0f}",
                    f"{label} M steps/s": f"{got['steps_per_s'] / 1e6:.3f}",
                    f"{label} preempted per batch": f"{got['preempted']:.2f}",
                    f"{label} waits per batch": f"{got['waited']:.2f}",
                }
            )
        rows.append(row)
    print(table(rows, [c for c in rows[0] if not c.endswith(("owner us", "per batch"))]))  # all in the JSON
    write_json(
        args.out,
        {
            "benchmark": "owner_growth",
            "rule": args.rule,
            "steps": STEPS,
            "rounds": args.rounds,
            "ahead": args.ahead,
            "local M steps/s": local["steps_per_s"] / 1e6,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
