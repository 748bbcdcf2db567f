"""The shard server's wire: framing limits, authentication, and replies of rows framed by the extension."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from gear_torchrl.distributed import global_ids, wire
from gear_torchrl.distributed.wire import Message, Op
from gear_torchrl.kernels import _C, gather


def _received(sender, nbytes: int) -> bytes:
    a, b = socket.socketpair()
    with a, b:
        got = bytearray(nbytes)
        reader = threading.Thread(target=lambda: wire.recv_into(b, memoryview(got)))
        reader.start()
        sender(a)
        reader.join(10)
        return bytes(got)


def test_a_reply_of_rows_is_framed_as_the_wire_frames_it_with_the_gathered_windows():
    g = torch.Generator().manual_seed(0)
    capacity, window_len = 50, 7
    columns = [
        torch.randn(capacity, 300, generator=g),
        torch.randint(0, 255, (capacity, 3), generator=g, dtype=torch.uint8),
        torch.randn(capacity, 2, generator=g).to(torch.float64),
    ]
    starts = torch.tensor([0, 46, 10, 49, 10])  # 46 and 49 wrap the ring end
    valid_begin = torch.tensor([0, 2, 0, 1, 3])
    valid_end = torch.tensor([7, 7, 5, 6, 3])  # the last window is all padding
    rows, _ = gather.gather_windows(columns, starts, window_len, torch.device("cpu"), valid_begin, valid_end)
    arrays = [starts, torch.tensor([1.5, 2.5])]
    meta = b'{"window_len":7}'
    expected = wire.header(Op.OK, meta, [a.nbytes for a in arrays] + [r.nbytes for r in rows]) + b"".join(
        bytes(wire.as_bytes(t)) for t in (*arrays, *rows)
    )
    framed = _C.frame_rows_reply(Op.OK, meta, arrays, columns, starts, valid_begin, valid_end, window_len)
    assert framed == len(expected)
    got = _received(lambda s: _C.send_framed_reply(s.fileno()), len(expected))
    assert got == expected
    with pytest.raises(RuntimeError, match="no reply was framed"):
        _C.send_framed_reply(-1)  # sent once: nothing is left to send


def test_a_reply_of_rows_with_bad_windows_is_refused_and_nothing_is_left_to_send():
    with pytest.raises(IndexError, match="valid ranges"):
        _C.frame_rows_reply(
            Op.OK, b"", [], [torch.zeros(4, 2)], torch.tensor([0]), torch.tensor([2]), torch.tensor([1]), 3
        )
    with pytest.raises(RuntimeError, match="no reply was framed"):
        _C.send_framed_reply(-1)


def test_messages_round_trip_into_given_tensors():
    out = [torch.zeros(3, 2), torch.zeros(5, dtype=torch.int64)]
    arrays = [torch.arange(6.0).reshape(3, 2), torch.arange(5)]
    a, b = socket.socketpair()
    with a, b:
        wire.send(a, Message(Op.OK, {"k": 1}, arrays))
        reply = wire.receive(b, into=out)
    assert reply.meta == {"k": 1} and torch.equal(out[0], arrays[0]) and torch.equal(out[1], arrays[1])


def test_large_arrays_arrive_whole_through_the_native_receive():
    big = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)  # several kernel chunks, above _NATIVE_FROM
    out = torch.zeros_like(big)
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(10.0)
        sender = threading.Thread(target=lambda: wire.send_buffers(a, [wire.as_bytes(big)]))
        sender.start()
        wire.recv_tensor(b, out)
        sender.join(10)
    assert torch.equal(out, big)


def test_native_receive_reports_a_closed_peer_and_a_timeout_as_socket_errors():
    out = torch.zeros(1 << 17, dtype=torch.uint8)
    a, b = socket.socketpair()
    with b:
        a.sendall(b"x" * 100)
        a.close()  # the peer leaves mid-array
        with pytest.raises(ConnectionResetError, match="closed the connection"):
            wire.recv_tensor(b, out)
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(0.2)
        with pytest.raises(TimeoutError):  # the peer stays, silent: bounded by the socket's timeout
            wire.recv_tensor(b, out)


def test_oversized_or_foreign_messages_are_protocol_errors():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire.header(Op.READ, {}, [wire.MAX_ARRAY_BYTES + 1]))
        with pytest.raises(wire.ProtocolError, match="too large"):
            wire.receive(b)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"HTTP" + bytes(wire._HEADER.size - 4))
        with pytest.raises(wire.ProtocolError, match="does not speak"):
            wire.receive(b)


@pytest.mark.parametrize("client_secret", [b"s" * 32, b"wrong"])
def test_only_holders_of_the_secret_pass_the_challenge(client_secret):
    a, b = socket.socketpair()
    verdict: dict[str, bool] = {}
    with a, b:
        server = threading.Thread(target=lambda: verdict.setdefault("ok", wire.challenge(a, b"s" * 32)))
        server.start()
        if client_secret == b"s" * 32:
            wire.answer_challenge(b, client_secret)
        else:
            with pytest.raises(PermissionError, match="rejected our secret"):
                wire.answer_challenge(b, client_secret)
        server.join(10)
    assert verdict["ok"] == (client_secret == b"s" * 32)


def test_global_ids_round_trip_and_refuse_local_rows():
    rows = torch.tensor([0, 5, (1 << global_ids.ROW_BITS) - 1])
    shards, back = global_ids.decode(global_ids.encode(3, rows))
    assert shards.tolist() == [3, 3, 3] and torch.equal(back, rows)
    with pytest.raises(ValueError, match="not a global row id"):
        global_ids.decode(torch.tensor([7]))
