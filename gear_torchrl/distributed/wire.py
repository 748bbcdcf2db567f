"""Framing for the shard server: small JSON metadata, raw tensor bytes, nothing pickled.

A message is a fixed header, a JSON object (the request's or reply's scalars)
and a list of byte arrays that go straight between tensors and the socket.
Sizes are checked against limits before anything is allocated, so a peer
cannot make the other side allocate or read out of bounds.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import json
import os
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from gear_torchrl.kernels import _C

if TYPE_CHECKING:
    from typing_extensions import Buffer

# The ops, the magic and the limits are defined once, in the extension that frames and reads messages too
# (csrc/net/framing.h, as ``_C.wire``); what each op asks or answers is said here.
_WIRE = _C.wire
MAGIC: bytes = _WIRE.MAGIC
VERSION = 1
_HEADER = struct.Struct("<4sHHIQ")  # magic, op, number of arrays, JSON bytes, array bytes
_LENGTH = struct.Struct("<Q")
_HELLO = struct.Struct("<4sH16s")  # magic, version, nonce
_DIGEST_BYTES = 32
assert _HEADER.size == _WIRE.HEADER_BYTES

MAX_META_BYTES: int = _WIRE.MAX_META_BYTES
MAX_ARRAYS: int = _WIRE.MAX_ARRAYS
MAX_ARRAY_BYTES: int = _WIRE.MAX_ARRAY_BYTES  # 16 GiB in one message
MAX_READ_POSITIONS: int = _WIRE.MAX_READ_POSITIONS  # rows (window positions) in one READ or SAMPLE_* reply


class Op:
    """Request and reply codes (their numbers: csrc/net/framing.h)."""

    OK: int = _WIRE.OK
    ERROR: int = _WIRE.ERROR
    SELECT: int = _WIRE.SELECT  # pick rows with a named selector, holding them readable until RELEASE/READ
    READ: int = _WIRE.READ  # gather windows of rows and send their bytes
    RELEASE: int = _WIRE.RELEASE  # end the read section SELECT opened (after a one-sided read)
    UPDATE: int = _WIRE.UPDATE  # set priorities of rows
    DESCRIBE: int = _WIRE.DESCRIBE  # the shard's table spec and layout
    # picks a learner could not use (a batch left unfilled): consumed rows return to their queue
    GIVE_BACK: int = _WIRE.GIVE_BACK
    DUMP: int = _WIRE.DUMP  # save the shard and its shared selection state under a directory
    LOAD: int = _WIRE.LOAD  # restore them from one, into the empty shard
    # uniform rows, read back at once: a SELECT the owner answers in the extension
    SAMPLE_ROWS: int = _WIRE.SAMPLE_ROWS
    # SAMPLE_ROWS's reply: no JSON; the tally (live rows, picks), the picks, then each column's rows
    ROWS: int = _WIRE.ROWS
    # uniform windows read back at once (JSON: the rule): a SELECT the extension may answer
    SAMPLE_WINDOWS: int = _WIRE.SAMPLE_WINDOWS
    # SAMPLE_WINDOWS's reply: no JSON; the tally (live rows, picks, the mass's float64 bits), the windows' starts,
    # valid_begin and valid_end, then each column's rows
    WINDOWS: int = _WIRE.WINDOWS
    # prioritized rows or windows read back at once (JSON: the rule)
    SAMPLE_PRIORITIZED: int = _WIRE.SAMPLE_PRIORITIZED
    # its reply: no JSON; the tally (live rows, picks, the float64 bits of the mass and of the least positive
    # mass), the picks (rows: their ring rows; windows: starts, valid_begin, valid_end), their masses (float64)
    # and generations (int64), then each column's rows
    PRIORITIZED: int = _WIRE.PRIORITIZED
    # an UPDATE the learner does not wait for: no reply (it checked the rows; a refusal is logged)
    POST_UPDATE: int = _WIRE.POST_UPDATE
    # a writer's episode (JSON: its table, its columns' positions and its rows; one array per column), committed
    # whole by the owner (through its rate limiter) or refused whole; the reply (OK: the rows the shard holds and
    # its inserts) may follow HELD messages
    INSERT: int = _WIRE.INSERT
    # sent by the owner while its rate limiter holds an INSERT back, so the writer's wait for the reply stays
    # within its timeout (a writer counts an owner silent for longer as gone)
    HELD: int = _WIRE.HELD


class ProtocolError(ConnectionError):
    """The peer sent something that is not this protocol."""


@dataclass
class Message:
    op: int
    meta: dict[str, Any] = field(default_factory=dict)
    arrays: list[torch.Tensor] = field(default_factory=list)


@dataclass
class EncodedMessage:
    """A message to send whose metadata its sender encoded already (JSON bytes), with arrays as tensors or bytes."""

    op: int
    meta: bytes
    arrays: list[torch.Tensor | bytes] = field(default_factory=list)


def as_tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor, without a copy (it must be contiguous and on the CPU)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("only contiguous CPU tensors go on the wire")
    return t.reshape(-1).view(torch.uint8)


def as_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes without a copy (it must be contiguous and on the CPU)."""
    if t.is_contiguous() and t.device.type == "cpu":
        try:
            # A numpy array is a buffer; its stubs say so from Python 3.12 on only.
            return memoryview(cast("Buffer", t.numpy())).cast("B")  # one call where numpy knows the dtype
        except TypeError:
            pass  # bfloat16 and the like
    return memoryview(cast("Buffer", as_tensor_bytes(t).numpy()))


