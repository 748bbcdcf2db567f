"""One round trip per batch: every owner's reply received at once, the own shard read in-process, batches in flight.

The first tests drive the native send and receive (``_C.send_requests``, ``_C.receive_replies``) over socket
pairs: replies landing in their rows of one batch, and every way one socket can
fail without holding back the others. The last run a world of one rank
(``round_trip_workers``) that serves its shard and samples it.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import socket
import threading
import time

import pytest
import round_trip_workers as w
import torch

from gear_torchrl.distributed import wire
from gear_torchrl.kernels import _C
from gear_torchrl.store.windows import Windows


def _framed(op: int, meta: dict, arrays: list[torch.Tensor]) -> bytes:
    views = [wire.as_bytes(a.contiguous()) for a in arrays]
    return wire.header(op, meta, [v.nbytes for v in views]) + b"".join(bytes(v) for v in views)


@pytest.fixture
def pairs():
    made = [socket.socketpair() for _ in range(4)]
    yield made
    for a, b in made:
        a.close()
        b.close()


def test_replies_of_many_sockets_land_in_their_rows_of_one_batch(pairs):
    batch = [torch.zeros(6, 2), torch.zeros(6, dtype=torch.int64)]
    replies = []
    for i in range(len(pairs[:3])):
        small = torch.arange(i + 1, dtype=torch.int64)
        rows = [torch.full((2, 2), float(i)), torch.full((2,), 10 + i, dtype=torch.int64)]
        replies.append(_framed(wire.Op.OK, {"shard": i}, [small, *rows]))

    def send_late() -> None:  # the first reply comes last, in two pieces
        for peer, data in reversed([(p, r) for (_, p), r in zip(pairs, replies)][1:]):
            peer.sendall(data)
        pairs[0][1].sendall(replies[0][:7])
        time.sleep(0.05)
        pairs[0][1].sendall(replies[0][7:])

    threading.Thread(target=send_late).start()
    got = _C.receive_replies([a.fileno() for a, _ in pairs[:3]], [batch] * 3, [[0, 0], [2, 2], [4, 4]], 5.0)
    for i, (status, op, tally, head, small) in enumerate(got):
        assert (status, op, tally) == (0, wire.Op.OK, [])
        op, meta, lengths = wire.parse_head(head.numpy().tobytes())
        assert (op, meta, lengths) == (wire.Op.OK, {"shard": i}, [8 * (i + 1), 16, 16])
        assert [s.view(torch.int64).tolist() for s in small] == [list(range(i + 1))]
    assert batch[0][:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch[1].tolist() == [10, 10, 11, 11, 12, 12]


def test_each_failing_socket_is_its_own_outcome_and_the_others_still_land(pairs):
    batch = [torch.zeros(4, dtype=torch.int64)]
    good = _framed(wire.Op.OK, {}, [torch.tensor([7, 8], dtype=torch.int64)])
    pairs[0][1].sendall(good)
    pairs[1][1].sendall(good[:5])
    pairs[1][1].close()  # hangs up mid-header
    pairs[2][1].sendall(b"NOPE" + good[4:])  # not our framing
    pairs[3][1].sendall(_framed(wire.Op.OK, {}, [torch.arange(9, dtype=torch.int64)]))  # more rows than room
    got = _C.receive_replies([a.fileno() for a, _ in pairs], [batch] * 4, [[0], [2], [2], [2]], 5.0)
    assert [status for status, *_ in got] == [0, -errno.ECONNRESET, -errno.EPROTO, -errno.EPROTO]
    assert batch[0].tolist() == [7, 8, 0, 0]  # the refused replies wrote nothing


def test_a_rows_reply_gives_its_tally_as_numbers_and_lands_its_picks_with_the_rows(pairs):
    picks, rows = torch.full((4,), -1, dtype=torch.int64), torch.zeros(4, 2)
    tally = torch.tensor([50, 2], dtype=torch.int64)
    pairs[0][1].sendall(_framed(wire.Op.ROWS, {}, [tally, torch.tensor([7, 9]), torch.ones(2, 2)]))
    pairs[1][1].sendall(_framed(wire.Op.ROWS, {}, [torch.tensor([1], dtype=torch.int64), torch.tensor([3])]))
    got = _C.receive_replies([pairs[0][0].fileno(), pairs[1][0].fileno()], [[picks, rows], [picks]], [[1, 1], [0]], 5.0)
    (status, op, counts, _, small), (bad, *_) = got
    assert (status, op, counts, small, bad) == (0, wire.Op.ROWS, [50, 2], [], -errno.EPROTO)  # a tally is 16 bytes
    assert picks.tolist() == [-1, 7, 9, -1] and rows[1:3].eq(1).all() and rows[0].eq(0).all()


def test_replies_trickling_in_pieces_that_split_arrays_land_whole(pairs):
    """Arrays are read in one scatter read when they are there: pieces ending inside an array, inside the
    tally, or between two, and sockets whose replies come at different times, all land byte for byte."""
    n = len(pairs)
    picks, obs, flags = torch.full((4 * n,), -1), torch.zeros(4 * n, 3), torch.zeros(4 * n, dtype=torch.bool)
    frames, expected = [], []
    for i in range(n):
        rows = torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * i
        want = (torch.arange(4) + 10 * i, rows, torch.tensor([True, False, True, i % 2 == 0]))
        frames.append(_framed(wire.Op.ROWS, {}, [torch.tensor([99, 4]), *want]))
        expected.append(want)

    def trickle() -> None:
        for i, size in enumerate((1, 5, 13, 29)):  # each socket its reply in pieces of its own size, in turn
            frame = frames[i]
            for at in range(0, len(frame), size):
                pairs[i][1].sendall(frame[at : at + size])
                time.sleep(0.0005)

    threading.Thread(target=trickle).start()
    got = _C.receive_replies(
        [a.fileno() for a, _ in pairs], [[picks, obs, flags]] * n, [[4 * i] * 3 for i in range(n)], 5.0
    )
    assert [(status, op, tally) for status, op, tally, *_ in got] == [(0, wire.Op.ROWS, [99, 4])] * n
    for i, (want_picks, want_rows, want_flags) in enumerate(expected):
        part = slice(4 * i, 4 * i + 4)
        assert torch.equal(picks[part], want_picks) and torch.equal(obs[part], want_rows)
        assert torch.equal(flags[part], want_flags)


def test_a_windows_reply_lands_its_picks_and_rows_each_from_its_own_row(pairs):
    """Windows land at pick ``f`` in the batch's picks and at row ``f * window_len`` in its columns."""
    starts, begin, end = (torch.full((3,), -1, dtype=torch.int64) for _ in range(3))
    rows = torch.zeros(6, 2)
    mass_bits = torch.tensor([2.5], dtype=torch.float64).view(torch.int64)
    tally = torch.cat([torch.tensor([40, 1]), mass_bits])
    pairs[0][1].sendall(
        _framed(
            wire.Op.WINDOWS, {}, [tally, torch.tensor([11]), torch.tensor([0]), torch.tensor([2]), torch.ones(2, 2)]
        )
    )
    pairs[1][1].sendall(_framed(wire.Op.WINDOWS, {}, [torch.tensor([40, 1]), torch.tensor([5])]))
    got = _C.receive_replies(
        [pairs[0][0].fileno(), pairs[1][0].fileno()], [[starts, begin, end, rows], [starts]], [[2, 2, 2, 4], [0]], 5.0
    )
    (status, op, numbers, _, small), (bad, *_) = got
    assert (status, op, small, bad) == (0, wire.Op.WINDOWS, [], -errno.EPROTO)  # a WINDOWS tally is 24 bytes
    assert numbers[:2] == [40, 1] and torch.tensor(numbers[2:]).view(torch.float64).item() == 2.5
    assert (starts.tolist(), begin.tolist(), end.tolist()) == ([-1, -1, 11], [-1, -1, 0], [-1, -1, 2])
    assert rows[4:].eq(1).all() and rows[:4].eq(0).all()


