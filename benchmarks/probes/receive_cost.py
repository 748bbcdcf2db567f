"""A learner's CPU to receive a round's replies: ``_C.receive_replies`` on N sockets whose replies are queued.

Each of N socket pairs holds one owner's reply to a share of ``--batch / N`` rows of the sharded benchmarks'
table (obs f32[84], action f32[6], reward f32, done bool): a ROWS reply (tally, picks, four columns), a
WINDOWS reply of 16-step windows (tally, starts and valid ranges, four columns), and the raw floor, one
array of the same bytes. Each call lands every reply in its owner's slice of one batch; each figure is the
median over ``--repeats`` of this thread's CPU time per call, the contenders taking turns. With the replies
queued before the call, what is measured is the receive's own work (its system calls and copies), not a
wait. ``--extension`` loads another build of the extension (a commit's before a change):

    .venv/bin/python benchmarks/probes/receive_cost.py [--owners 1 8] [--batch 256] [--repeats 7] [--extension SO]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import socket
import sys
import time

import _harness_path  # noqa: F401  (benchmarks/ on sys.path: harness, sharded_cost)
import torch
from harness import interleaved_medians, machine, table, write_json

COLUMNS = ((84,), (6,), (), ())  # obs, action, reward, done (bool)
SEQ_LEN = 16


def _load_extension(path: str | None):
    """The extension at ``path`` (another build), or this checkout's."""
    if path is None:
        from gear_torchrl.kernels import _C

        return _C
    spec = importlib.util.spec_from_file_location("gear_torchrl.kernels._C", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _columns(rows: int) -> list[torch.Tensor]:
    return [
        torch.ones(rows, *shape) if i < 3 else torch.ones(rows, dtype=torch.bool) for i, shape in enumerate(COLUMNS)
    ]


def _framed(op: int, arrays: list[torch.Tensor]) -> bytes:
    from gear_torchrl.distributed import wire

    views = [wire.as_bytes(a.contiguous()) for a in arrays]
    return wire.header(op, b"", [v.nbytes for v in views]) + b"".join(bytes(v) for v in views)


class Round:
    """N socket pairs, one reply each queued before every call, landing in one batch."""

    def __init__(self, extension, owners: int, batch: int, kind: str) -> None:
        from gear_torchrl.distributed.wire import Op

        self._C, self.pairs = extension, [socket.socketpair() for _ in range(owners)]
        for a, b in self.pairs:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
            b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
        share = batch // owners
        picks = share // SEQ_LEN if kind == "windows" else share
        starts = torch.arange(picks, dtype=torch.int64)
        if kind == "rows":
            self.frame = _framed(Op.ROWS, [torch.tensor([10**5, picks]), starts, *_columns(share)])
            landing = [torch.empty(batch, dtype=torch.int64), *(torch.empty_like(c) for c in _columns(batch))]
            self.firsts = [[i * share] * len(landing) for i in range(owners)]
        elif kind == "windows":
            mass = torch.tensor([1.0], dtype=torch.float64).view(torch.int64)
            self.frame = _framed(
                Op.WINDOWS, [torch.cat([torch.tensor([10**5, picks]), mass]), starts, starts, starts, *_columns(share)]
            )
            landing = [
                *(torch.empty(batch // SEQ_LEN, dtype=torch.int64) for _ in range(3)),
                *(torch.empty_like(c) for c in _columns(batch)),
            ]
            self.firsts = [[i * picks] * 3 + [i * share] * 4 for i in range(owners)]
        else:  # the floor: the same bytes as one array
            payload = torch.ones(sum(c.numel() * c.element_size() for c in _columns(share)), dtype=torch.uint8)
            self.frame = _framed(Op.OK, [payload])
            landing = [torch.empty(payload.numel() * owners, dtype=torch.uint8)]
            self.firsts = [[i * payload.numel()] for i in range(owners)]
        self.landing = [landing] * owners
        self.fds = [a.fileno() for a, _ in self.pairs]

    def __call__(self) -> float:
        """One call's thread CPU time (the replies are queued first, outside the clock)."""
        for _, b in self.pairs:
            b.sendall(self.frame)
        start = time.thread_time()
        replies = self._C.receive_replies(self.fds, self.landing, self.firsts, 5.0)
        spent = time.thread_time() - start
        assert all(r[0] == 0 for r in replies), [r[0] for r in replies]
        return spent

    def close(self) -> None:
        for a, b in self.pairs:
            a.close()
            b.close()


def _medians(rounds: dict[str, Round], repeats: int) -> dict[str, float]:
    """Each kind's median CPU per receive, the kinds taking turns: the clock interleaved_medians reads is the
    receives' own CPU time, summed (the sends that queue the replies are left out)."""
    spent = dict.fromkeys(rounds, 0.0)

    def timed(kind: str) -> None:
        spent[kind] += rounds[kind]()

    return interleaved_medians(
        {k: functools.partial(timed, k) for k in rounds}, repeats=repeats, inner=200, clock=lambda: sum(spent.values())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--owners", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--extension", default=None, help="another build of the extension (.so) to measure")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    extension = _load_extension(args.extension)
    torch.set_num_threads(1)
    rows_out = []
    for owners in args.owners:
        rounds = {kind: Round(extension, owners, args.batch, kind) for kind in ("rows", "windows", "raw")}
        got = _medians(rounds, args.repeats)
        rows_out.append(
            {
                "owners": owners,
                "batch": args.batch,
                **{f"{k} us": f"{got[k] * 1e6:.1f}" for k in rounds},
                "rows / raw": f"{got['rows'] / got['raw']:.2f}",
            }
        )
        for r in rounds.values():
            r.close()
    print(table(rows_out, list(rows_out[0])))
    write_json(
        args.out,
        {"benchmark": "receive_cost", "machine": machine(), "extension": args.extension or "this", "rows": rows_out},
    )


if __name__ == "__main__":
    main()