def send(sock: socket.socket, message: Message | EncodedMessage) -> None:
    if all(isinstance(a, bytes) for a in message.arrays):  # a small request: one buffer, one call
        sock.sendall(encode(message))
        return
    views = _views(message)
    send_buffers(sock, [header(message.op, message.meta, [v.nbytes for v in views]), *views])


def encode(message: Message | EncodedMessage) -> bytes:
    """A whole message as one buffer (its arrays copied in): what a round's native send takes."""
    views = _views(message)
    return header(message.op, message.meta, [v.nbytes for v in views]) + b"".join(views)


def _views(message: Message | EncodedMessage) -> list[memoryview]:
    """A message's arrays as byte views, without a copy."""
    return [memoryview(a) if isinstance(a, bytes) else as_bytes(a) for a in message.arrays]


def header(op: int, meta: dict[str, Any] | bytes, sizes: Sequence[int]) -> bytes:
    """A message's bytes before its arrays: the fixed header, the JSON metadata (a dict, or its JSON
    already encoded) and the arrays' lengths."""
    blob = meta if isinstance(meta, bytes) else json.dumps(meta, separators=(",", ":")).encode()
    return _HEADER.pack(MAGIC, op, len(sizes), len(blob), sum(sizes)) + blob + _lengths(len(sizes)).pack(*sizes)


@functools.lru_cache(maxsize=MAX_ARRAYS + 1)
def _lengths(count: int) -> struct.Struct:
    """The arrays' lengths of a message of ``count`` arrays, as one struct."""
    return struct.Struct(f"<{count}Q")


_MAX_IOV = 1024


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """``sendall`` of each buffer in order, in as few system calls as the kernel takes (sendmsg)."""
    if len(buffers) == 1 and isinstance(buffers[0], bytes):
        sock.sendall(buffers[0])  # a request of metadata alone
        return
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views[:_MAX_IOV])
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


# Where a message's arrays land: given its metadata and array byte lengths, tensors of exactly those sizes.
Allocator = Callable[[dict[str, Any], list[int]], Sequence[torch.Tensor]]


def receive(sock: socket.socket, into: Sequence[torch.Tensor] | Allocator | None = None) -> Message:
    """Read one message; its arrays land in ``into`` (exact sizes, or an allocator) or in new uint8 tensors."""
    fixed = recv_exact(sock, _HEADER.size)
    op, meta, lengths = parse_head(fixed + recv_exact(sock, _rest_of_head(fixed)))
    total = sum(lengths)
    if op != Op.OK or into is None:
        arrays = [torch.empty(n, dtype=torch.uint8) for n in lengths]
    else:
        arrays = list(into(meta, lengths) if callable(into) else into)
        sizes = [a.numel() * a.element_size() for a in arrays]
        if sizes != lengths:
            drain(sock, total)
            raise ProtocolError(f"expected arrays of {sizes} bytes, the peer sent {lengths}")
    for a in arrays:
        recv_tensor(sock, a)
    return Message(op, meta, arrays)