def _bits(*values: float) -> list[int]:
    return torch.tensor(values, dtype=torch.float64).view(torch.int64).tolist()


def test_a_round_s_shares_land_in_one_batch_and_their_tallies_come_back_as_arrays(pairs):
    """Windows of two rows: share j's picks land from pick firsts[j] on and its rows from row 2 * firsts[j]; an
    owner's refusal comes back as its head, landing nothing."""
    starts, begin, end = (torch.full((4,), -1, dtype=torch.int64) for _ in range(3))
    rows = torch.zeros(8, 3)
    asked, firsts = [1, 2, 0, 1], [0, 1, 3, 3]
    for j, k in enumerate(asked[:3]):
        picks = [torch.arange(k) + 10 * j, torch.zeros(k, dtype=torch.int64), torch.full((k,), 2)]
        tally = torch.tensor([100 + j, k, *_bits(0.5 + j)])
        pairs[j][1].sendall(_framed(wire.Op.WINDOWS, {}, [tally, *picks, torch.full((2 * k, 3), float(j + 1))]))
    pairs[3][1].sendall(_framed(wire.Op.ERROR, {"type": "ValueError", "message": "no"}, []))
    status, counts, live, mass, min_mass, heads = _C.receive_shares(
        [a.fileno() for a, _ in pairs], [starts, begin, end, rows], 3, firsts, asked, 2, wire.Op.WINDOWS, 5.0
    )
    assert (status, counts, live, mass, min_mass) == (
        [0] * 4,
        [1, 2, 0, 0],
        [100, 101, 102, 0],
        [0.5, 1.5, 2.5, 0.0],
        [0.0] * 4,
    )
    assert heads[:3] == [None] * 3
    assert wire.parse_head(heads[3].numpy().tobytes())[1] == {"type": "ValueError", "message": "no"}
    assert (starts.tolist(), end.tolist()) == ([0, 10, 11, -1], [2, 2, 2, -1])
    assert rows[:, 0].tolist() == [1, 1, 2, 2, 2, 2, 0, 0]


