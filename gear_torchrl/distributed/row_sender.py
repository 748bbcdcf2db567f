"""An owner's reply of rows, sent so that a learner that stops reading never holds back the writers.

Large windows go from the ring's columns to the socket (``writev``, no
gather: the kernel copies each byte once) for as long as the socket takes them
without waiting; small ones (rows) are gathered into one buffer first, since an
iovec per row costs the kernel more than the copy once they take several
``writev`` calls. Once it would have to wait for the learner, the rows not sent yet are
copied into a buffer of the connection and the read section ends before the
owner waits: writers wait for one copy at most, never for a learner. Every
send is bounded by the socket's send timeout, so a learner that stalls is dropped.
"""
from __future__ import annotations

import itertools
import select
import socket
import struct
from collections.abc import Callable, Sequence

import torch

from gear_torchrl.distributed import wire
from gear_torchrl.kernels import _C, gather
from gear_torchrl.store.windows import Windows

_SO_MEMINFO = getattr(socket, "SO_MEMINFO", 55)  # Linux: the socket's memory counters (sock_diag's sk_meminfo)
_MEMINFO = struct.Struct("9I")
_SNDBUF, _WMEM_QUEUED = 3, 5  # where the send buffer's size and the memory queued in it sit
_PACKET = 64 << 10  # the memory of one large packet
_WAIT_MS = 2  # how long rows stay held for a learner that is slow to make room
_KEEP_BYTES = 64 << 20  # a connection keeps its copy buffer between replies up to this size
_ALIGN = 64
_GATHER_BELOW = 4096  # windows of fewer bytes (all columns) are gathered first, when there are many
_IOV_MAX = 1024  # iovecs one writev takes (Linux)
_CPU = torch.device("cpu")


class ReplyCutShort(ConnectionError):
    """A reply failed once its first bytes may have left: the connection cannot carry another message."""


class RowSender:
    """Sends one learner's replies that end with rows of a shard's windows."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._fd = conn.fileno()
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def send(self, head: Sequence[bytes | memoryview], columns: list[torch.Tensor], windows: Windows,
             release: Callable[[], None]) -> None:
        """``head`` (header and small arrays), then every column's rows of ``windows``, in column order.

        ``release`` ends the read section that keeps the rows readable; it runs
        as soon as no row is needed from the ring any more (sent or copied).
        """
        try:
            if self._gathers(columns, windows):
                head_sent, column, first = False, 0, 0
            else:
                head_sent, column, first = self._send_from_ring(head, columns, windows)
            if column < len(columns):
                rest = self._copy(columns[column:], windows, first)
                release()  # the rows are out of the ring: writers need not wait for this learner
                wire.send_buffers(self._conn, [*([] if head_sent else head), *rest])
        except Exception as exc:
            raise ReplyCutShort(f"a reply of rows was cut short: {exc}") from exc
        finally:
            release()

    @staticmethod
    def _gathers(columns: list[torch.Tensor], w: Windows) -> bool:
        """Whether to gather every row into one buffer first: many small windows (a batch of rows), where
        an iovec per window per column takes the kernel several writev calls and costs more than the copy."""
        small = w.seq_len * sum(_row_bytes(c) for c in columns) < _GATHER_BELOW
        return small and w.starts.numel() * len(columns) > _IOV_MAX

    def _send_from_ring(self, head: Sequence[bytes | memoryview], columns: list[torch.Tensor],
                        w: Windows) -> tuple[bool, int, int]:
        """Send while the socket takes bytes at once; where that stopped: (head sent, column, first window)."""
        count = w.starts.numel()
        head_bytes = sum(memoryview(b).nbytes for b in head)
        window_bytes = [w.seq_len * _row_bytes(c) for c in columns]
        room = self._room()
        if room < head_bytes:
            return False, 0, 0
        wire.send_buffers(self._conn, head)
        if room - head_bytes >= count * sum(window_bytes):  # all of it: one writev, as if nothing could block
            _C.send_windows(self._fd, columns, w.starts, w.valid_begin, w.valid_end, w.seq_len)
            return True, len(columns), 0
        for c, (column, per_window) in enumerate(zip(columns, window_bytes)):
            first = 0 if per_window else count  # a column of empty steps sends nothing
            while first < count:
                n = min(count - first, self._room() // per_window)
                if n == 0 and self._wait_for_room():
                    n = min(count - first, self._room() // per_window)
                if n == 0:
                    return True, c, first
                end = first + n
                _C.send_windows(self._fd, [column], w.starts[first:end], w.valid_begin[first:end],
                                w.valid_end[first:end], w.seq_len)
                first = end
        return True, len(columns), 0

    def _room(self) -> int:
        """Bytes the socket surely takes now without waiting.

        The kernel charges a send buffer for its packets' memory, not only their
        bytes: up to 1.6x the bytes for 1.5 KiB packets (measured), more for tiny
        ones. Half the free space, less one large packet, stays clear of that.
        Where the kernel does not tell (not Linux), nothing is sure: every row is copied.
        """
        try:
            info = _MEMINFO.unpack(self._conn.getsockopt(socket.SOL_SOCKET, _SO_MEMINFO, _MEMINFO.size))
        except OSError:
            return 0
        return max(0, info[_SNDBUF] - info[_WMEM_QUEUED] - _PACKET) // 2

    def _wait_for_room(self) -> bool:
        """Whether the learner makes room within a moment (the rows stay held meanwhile)."""
        poller = select.poll()
        poller.register(self._fd, select.POLLOUT)
        return bool(poller.poll(_WAIT_MS))

    def _copy(self, columns: list[torch.Tensor], w: Windows, first: int) -> list[memoryview]:
        """The rows not sent yet, gathered into the connection's buffer: the first column's from window
        ``first`` on, every window of the others' (all of them in one gather when ``first`` is 0)."""
        parts = [(column, first if i == 0 else 0) for i, column in enumerate(columns)]
        positions = [(w.starts.numel() - f) * w.seq_len for _, f in parts]
        sizes = [n * _row_bytes(column) for (column, _), n in zip(parts, positions)]
        offsets = list(itertools.accumulate((-(-size // _ALIGN) * _ALIGN for size in sizes), initial=0))
        buffer = self._buffer_of(offsets[-1])
        rows = [buffer[offset: offset + size].view(column.dtype).view(n, *column.shape[1:])
                for (column, _), n, size, offset in zip(parts, positions, sizes, offsets)]
        if first:
            gather.gather_windows(columns[:1], w.starts[first:], w.seq_len, _CPU, w.valid_begin[first:],
                                  w.valid_end[first:], out=rows[:1])
        done = 1 if first else 0
        if len(columns) > done:
            gather.gather_windows(columns[done:], w.starts, w.seq_len, _CPU, w.valid_begin, w.valid_end,
                                  out=rows[done:])
        return [wire.as_bytes(r) for r in rows]

    def _buffer_of(self, nbytes: int) -> torch.Tensor:
        """At least ``nbytes`` of scratch; one up to ``_KEEP_BYTES`` is kept for the next reply."""
        if self._buffer.numel() >= nbytes:
            return self._buffer
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes <= _KEEP_BYTES:
            self._buffer = buffer
        return buffer


def _row_bytes(column: torch.Tensor) -> int:
    return column.stride(0) * column.element_size()
