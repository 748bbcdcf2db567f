"""A learner's CPU for one sharded batch, owners left out: ``ShardSet.pick`` against replies queued in advance.

``sharded_cost.py`` measures a learner among real owners; on a machine of 2 cores the owners take the
learner's cores and the loopback's delivery is charged to whoever runs it, so what one added owner costs
the learner itself is hard to read there. Here each of N owners is the far end of a loopback TCP connection
whose reply (a ROWS reply of its share of ``--batch`` rows of the sharded benchmarks' table: obs f32[84],
action f32[6], reward f32, done bool) is queued before the call, and the learner's requests are read away
after it, both outside the clock. What is timed is ``ShardSet.pick`` for uniform rows over N tcp owners: the
split, the requests framed and sent, the replies received into the batch, the answers read and the batch
assembled, with every system call that costs the learner. ``raw`` is the floor for the same sockets: a 24-byte
request sent to each owner and one reply of the same bytes received by ``_C.receive_replies``, nothing
else; ``raw sends`` its sends alone (on loopback a send also pays the receiving end's TCP processing, which
a network card's peer does on its own host). ``ahead N`` is ``ShardSet.pick`` with ``prefetch=N``: the N
batches asked for already, every owner's N replies queued back to back, the last call asking for the next N in
one write per owner. Figures are this thread's CPU time per batch over ``--repeats`` windows of 20 calls, contenders in
turns: the median, and the 10th percentile (on a shared machine whose slow phases last seconds, the
steadier of the two).

    .venv/bin/python benchmarks/probes/learner_round_cost.py [--owners 1 2 4 8] [--batch 256] [--repeats 60] [--ahead 4]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import _harness_path  # noqa: F401  (benchmarks/ on sys.path: harness, sharded_cost)
import torch
from harness import machine, table, write_json
from tensordict import TensorDict

from gear_torchrl.distributed import wire
from gear_torchrl.distributed.directory import ShardDescriptor
from gear_torchrl.distributed.shard_client import ShardClient
from gear_torchrl.distributed.shard_set import Options, ShardSet
from gear_torchrl.distributed.transports.tcp import TcpTransport
from gear_torchrl.distributed.wire import Op
from gear_torchrl.kernels import _C
from gear_torchrl.selection.uniform import UniformSpec
from gear_torchrl.store.table_spec import TableSpec

ROWS_PER_SHARD = 100_000
_SPEC = UniformSpec()


def _steps(n: int) -> TensorDict:
    return TensorDict(
        {
            "obs": torch.ones(n, 84),
            "action": torch.ones(n, 6),
            "reward": torch.ones(n),
            "done": torch.zeros(n, dtype=torch.bool),
        },
        batch_size=[n],
    )


def _framed(op: int, arrays: list[torch.Tensor]) -> bytes:
    views = [wire.as_bytes(a.contiguous()) for a in arrays]
    return wire.header(op, b"", [v.nbytes for v in views]) + b"".join(bytes(v) for v in views)


def _client_on(sock: socket.socket, shard: int) -> ShardClient:
    """A learner's client over one end of a socket pair: what ``ShardClient`` is once dialled."""
    descriptor = ShardDescriptor(shard, shard, "bench", "127.0.0.1", 0, "bench", ROWS_PER_SHARD, [], None)
    sock.settimeout(5.0)
    return ShardClient(descriptor, b"", 5.0, connected=sock)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of one loopback TCP connection (as a learner's to an owner: no delay, large buffers)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
    return a, b


class Owners:
    """N loopback TCP connections: the learner's ends, and the owners' ends where replies are queued and
    requests read."""

    def __init__(self, owners: int) -> None:
        self.pairs = [_tcp_pair() for _ in range(owners)]
        for _, b in self.pairs:
            b.setblocking(False)

    def queue(self, frames: list[bytes]) -> None:
        for (_, b), frame in zip(self.pairs, frames):
            b.sendall(frame)

    def drain(self) -> None:
        """Read away every request the learner sent."""
        for _, b in self.pairs:
            try:
                while b.recv(1 << 20):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        for a, b in self.pairs:
            a.close()
            b.close()


class Learner:
    """``ShardSet.pick`` of uniform rows over N owners whose replies are queued before each call."""

    def __init__(self, owners: int, batch: int, ahead: int = 0) -> None:
        self.owners, self.batch = Owners(owners), batch
        descriptors = [
            ShardDescriptor(s, s, "bench", "127.0.0.1", 0, "bench", ROWS_PER_SHARD, [], None) for s in range(owners)
        ]
        shards = ShardSet(descriptors, b"", Options(transport="tcp", timeout=5.0, prefetch=ahead))
        table = TableSpec.from_data(_steps(1), 1)
        for s, (a, _) in enumerate(self.owners.pairs):
            shards.links._clients[s] = client = _client_on(a, s)
            shards.links.transports[s] = TcpTransport(client)
            shards.links._specs[s] = table
            shards.rows[s] = ROWS_PER_SHARD
        shards.batches._masses[_SPEC] = {s: float(ROWS_PER_SHARD) for s in range(owners)}
        self.shards, self.generator = shards, torch.Generator().manual_seed(0)
        self.columns = [t for t in _steps(batch).values()]

    def _replies(self) -> list[bytes]:
        """Each owner's reply to the share the next call will draw (the generator's next split, foreseen)."""
        ahead = torch.Generator()
        ahead.set_state(self.generator.get_state())
        counts, _ = _C.draw_shares([float(ROWS_PER_SHARD)] * len(self.owners.pairs), self.batch, ahead)
        return [self._reply(k) for k in counts]

    def _reply(self, count: int) -> bytes:
        return _framed(
            Op.ROWS, [torch.tensor([ROWS_PER_SHARD, count]), torch.arange(count), *(c[:count] for c in self.columns)]
        )

    def __call__(self) -> float:
        self.owners.queue(self._replies())
        start = time.thread_time()
        picks = self.shards.pick(_SPEC, self.batch, self.generator)
        spent = time.thread_time() - start
        assert picks is not None and picks.index.numel() == self.batch
        self.owners.drain()
        return spent

    def close(self) -> None:
        self.owners.close()


class LearnerAhead(Learner):
    """The same with ``prefetch=ahead``: each call takes the ``ahead`` batches asked for already (every owner's
    replies to them queued back to back before it), the last of them asking for the next ``ahead`` in one write
    per owner; CPU per batch."""

    def __init__(self, owners: int, batch: int, ahead: int) -> None:
        super().__init__(owners, batch, ahead)
        super().__call__()  # one batch as usual, then ``ahead`` are asked for

    def __call__(self) -> float:
        queued = list(self.shards.batches._queued)  # drawn when they were asked for: their shares are known
        self.owners.queue([b"".join(self._reply(r.counts[j]) for r in queued) for j in range(len(self.owners.pairs))])
        start = time.thread_time()
        for _ in queued:
            picks = self.shards.pick(_SPEC, self.batch, self.generator)
            assert picks is not None and picks.index.numel() == self.batch
        spent = time.thread_time() - start
        self.owners.drain()
        return spent / len(queued)


class Raw:
    """The floor: a 24-byte request sent to each owner and one reply of the same bytes received from each
    (``sends_only``: the sends alone timed, the receive outside the clock)."""

    def __init__(self, owners: int, batch: int, sends_only: bool = False) -> None:
        self.owners, self.sends_only = Owners(owners), sends_only
        row_bytes = 4 * (84 + 6 + 1) + 1
        share = batch // owners
        self.frame = _framed(Op.OK, [torch.ones(share * row_bytes, dtype=torch.uint8)])
        self.request = _framed(Op.SAMPLE_ROWS, [torch.zeros(3, dtype=torch.int64)])
        landing = [torch.empty(share * row_bytes * owners, dtype=torch.uint8)]
        self.landing, self.firsts = [landing] * owners, [[i * share * row_bytes] for i in range(owners)]
        self.fds = [a.fileno() for a, _ in self.owners.pairs]

    def __call__(self) -> float:
        self.owners.queue([self.frame] * len(self.fds))
        start = time.thread_time()
        _C.send_requests(self.fds, [self.request] * len(self.fds), 5.0)
        sent = time.thread_time()
        replies = _C.receive_replies(self.fds, self.landing, self.firsts, 5.0)
        spent = (sent if self.sends_only else time.thread_time()) - start
        assert all(r[0] == 0 for r in replies)
        self.owners.drain()
        return spent

    def close(self) -> None:
        self.owners.close()


def _quantiles(contenders: dict[str, Learner | Raw], repeats: int, inner: int = 20) -> dict[str, tuple[float, float]]:
    """Each contender's median and 10th percentile of CPU per batch over ``repeats`` windows of ``inner``
    calls, contenders in turns. On a shared machine whose slow phases last seconds, the 10th percentile is
    the steadier figure of what a call costs; both are reported."""
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    for c in contenders.values():
        for _ in range(20):
            c()
    for _ in range(repeats):
        for name, c in contenders.items():
            samples[name].append(sum(c() for _ in range(inner)) / inner)
    return {k: (statistics.median(v), statistics.quantiles(v, n=10)[0]) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--owners", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=60, help="windows of 20 calls per contender")
    parser.add_argument("--ahead", type=int, default=4, help="batches the 'ahead' contender asks for at once")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = []
    for owners in args.owners:
        contenders: dict[str, Learner | Raw] = {
            "learner": Learner(owners, args.batch),
            "raw": Raw(owners, args.batch),
            "raw sends": Raw(owners, args.batch, sends_only=True),
            "ahead": LearnerAhead(owners, args.batch, args.ahead),
        }
        got = _quantiles(contenders, args.repeats)
        (learner, learner_p10), (raw, raw_p10), (_, sends_p10) = got["learner"], got["raw"], got["raw sends"]
        ahead, ahead_p10 = got["ahead"]
        out.append(
            {
                "owners": owners,
                "batch": args.batch,
                "learner us": f"{learner * 1e6:.1f}",
                "raw us": f"{raw * 1e6:.1f}",
                "learner us p10": f"{learner_p10 * 1e6:.1f}",
                "raw us p10": f"{raw_p10 * 1e6:.1f}",
                "raw sends us p10": f"{sends_p10 * 1e6:.1f}",
                "above raw us p10": f"{(learner_p10 - raw_p10) * 1e6:.1f}",
                f"ahead {args.ahead} us": f"{ahead * 1e6:.1f}",
                f"ahead {args.ahead} us p10": f"{ahead_p10 * 1e6:.1f}",
            }
        )
        for c in contenders.values():
            c.close()
    print(table(out, list(out[0])))
    write_json(args.out, {"benchmark": "learner_round_cost", "machine": machine(), "rows": out})


if __name__ == "__main__":
    main()