def test_a_prioritized_share_gives_its_least_mass_and_lands_its_values(pairs):
    starts, mass, generation, rows = (
        torch.full((3,), -1, dtype=t) for t in (torch.int64, torch.float64, torch.int64, torch.float32)
    )
    tally = torch.tensor([50, 2, *_bits(9.0, 0.25)])
    values = [torch.tensor([4, 5]), torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([7, 8])]
    pairs[0][1].sendall(_framed(wire.Op.PRIORITIZED, {}, [tally, *values, torch.tensor([3.0, 4.0])]))
    status, counts, live, total, least, heads = _C.receive_shares(
        [pairs[0][0].fileno()], [starts, mass, generation, rows], 3, [1], [2], 1, wire.Op.PRIORITIZED, 5.0
    )
    assert (status, counts, live, total, least, heads) == ([0], [2], [50], [9.0], [0.25], [None])
    assert (starts.tolist(), mass.tolist(), generation.tolist(), rows.tolist()) == (
        [-1, 4, 5],
        [-1.0, 1.0, 2.0],
        [-1, 7, 8],
        [-1.0, 3.0, 4.0],
    )


def test_a_share_s_reply_that_breaks_its_ask_fails_alone(pairs):
    """More picks than asked, another op, an array beyond the tally and landing, negative rows: each is that
    socket's protocol error, and the share asked right still lands."""
    starts, rows = torch.full((8,), -1, dtype=torch.int64), torch.zeros(8)
    good = _framed(wire.Op.ROWS, {}, [torch.tensor([9, 2]), torch.tensor([3, 4]), torch.ones(2)])
    pairs[0][1].sendall(_framed(wire.Op.ROWS, {}, [torch.tensor([9, 3]), torch.arange(3), torch.ones(3)]))
    pairs[1][1].sendall(_framed(wire.Op.WINDOWS, {}, [torch.tensor([9, 2, 0]), torch.arange(2), torch.ones(2)]))
    pairs[2][1].sendall(
        _framed(wire.Op.ROWS, {}, [torch.tensor([9, 2]), torch.arange(2), torch.arange(2), torch.ones(2)])
    )
    pairs[3][1].sendall(good)
    status, counts, *_ = _C.receive_shares(
        [a.fileno() for a, _ in pairs], [starts, rows], 1, [0, 2, 4, 6], [2, 2, 2, 2], 1, wire.Op.ROWS, 5.0
    )
    assert status == [-errno.EPROTO] * 3 + [0] and counts[3] == 2
    assert starts[6:].tolist() == [3, 4] and rows[6:].tolist() == [1.0, 1.0]
    negative = _framed(wire.Op.ROWS, {}, [torch.tensor([-1, 0])])
    pairs[0][1].sendall(negative)
    assert _C.receive_shares([pairs[0][0].fileno()], [starts], 1, [0], [0], 1, wire.Op.ROWS, 5.0)[0] == [-errno.EPROTO]