def _rest_of_head(fixed: bytes) -> int:
    """Bytes of metadata and lengths that follow the fixed header at the start of ``fixed``, checked against the
    limits."""
    magic, _, count, meta_len, total = _HEADER.unpack_from(fixed)
    if magic != MAGIC:
        raise ProtocolError("the peer does not speak the gear_torchrl shard protocol")
    if meta_len > MAX_META_BYTES or count > MAX_ARRAYS or total > MAX_ARRAY_BYTES:
        raise ProtocolError(f"message too large: {meta_len} metadata bytes, {count} arrays, {total} array bytes")
    return meta_len + count * _LENGTH.size


def parse_head(head: bytes) -> tuple[int, dict[str, Any], list[int]]:
    """A message's op, metadata and array lengths, from its bytes before the arrays."""
    if len(head) < _HEADER.size or len(head) != _HEADER.size + _rest_of_head(head):
        raise ProtocolError("a message's head is cut short")
    _, op, count, meta_len, total = _HEADER.unpack_from(head)
    at = _HEADER.size
    meta = json.loads(head[at : at + meta_len]) if meta_len else {}
    lengths = list(_lengths(count).unpack_from(head, at + meta_len))
    if sum(lengths) != total:
        raise ProtocolError("array lengths do not add up to the header's total")
    return op, meta, lengths


_NATIVE_FROM = 1 << 16  # below this many bytes one Python recv costs no more


def recv_tensor(sock: socket.socket, t: torch.Tensor) -> None:
    """A tensor's bytes; large ones in one native loop with the GIL released, under the socket's timeout."""
    nbytes = t.numel() * t.element_size()
    if nbytes < _NATIVE_FROM:
        recv_into(sock, as_bytes(t))
        return
    timeout = sock.gettimeout()
    got = _C.recv_exact(sock.fileno(), as_tensor_bytes(t), -1.0 if timeout is None else timeout)
    if got == nbytes:
        return
    if got >= 0:
        raise ConnectionResetError("the peer closed the connection")
    if got == -errno.ETIMEDOUT:
        raise TimeoutError("timed out")
    raise OSError(-got, os.strerror(-got))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("the peer closed the connection")
        got += k


def drain(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, 1 << 20)))
    while n > 0:
        k = min(n, scratch.nbytes)
        recv_into(sock, scratch[:k])
        n -= k


def socket_error(status: int) -> OSError | ProtocolError:
    """The error a native receive or send stands for (``status`` is -errno)."""
    if status == -errno.ECONNRESET:
        return ConnectionResetError("the peer closed the connection")
    if status == -errno.ETIMEDOUT:
        return TimeoutError("timed out")
    if status == -errno.EPROTO:
        return ProtocolError("a message that is not the protocol's framing, or larger than asked for")
    return OSError(-status, os.strerror(-status))


def error(exc: BaseException) -> Message:
    return Message(Op.ERROR, {"type": type(exc).__name__, "message": str(exc)})


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """Make a send on this blocking socket fail once the peer has taken nothing for ``seconds``.

    ``SO_SNDTIMEO`` bounds native sends too (``writev`` from the ring); receives
    keep waiting, as a blocking socket's do.
    """
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


# -- authentication: HMAC of a server nonce with the job's secret ----------------------------------
def challenge(sock: socket.socket, secret: bytes) -> bool:
    """Server side: True if the peer proved it holds ``secret``."""
    nonce = os.urandom(16)
    sock.sendall(_HELLO.pack(MAGIC, VERSION, nonce))
    answer = recv_exact(sock, _DIGEST_BYTES)
    ok = hmac.compare_digest(answer, _digest(secret, nonce))
    sock.sendall(b"\x01" if ok else b"\x00")
    return ok


def answer_challenge(sock: socket.socket, secret: bytes) -> None:
    """Client side: raises PermissionError if the server rejects ``secret``."""
    magic, version, nonce = _HELLO.unpack(recv_exact(sock, _HELLO.size))
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"the peer is not a gear_torchrl shard server of protocol version {VERSION}")
    sock.sendall(_digest(secret, nonce))
    if recv_exact(sock, 1) != b"\x01":
        raise PermissionError("the shard server rejected our secret: this process is not part of the store's job")


def _digest(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()
