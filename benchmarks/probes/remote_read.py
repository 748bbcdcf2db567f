"""Reading a sharded store over tcp on loopback, against the raw loopback socket limit.

Shard owners (spawned ranks under torch.distributed on 127.0.0.1) each hold
1000-step episodes of obs f32[512] (2 KiB a step). Each owner also runs a raw
sender: asked for n bytes, it ``sendall``s n contiguous bytes from a random place
in a buffer as large as its shard's rows, which a learner receives into a
preallocated tensor with the transport's own receive loop (``_C.recv_exact``);
nothing can move the same bytes over the same sockets faster. The learner measures, rounds interleaved, medians:

- ``raw``: the bytes of a batch of 4096 steps, split over the shards, in parallel;
- ``read rows`` / ``read windows``: the tcp transport alone reading 4096 random
  rows / 64 windows of 64 steps (the owner sends them from its ring while the learner
  keeps up; what is left is copied out if it stops reading);
- ``sample rows``: ``rb.sample()`` of 4096 steps (selection on the owners, read, batch);
- ``sample windows``: ``rb.sample()`` of 64 windows of 64 steps (GearSequenceSampler).

    .venv/bin/python benchmarks/probes/remote_read.py [--shards 1 2 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import _harness_path  # noqa: F401  (benchmarks/ on sys.path: harness, sharded_cost)
import torch
import torch.distributed as dist
from harness import free_port, sharded_rank, table, write_json
from tensordict import TensorDict

OBS = 512
EPISODE = 1000
ROWS = 64_000  # per shard: 125 MiB of obs
BATCH = 4096
SEQ_LEN, WINDOWS = 64, 64
_ASK = struct.Struct("<Q")


def _raw_sender(listener: socket.socket, payload: torch.Tensor) -> None:
    view = memoryview(payload.numpy())
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_answer, args=(conn, view), daemon=True).start()


def _answer(conn: socket.socket, view: memoryview) -> None:
    """Send the asked number of bytes from a random place in a buffer as large as the shard's rows."""
    with conn:
        while True:
            ask = conn.recv(_ASK.size, socket.MSG_WAITALL)
            if len(ask) < _ASK.size:
                return
            n = _ASK.unpack(ask)[0]
            at = int(torch.randint(0, view.nbytes - n + 1, ()))
            conn.sendall(view[at : at + n])


def _owner(storage, rank: int) -> None:
    from gear_torchrl import TrajectoryWriter

    writer = TrajectoryWriter(storage.local)
    for _ in range(ROWS // EPISODE):
        done = torch.zeros(EPISODE, 1, dtype=torch.bool)
        done[-1] = True
        writer.extend(TensorDict({"obs": torch.randn(EPISODE, OBS), "next": {"done": done}}, [EPISODE]))
        writer.end_episode()
    listener = socket.create_server(("127.0.0.1", 0))
    payload = torch.randint(0, 256, (ROWS * (OBS * 4 + 1),), dtype=torch.uint8)  # real pages, not the zero page
    threading.Thread(target=_raw_sender, args=(listener, payload), daemon=True).start()
    dist.distributed_c10d._get_default_store().set(f"raw/{rank}", str(listener.getsockname()[1]))


def _learner(storage, shards: int, rounds: int, out) -> None:
    from torchrl.data import TensorDictReplayBuffer

    from gear_torchrl import GearSequenceSampler
    from gear_torchrl.kernels import _C
    from gear_torchrl.store.windows import Windows

    store = dist.distributed_c10d._get_default_store()
    raw = [socket.create_connection(("127.0.0.1", int(store.get(f"raw/{r}")))) for r in range(shards)]
    for s in raw:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    batch_bytes = BATCH * OBS * 4 + BATCH * 1  # obs and the done flag, as the store sends them
    part = batch_bytes // shards
    sink = [torch.empty(part, dtype=torch.uint8) for _ in range(shards)]
    pool = ThreadPoolExecutor(shards)

    def raw_batch() -> None:
        def one(i: int) -> None:
            raw[i].sendall(_ASK.pack(part))
            assert _C.recv_exact(raw[i].fileno(), sink[i], -1.0) == part  # the receive loop the transport uses

        list(pool.map(one, range(shards)))

    rows_rb = TensorDictReplayBuffer(storage=storage, batch_size=BATCH)
    windows_rb = TensorDictReplayBuffer(
        storage=storage, sampler=GearSequenceSampler(SEQ_LEN), batch_size=SEQ_LEN * WINDOWS
    )
    rows_rb.sample()
    spec = storage._shards.links.table(0)
    per_shard = BATCH // shards
    # fresh rows on every call (cycling through 32 batches), as sampling gets: no batch stays in cache
    row_reads = [[Windows.of_rows(torch.randint(0, ROWS, (per_shard,))) for _ in range(shards)] for _ in range(32)]
    window_reads = [
        [_windows(torch.randint(0, ROWS - SEQ_LEN, (per_shard // SEQ_LEN,))) for _ in range(shards)] for _ in range(32)
    ]
    blocks = [storage._shards.links.empty_columns(spec, per_shard) for _ in range(shards)]

    def reader(batches):
        turn = iter(range(1 << 62))

        def read() -> None:
            requests = batches[next(turn) % len(batches)]
            list(pool.map(lambda i: storage._shards.links.client(i).read(requests[i], blocks[i]), range(shards)))

        return read

    contenders = {
        "raw": raw_batch,
        "read rows": reader(row_reads),
        "read windows": reader(window_reads),
        "sample rows": rows_rb.sample,
        "sample windows": windows_rb.sample,
    }
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    for fn in contenders.values():
        fn()
    for _ in range(rounds):
        for name, fn in contenders.items():
            start = time.perf_counter()
            for _ in range(5):
                fn()
            samples[name].append((time.perf_counter() - start) / 5)
    nbytes = SEQ_LEN * WINDOWS * (OBS * 4 + 1)  # every contender moves one batch of 4096 steps
    assert nbytes == batch_bytes
    out.put({name: nbytes / statistics.median(s) / 1e9 for name, s in samples.items()})


def _windows(starts: torch.Tensor):
    from gear_torchrl.store.windows import Windows

    return Windows(starts, SEQ_LEN, torch.zeros_like(starts), torch.full_like(starts, SEQ_LEN))


def _rank(rank: int, world: int, port: int, rounds: int, out) -> None:
    shards = world - 1
    storage = sharded_rank(rank, world, port, ROWS, timeout_s=60)
    if rank < shards:
        _owner(storage, rank)
    dist.barrier()
    if rank == shards:
        _learner(storage, shards, rounds, out)
    dist.barrier()
    storage.close()


def run(shards: int, rounds: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    port = free_port()
    out = ctx.Queue()
    world = shards + 1
    processes = [ctx.Process(target=_rank, args=(r, world, port, rounds, out)) for r in range(world)]
    for p in processes:
        p.start()
    result = out.get(timeout=600)
    for p in processes:
        p.join(60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench_out/remote_read.json")
    args = parser.parse_args()
    rows = []
    for shards in args.shards:
        gbps = run(shards, args.rounds)
        rows.append(
            {
                "shards": shards,
                **{f"{k} GB/s": f"{v:.2f}" for k, v in gbps.items()},
                **{f"{k} / raw": f"{v / gbps['raw']:.2f}" for k, v in gbps.items() if k != "raw"},
            }
        )
        print(table(rows[-1:], list(rows[-1])), flush=True)
    print(table(rows, list(rows[0])))
    write_json(args.out, {"benchmark": "remote_read", "obs_floats": OBS, "batch": BATCH, "rows": rows})


if __name__ == "__main__":
    main()