def _client_on(sock: socket.socket, shard: int):
    """A learner's client over one end of a socket pair (no dial, no challenge)."""
    from gear_torchrl.distributed.directory import ShardDescriptor
    from gear_torchrl.distributed.shard_client import ShardClient

    descriptor = ShardDescriptor(shard, shard, "h", "127.0.0.1", 0, "s", 8, [], None)
    sock.settimeout(5.0)
    return ShardClient(descriptor, b"", 5.0, connected=sock)


def test_a_share_flight_answers_each_owner_with_its_count_its_refusal_or_its_failure(pairs):
    """An owner's refusal keeps its type and names the owner; a closed connection is that owner's failure and
    is dropped; the others land, with their tallies in the shares' arrays."""
    from gear_torchrl.distributed.shard_client import ShareFlight, Shares
    from gear_torchrl.errors import ShardUnavailableError
    from gear_torchrl.selection.uniform import UniformSpec

    columns = [torch.zeros(8, 2)]
    shares = Shares(
        UniformSpec(), [2, 2, 2, 2], [1, 2, 3, 4], columns, Windows.of_rows(torch.zeros(8, dtype=torch.int64)), None
    )
    clients = [_client_on(a, j) for j, (a, _) in enumerate(pairs)]
    flight = ShareFlight(clients, shares, [0, 1, 2, 3])
    asks = [shares.ask(j).frame() for j in range(4)]
    assert [_read_exactly(b, len(f)) for (_, b), f in zip(pairs, asks)] == asks
    pairs[0][1].sendall(_framed(wire.Op.ROWS, {}, [torch.tensor([30, 2]), torch.tensor([5, 6]), torch.ones(2, 2)]))
    pairs[1][1].sendall(_framed(wire.Op.ERROR, {"type": "ValueError", "message": "bad rule"}, []))
    pairs[2][1].close()
    pairs[3][1].sendall(_framed(wire.Op.ROWS, {}, [torch.tensor([40, 1]), torch.tensor([7]), torch.full((1, 2), 3.0)]))
    outcomes = flight.land()
    assert outcomes[0] == 2 and outcomes[3] == 1
    assert isinstance(outcomes[1], ValueError) and "bad rule" in str(outcomes[1])
    assert isinstance(outcomes[2], ShardUnavailableError) and clients[2]._sock is None
    assert (shares.rows, shares.mass) == ([30, 0, 0, 40], [30.0, 0.0, 0.0, 40.0])
    assert shares.picks.starts[[0, 1, 6]].tolist() == [5, 6, 7] and columns[0][6:7].eq(3.0).all()
    assert shares.landed(3, 1).starts.tolist() == [7]


