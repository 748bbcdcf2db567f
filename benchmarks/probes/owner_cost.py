"""What an owner spends per request of uniform rows: in its extension (SAMPLE_ROWS) and in Python (SELECT).

One owner process serves a shared store of 200k steps (obs f32[84], action
f32[6], reward, done) on loopback; 1 or 4 learner processes, each on its own
connection, ask for uniform rows read back at once, all with the same seed
sequence. Reported per batch size: the owner's CPU time per request (every
thread of its process, from ``/proc/<pid>/task/*/schedstat``), for each path,
medians of interleaved rounds. The ``native`` path is what learners use; the
``python`` path is the same request as a SELECT, answered by the interpreter
(what every request cost before). Fitted over the sizes: the fixed cost per
request and the cost per KiB of rows (gathering them and the kernel's copy).

    .venv/bin/python benchmarks/probes/owner_cost.py [--rows 1 16 256 4096] [--learners 1 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import _harness_path  # noqa: F401  (benchmarks/ on sys.path: harness, sharded_cost)
import torch
from harness import machine, table, write_json
from sharded_cost import ROW_BYTES, STEPS, _thread_cpu_ns

SECONDS_PER_TURN = 0.4


def _owner(ready, stop) -> None:
    """Fill a shared store and serve it until told to stop."""
    import os

    from owner_asks import SECRET
    from sharded_cost import _rows
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearStorage
    from gear_torchrl.distributed.shard_server import ShardServer

    torch.set_num_threads(1)
    storage = GearStorage(STEPS, shared=True)
    rb = TensorDictReplayBuffer(storage=storage)
    for first in range(0, STEPS, 10_000):
        rb.extend(_rows(10_000, first))
    server = ShardServer(storage.handle, SECRET, host="127.0.0.1", timeout=30.0)
    h = storage.handle
    ready.put((os.getpid(), server.address[1], h.store_id, h.capacity, list(h.end_keys), h.traj_key))
    stop.wait()
    server.close()
    storage.close()


def _learner(where, orders, done) -> None:
    """Run each order (path, rows, calls) on one connection; report its wall time."""
    from owner_asks import SelectAsk, client_of

    from gear_torchrl.distributed.shard_client import Ask, Flight
    from gear_torchrl.selection.uniform import UniformSpec
    from gear_torchrl.store.table_spec import TableSpec

    torch.set_num_threads(1)
    client = client_of(*where)
    table_ = TableSpec.from_json(client.describe()["spec"])
    kinds = {"native": Ask, "python": SelectAsk}
    while (order := orders.get()) is not None:
        path, rows, calls = order
        columns = [torch.empty(rows, *c.row_shape, dtype=c.dtype) for c in table_.columns]
        start = time.perf_counter()
        for seed in range(calls):
            picked = Flight([client], [kinds[path](UniformSpec(), rows, seed, columns)]).land()[0]
            if isinstance(picked, BaseException):
                raise picked
        done.put(time.perf_counter() - start)
    client.close()


def _fit(sizes: list[int], costs: list[float]) -> tuple[float, float]:
    """Least squares: cost = fixed + per_kib * KiB of rows."""
    kib = [n * ROW_BYTES / 1024 for n in sizes]
    mx, my = statistics.mean(kib), statistics.mean(costs)
    slope = sum((x - mx) * (y - my) for x, y in zip(kib, costs)) / sum((x - mx) ** 2 for x in kib)
    return my - slope * mx, slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 4096])
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench_out/owner_cost.json")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    owner = ctx.Process(target=_owner, args=(ready, stop))
    owner.start()
    pid, *where = ready.get(timeout=300)
    most = max(args.learners)
    orders = [ctx.Queue() for _ in range(most)]
    done = ctx.Queue()
    learners = [ctx.Process(target=_learner, args=(where, q, done)) for q in orders]
    for p in learners:
        p.start()
    paths = ["native", "python"]
    try:
        calls = {}
        for rows in args.rows:  # warm up every connection, and size each turn to about SECONDS_PER_TURN
            for path in paths:
                for q in orders:
                    q.put((path, rows, 20))
                walls = [done.get(timeout=300) for _ in orders]
            calls[rows] = max(20, int(SECONDS_PER_TURN / (max(walls) / 20)))
        samples: dict[tuple[int, str, int], list[float]] = {}
        for _ in range(args.rounds):
            for k in args.learners:
                for rows in args.rows:
                    for path in paths:
                        n = max(10, calls[rows] // k)
                        cpu0 = _thread_cpu_ns(pid)
                        for q in orders[:k]:
                            q.put((path, rows, n))
                        for _ in range(k):
                            done.get(timeout=600)
                        samples.setdefault((k, path, rows), []).append((_thread_cpu_ns(pid) - cpu0) / 1e3 / (n * k))
    finally:
        for q in orders:
            q.put(None)
        for p in learners:
            p.join(60)
        stop.set()
        owner.join(60)
    out = []
    for k in args.learners:
        for rows in args.rows:
            cost = {path: statistics.median(samples[(k, path, rows)]) for path in paths}
            out.append(
                {
                    "learners": k,
                    "rows": rows,
                    "KiB": f"{rows * ROW_BYTES / 1024:.1f}",
                    "native us": f"{cost['native']:.0f}",
                    "python us": f"{cost['python']:.0f}",
                    "python / native": f"{cost['python'] / cost['native']:.1f}",
                }
            )
        for path in paths:
            fixed, per_kib = _fit(args.rows, [statistics.median(samples[(k, path, r)]) for r in args.rows])
            out.append(
                {"learners": k, "rows": f"fit {path}", "KiB": "-", f"{path} us": f"{fixed:.0f} + {per_kib:.2f}/KiB"}
            )
    columns = ["learners", "rows", "KiB", "native us", "python us", "python / native"]
    print(table(out, columns))
    write_json(args.out, {"machine": machine(), "benchmark": "owner_cost", "rounds": args.rounds, "rows": out})


if __name__ == "__main__":
    main()
