"""What an owner's thread spends on a reply of rows its Python picked: prioritized rows, and windows asked with a
SELECT.

One process serves a shared store of 200k steps (obs f32[84], action f32[6],
reward, done: 365 bytes a step) on loopback and asks it as a learner would, read
back at once. The server's ``_Session._send_rows`` (framing the reply, gathering
the rows, sending) and ``_Session._select`` (the pick too) are timed by the
owner thread's CPU clock. Medians over ``--requests`` requests of each size. Run
it in two worktrees (``before_after.sh`` makes them) to compare two commits:

    .venv/bin/python benchmarks/probes/owner_reply_cost.py [--requests 300]
    (cd bench_out/before_after/trees/before && \
        PYTHONPATH=$PWD:$PWD/benchmarks python -S benchmarks/probes/owner_reply_cost.py)
"""

from __future__ import annotations

import argparse
import statistics
import time

import _harness_path  # noqa: F401  (benchmarks/ on sys.path: harness, sharded_cost)
import torch
from harness import machine, table, write_json
from sharded_cost import STEPS, _rows


def _timed(cls, name: str, into: list[float]) -> None:
    """``cls.name`` timed by the calling thread's CPU clock, into ``into``."""
    original = getattr(cls, name)

    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            into.append(time.thread_time() - start)

    setattr(cls, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--out", default="bench_out/owner_reply_cost.json")
    args = parser.parse_args()

    from owner_asks import SECRET, SelectAsk, client_of
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearStorage
    from gear_torchrl.distributed import shard_server
    from gear_torchrl.distributed.shard_client import Flight
    from gear_torchrl.selection.priorities import PrioritySpec
    from gear_torchrl.selection.windows import WindowSpec
    from gear_torchrl.store.table_spec import TableSpec

    torch.set_num_threads(1)
    storage = GearStorage(STEPS, shared=True)
    rb = TensorDictReplayBuffer(storage=storage)
    for first in range(0, STEPS, 10_000):
        rb.extend(_rows(10_000, first))
    server = shard_server.ShardServer(storage.handle, SECRET, host="127.0.0.1", timeout=30.0)
    h = storage.handle
    client = client_of(server.address[1], h.store_id, h.capacity, list(h.end_keys), h.traj_key)
    columns = TableSpec.from_json(client.describe()["spec"]).columns
    reply_s: list[float] = []
    select_s: list[float] = []
    _timed(shard_server._Session, "_send_rows", reply_s)
    _timed(shard_server._Session, "_select", select_s)
    rows = []
    for spec, counts in ((PrioritySpec(alpha=0.6), (16, 256, 4096)), (WindowSpec(64), (4, 64, 256))):
        for count in counts:

            def ask(seed: int, spec=spec, count=count) -> None:
                out = [torch.empty(count * spec.rows_per_pick, *c.row_shape, dtype=c.dtype) for c in columns]
                picked = Flight([client], [SelectAsk(spec, count, seed, out)]).land()[0]
                if isinstance(picked, BaseException):
                    raise picked

            for seed in range(20):  # warm up
                ask(seed)
            reply_s.clear()
            select_s.clear()
            for seed in range(args.requests):
                ask(seed)
            rows.append(
                {
                    "rule": spec.kind,
                    "count": count,
                    "rows": count * spec.rows_per_pick,
                    "reply us": f"{statistics.median(reply_s) * 1e6:.0f}",
                    "select us": f"{statistics.median(select_s) * 1e6:.0f}",
                }
            )
    client.close()
    server.close()
    storage.close()
    print(table(rows, list(rows[0])))
    write_json(
        args.out, {"machine": machine(), "benchmark": "owner_reply_cost", "requests": args.requests, "rows": rows}
    )


if __name__ == "__main__":
    main()