def test_flights_sent_together_land_in_order_and_bytes_past_the_last_owed_reply_fail_that_owner(pairs):
    """Two batches' flights in one write per owner: the replies, queued back to back, land each in its own batch;
    an owner that sends more than it owes is dropped for breaking the protocol, the other is not."""
    from gear_torchrl.distributed.shard_client import ShareFlight, Shares
    from gear_torchrl.errors import ShardUnavailableError
    from gear_torchrl.selection.uniform import UniformSpec

    clients = [_client_on(a, j) for j, (a, _) in enumerate(pairs[:2])]
    batches = [
        Shares(UniformSpec(), [1, 1], [b, b], [torch.zeros(2, 2)], Windows.of_rows(torch.zeros(2)), None)
        for b in range(2)
    ]
    flights = [ShareFlight(clients, shares, [0, 1], send=False) for shares in batches]
    ShareFlight.send_together(flights)
    for j, (_, peer) in enumerate(pairs[:2]):
        want = b"".join(shares.ask(j).frame() for shares in batches)
        assert _read_exactly(peer, len(want)) == want
        for b in range(2):
            peer.sendall(
                _framed(
                    wire.Op.ROWS, {}, [torch.tensor([9, 1]), torch.tensor([10 * b + j]), torch.full((1, 2), float(b))]
                )
            )
    pairs[1][1].sendall(b"GEAR and more")  # owed nothing after the second reply
    assert flights[0].land() == [1, 1] and batches[0].picks.starts.tolist() == [0, 1]
    second = flights[1].land()
    assert second[0] == 1 and batches[1].picks.starts.tolist() == [10, 11] and batches[1].columns[0].eq(1.0).all()
    assert isinstance(second[1], ShardUnavailableError) and "bytes past the last reply owed" in str(second[1])
    assert clients[1]._sock is None and clients[0]._sock is not None and not clients[0]._awaiting


def test_a_round_s_shares_go_framed_as_their_asks_would_be(pairs):
    from gear_torchrl.distributed.shard_client import Shares
    from gear_torchrl.selection.uniform import UniformSpec

    columns = [torch.zeros(6, 2), torch.zeros(6)]
    shares = Shares(UniformSpec(), [1, 0, 3, 2], [7, None, 2**62, 0], columns, Windows.of_rows(torch.zeros(6)), None)
    asks = [shares.ask(j) for j in range(4)]
    head = asks[0].frame()[:-24]
    statuses = _C.send_shares([a.fileno() for a, _ in pairs], head, shares.counts, [7, -1, 2**62, 0], 2, 5.0)
    assert statuses == [0] * 4
    assert [_read_exactly(b, len(ask.frame())) for (_, b), ask in zip(pairs, asks)] == [a.frame() for a in asks]


def test_a_reply_longer_than_its_first_read_lands_whole_and_the_short_ones_in_one_read(pairs):
    """A reply's first read takes what fits a 16 KiB stash; a longer one (here 64 KiB of rows) is read on in
    place: both land byte for byte beside replies that fit."""
    rows_of = [4096, 3, 1, 2048]  # 64 KiB, under 100 bytes, one row, 32 KiB of float32[4] rows
    total = sum(rows_of)
    obs = torch.zeros(total, 4)
    wanted, at = [], 0
    for (_, peer), rows in zip(pairs, rows_of):
        want = torch.arange(at * 4, (at + rows) * 4, dtype=torch.float32).reshape(rows, 4)
        peer.sendall(_framed(wire.Op.OK, {"rows": rows}, [want]))
        wanted.append((at, want))
        at += rows
    got = _C.receive_replies([a.fileno() for a, _ in pairs], [[obs]] * 4, [[first] for first, _ in wanted], 5.0)
    assert [status for status, *_ in got] == [0] * 4
    for first, want in wanted:
        assert torch.equal(obs[first : first + len(want)], want)


def test_bytes_past_a_reply_break_the_protocol_of_that_socket_alone(pairs):
    """A connection carries one reply at a time: more bytes behind one are not ours to read, and fail it."""
    batch = [torch.zeros(4, dtype=torch.int64)]
    reply = _framed(wire.Op.OK, {}, [torch.tensor([1, 2], dtype=torch.int64)])
    pairs[0][1].sendall(reply + reply)
    pairs[1][1].sendall(_framed(wire.Op.OK, {}, [torch.tensor([3, 4], dtype=torch.int64)]))
    got = _C.receive_replies([pairs[0][0].fileno(), pairs[1][0].fileno()], [batch, batch], [[0], [2]], 5.0)
    assert [status for status, *_ in got] == [-errno.EPROTO, 0]
    assert batch[0][2:].tolist() == [3, 4]


def test_replies_read_ahead_wait_in_the_inbox_for_their_turn(pairs):
    """Several replies owed on one socket: the first read takes what is there (the next replies too), the next
    call lands them from the inbox with the peer gone, and one bigger than the inbox is read on in place."""
    inbox = _C.Inbox()
    inbox.reads_ahead = True
    small = [_framed(wire.Op.OK, {}, [torch.tensor([k, k + 1], dtype=torch.int64)]) for k in (1, 3, 5)]
    big_rows = torch.arange(20_000, dtype=torch.int64)  # 160 KB: more than an inbox holds
    pairs[0][1].sendall(b"".join(small) + _framed(wire.Op.OK, {}, [big_rows]))
    pairs[0][1].close()  # whatever lands from here on was read already, or is queued in the socket
    fd, batch = pairs[0][0].fileno(), [torch.zeros(6, dtype=torch.int64)]
    got = _C.receive_replies([fd], [batch], [[0]], 5.0, [inbox])
    assert got[0][0] == 0 and batch[0][:2].tolist() == [1, 2]
    assert inbox.held > 2 * len(small[1])  # the second and third replies, and the big one's start
    for at in (2, 4):
        assert _C.receive_replies([fd], [batch], [[at]], 5.0, [inbox])[0][0] == 0
    assert batch[0].tolist() == [1, 2, 3, 4, 5, 6]
    inbox.reads_ahead = False
    out = [torch.zeros(20_000, dtype=torch.int64)]
    assert _C.receive_replies([fd], [out], [[0]], 5.0, [inbox])[0][0] == 0
    assert torch.equal(out[0], big_rows) and inbox.held == 0


def test_replies_are_matched_to_their_tickets_in_the_call_that_receives_them(pairs):
    """With a ticket, only a connection owing it next is read (the other's bytes stay for their own turn); a reply
    taken is struck off its inbox, and bytes after the last reply owed fail that connection alone."""
    boxes = [_C.Inbox(), _C.Inbox()]
    boxes[0].owe([7, 8])
    boxes[1].owe([6, 7])  # its reply to 6 comes first
    first = _framed(wire.Op.OK, {}, [torch.tensor([1, 2], dtype=torch.int64)])
    second = _framed(wire.Op.OK, {}, [torch.tensor([3, 4], dtype=torch.int64)])
    pairs[0][1].sendall(first + second + b"GEAR and more")
    pairs[1][1].sendall(second)
    fds, batch = [pairs[0][0].fileno(), pairs[1][0].fileno()], [torch.zeros(4, dtype=torch.int64)]
    got = _C.receive_replies(fds, [batch, batch], [[0], [2]], 5.0, boxes, 7)
    assert [status for status, *_ in got] == [0, _C.NOT_OWED]
    assert batch[0].tolist() == [1, 2, 0, 0] and boxes[0].owed == [8] and boxes[1].owed == [6, 7]
    got = _C.receive_replies(fds, [batch, batch], [[2], [2]], 5.0, boxes, 6)
    assert [status for status, *_ in got] == [_C.NOT_OWED, 0] and boxes[1].owed == [7]
    assert batch[0].tolist() == [1, 2, 3, 4] and boxes[0].first_owed == 8 and boxes[1].first_owed == 7
    batch[0].zero_()
    got = _C.receive_replies(fds[:1], [batch], [[0]], 5.0, boxes[:1], 8)
    assert got[0][0] == _C.BYTES_PAST and batch[0].tolist() == [3, 4, 0, 0]  # it landed; what follows is not ours
    assert boxes[0].owed == [] and boxes[0].first_owed == -1 and boxes[0].held > 0


def test_a_share_lands_from_bytes_an_earlier_share_s_read_took(pairs):
    """Two batches' shares of one owner, sent back to back: the first receive takes both, the second lands its
    rows and tally from the inbox alone."""
    inbox = _C.Inbox()
    inbox.reads_ahead = True
    for batch_no in range(2):
        tally, picks = torch.tensor([50 + batch_no, 2]), torch.tensor([batch_no, batch_no + 10])
        pairs[0][1].sendall(_framed(wire.Op.ROWS, {}, [tally, picks, torch.full((2, 3), float(batch_no))]))
    starts, rows = torch.full((2,), -1, dtype=torch.int64), torch.zeros(2, 3)
    fd = pairs[0][0].fileno()
    first = _C.receive_shares([fd], [starts, rows], 1, [0], [2], 1, wire.Op.ROWS, 5.0, [inbox])
    assert first[:3] == ([0], [2], [50]) and starts.tolist() == [0, 10] and inbox.held > 0
    pairs[0][1].close()
    inbox.reads_ahead = False
    second = _C.receive_shares([fd], [starts, rows], 1, [0], [2], 1, wire.Op.ROWS, 5.0, [inbox])
    assert second[:3] == ([0], [2], [51]) and starts.tolist() == [1, 11] and rows.eq(1.0).all()
    assert inbox.held == 0


def test_many_batches_asked_in_one_write_per_owner(pairs):
    """send_shares with two batches' counts and seeds: each owner's two asks, framed as Asks would be, in order."""
    from gear_torchrl.distributed.shard_client import Shares
    from gear_torchrl.selection.uniform import UniformSpec

    columns = [torch.zeros(20, 2), torch.zeros(20)]
    asks: list[tuple[list[int], list[int | None]]] = [([3, 4], [7, None]), ([5, 6], [8, 9])]  # (counts, seeds)
    batches = [
        Shares(UniformSpec(), counts, seeds, columns, Windows.of_rows(torch.zeros(20)), None) for counts, seeds in asks
    ]
    head = batches[0].ask(0).frame()[:-24]
    fds = [a.fileno() for a, _ in pairs[:2]]
    assert _C.send_shares(fds, head, [3, 4, 5, 6], [7, -1, 8, 9], 2, 5.0) == [0, 0]
    for j, (_, peer) in enumerate(pairs[:2]):
        want = b"".join(shares.ask(j).frame() for shares in batches)
        assert _read_exactly(peer, len(want)) == want
    with pytest.raises(RuntimeError, match="one count and one seed per socket for each batch"):
        _C.send_shares(fds, head, [1, 2, 3], [1, 2, 3], 2, 5.0)


def test_a_silent_socket_times_out_alone(pairs):
    batch = [torch.zeros(2, dtype=torch.int64)]
    pairs[0][1].sendall(_framed(wire.Op.OK, {}, [torch.tensor([1, 2], dtype=torch.int64)]))
    start = time.monotonic()
    got = _C.receive_replies([pairs[0][0].fileno(), pairs[1][0].fileno()], [batch, []], [[0], []], 0.3)
    assert [status for status, *_ in got] == [0, -errno.ETIMEDOUT]
    assert 0.25 < time.monotonic() - start < 3.0
    assert batch[0].tolist() == [1, 2]


def test_a_refusal_carries_no_rows_and_writes_none(pairs):
    batch = [torch.full((3,), -1, dtype=torch.int64)]
    pairs[0][1].sendall(_framed(wire.Op.ERROR, {"type": "ValueError", "message": "no"}, []))
    ((status, op, tally, head, small),) = _C.receive_replies([pairs[0][0].fileno()], [batch], [[0]], 5.0)
    assert (status, op, tally, small) == (0, wire.Op.ERROR, [], [])
    assert wire.parse_head(head.numpy().tobytes())[:2] == (wire.Op.ERROR, {"type": "ValueError", "message": "no"})
    assert batch[0].tolist() == [-1, -1, -1]


def test_bad_arguments_are_refused_before_any_wait(pairs):
    with pytest.raises(RuntimeError, match="one list of landing tensors and one of first rows per socket"):
        _C.receive_replies([pairs[0][0].fileno()], [], [[0]], 1.0)
    with pytest.raises(RuntimeError, match="one first row per landing tensor"):
        _C.receive_replies([pairs[0][0].fileno()], [[torch.zeros(2)]], [[0, 0]], 1.0)
    with pytest.raises(RuntimeError, match="negative first row"):
        _C.receive_replies([pairs[0][0].fileno()], [[torch.zeros(2)]], [[-1]], 1.0)


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    out = tmp_path_factory.mktemp("round_trips") / "results.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = mp.get_context("spawn").Process(target=w.run, args=(port, str(out)))
    process.start()
    process.join(180)
    if process.is_alive():
        process.kill()
        pytest.fail("the world of one did not finish within 180 s")
    assert out.exists(), f"the world of one exited with {process.exitcode} before writing its results"
    return torch.load(out, weights_only=False)  # our own worker's results


@pytest.mark.processes
def test_a_round_s_requests_go_whole_to_every_socket_and_a_closed_one_fails_alone(pairs):
    big = _framed(wire.Op.UPDATE, {"selection": {}}, [torch.arange(600_000)])  # more than a socket buffer holds
    small = wire.encode(wire.EncodedMessage(wire.Op.SAMPLE_ROWS, b"", [b"x" * 24]))
    for a, _ in pairs:
        a.settimeout(5.0)  # as a learner's are: the descriptor is non-blocking, so a full socket must wait
    pairs[2][1].close()
    got = bytearray()
    reader = threading.Thread(target=lambda: got.extend(_read_exactly(pairs[0][1], len(big))))
    reader.start()
    statuses = _C.send_requests([a.fileno() for a, _ in pairs], [big, small, small, small], 5.0)
    reader.join(10)
    assert statuses == [0, 0, -errno.EPIPE, 0]
    assert bytes(got) == big
    assert [_read_exactly(pairs[i][1], len(small)) for i in (1, 3)] == [small, small]


def test_a_request_to_a_socket_nobody_reads_times_out():
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(0.2)
        frame = _framed(wire.Op.UPDATE, {}, [torch.zeros(8 << 20, dtype=torch.uint8)])
        started = time.monotonic()
        assert _C.send_requests([a.fileno()], [frame], 0.2) == [-errno.ETIMEDOUT]
        assert time.monotonic() - started < 5


def test_an_encoded_message_is_its_header_then_its_arrays():
    arrays = [torch.arange(5), torch.ones(3, 2)]
    assert wire.encode(wire.Message(wire.Op.UPDATE, {"a": 1}, arrays)) == _framed(wire.Op.UPDATE, {"a": 1}, arrays)
    assert wire.encode(wire.EncodedMessage(wire.Op.SELECT, b'{"b":2}')) == wire.header(wire.Op.SELECT, {"b": 2}, [])


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(min(1 << 20, n - len(chunks)))
        assert chunk, "the peer closed early"
        chunks.extend(chunk)
    return bytes(chunks)


def test_the_shard_a_learner_serves_itself_is_read_in_process(world_of_one):
    assert world_of_one["own transport"] == ("local", "InProcessTransport")
    assert world_of_one["own rows match"]
    assert world_of_one["own python picks of uniform rows"] == 0, "uniform rows take the owner's native answer"
    assert world_of_one["own draws match tcp's"], "a seed draws the same rows in-process as over tcp"
    assert world_of_one["first batch rows match"]


@pytest.mark.processes
def test_in_process_priority_updates_reach_every_learner_of_the_shard(world_of_one):
    assert world_of_one["own prioritized share of row 7"] > 0.9
    assert world_of_one["copy transport"] == "local"  # same host, through the owner's server
    assert world_of_one["copy prioritized share of row 7"] > 0.9


@pytest.mark.processes
def test_batches_in_flight_keep_seeded_draws_and_correct_rows(world_of_one):
    without, with_ = world_of_one["draws without prefetch"], world_of_one["draws with prefetch"]
    assert [t.tolist() for t in without] == [t.tolist() for t in with_]
    longer, four_ahead = world_of_one["draws without, as long"], world_of_one["draws with 4 ahead"]
    assert [t.tolist() for t in longer] == [t.tolist() for t in four_ahead]
    for ahead in (1, 4):
        assert world_of_one[f"read between prefetches matches ({ahead})"]
        assert world_of_one[f"prefetched rows match ({ahead})"]
    assert "forked workers' error" not in world_of_one, world_of_one.get("forked workers' error")
    assert world_of_one["forked workers' rows match"]
    assert world_of_one["forked workers' batches are their own"], "a worker took its parent's batches asked ahead"
    assert world_of_one["parent's rows match after the fork"]
