"""Plan one-sided RDMA READs for a ``Windows``: pure arithmetic, no verbs.

A read request names windows of ring rows for every column. RDMA READ moves
one contiguous remote byte range per work request (WR) and scatters it into
a list of local scatter-gather elements (SGEs). Planning turns the request
into as few WRs as the limits allow, in four vectorized steps:

1. ``window_row_runs``: each window's valid positions become one or two runs
   of ring rows (two when the window wraps the ring end).
2. ``column_byte_pieces``: every run of every column becomes a byte range,
   remote (in the owner's segment) and local (in the output buffers).
3. ``coalesce_pieces``: pieces adjacent both remotely and locally merge.
4. ``pack_work_requests``: pieces adjacent remotely only share a WR as
   separate SGEs; WRs are cut at ``max_msg_bytes`` and ``max_sge``.

Everything is int64 numpy arrays, so segments and batches past 2 or 4 GiB
are exact, and nothing loops over rows or pieces in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gear_torchrl.distributed.transports.base import ColumnLayout
from gear_torchrl.store.windows import Windows

# ibv_sge.length and ibv_send_wr byte counts are 32-bit; keep every WR below 2 GiB.
MAX_MSG_BYTES_LIMIT = 1 << 31

_I64 = np.int64


@dataclass(frozen=True)
class RowRuns:
    """Runs of consecutive ring rows, in the order of their output positions."""

    row_start: np.ndarray  # int64 [R], first ring row of the run
    num_rows: np.ndarray  # int64 [R], > 0
    out_pos: np.ndarray  # int64 [R], output position (w * window_len + p) of the first row


@dataclass(frozen=True)
class BytePieces:
    """Byte ranges to copy: remote address -> local address, ``length`` bytes each."""

    remote_addr: np.ndarray  # int64 [P]
    local_addr: np.ndarray  # int64 [P]
    length: np.ndarray  # int64 [P], > 0


@dataclass(frozen=True)
class WorkRequests:
    """Work requests to post: WR ``k`` reads ``wr_length[k]`` bytes at ``wr_remote_addr[k]``
    and scatters them, in order, into SGEs ``wr_sge_begin[k] : wr_sge_begin[k] + wr_num_sge[k]``.
    """

    wr_remote_addr: np.ndarray  # int64 [K]
    wr_length: np.ndarray  # int64 [K]
    wr_sge_begin: np.ndarray  # int64 [K], index of the WR's first SGE
    wr_num_sge: np.ndarray  # int64 [K]
    sge_local_addr: np.ndarray  # int64 [S]
    sge_length: np.ndarray  # int64 [S]
    sge_wr: np.ndarray  # int64 [S], the WR each SGE belongs to

    @property
    def num_wrs(self) -> int:
        return int(self.wr_remote_addr.size)

    @property
    def num_sges(self) -> int:
        return int(self.sge_local_addr.size)

    @property
    def total_bytes(self) -> int:
        return int(self.wr_length.sum())


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=_I64)


def _as_int64(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().numpy()
    return np.ascontiguousarray(t, dtype=_I64).reshape(-1)


def window_row_runs(request: Windows, capacity: int) -> RowRuns:
    """Split each window's valid positions into runs of ring rows, wrapping at ``capacity``.

    Position ``p`` of window ``w`` is ring row ``(starts[w] + p) % capacity``, so
    a window's valid range is one run, or two when it passes the ring end.
    Raises IndexError for starts outside the ring, ValueError for bad ranges.
    """
    starts = _as_int64(request.starts)
    begin = _as_int64(request.valid_begin)
    end = _as_int64(request.valid_end)
    window_len = int(request.window_len)
    if not (starts.size == begin.size == end.size):
        raise ValueError("starts, valid_begin and valid_end must have one entry per window")
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if starts.size and (starts.min() < 0 or starts.max() >= capacity):
        raise IndexError(f"window starts must lie in [0, {capacity})")
    if starts.size and (begin.min() < 0 or end.max() > window_len or (begin > end).any()):
        raise ValueError(f"need 0 <= valid_begin <= valid_end <= window_len ({window_len})")
    count = end - begin
    if count.size and count.max() > capacity:
        raise ValueError(f"a window reads {int(count.max())} rows, more than the ring's {capacity}")

    first_row = (starts + begin) % capacity
    first_count = np.minimum(count, capacity - first_row)
    first_pos = np.arange(starts.size, dtype=_I64) * window_len + begin
    # Two runs per window, interleaved so the output order is kept: [w0a, w0b, w1a, ...].
    row_start = np.stack([first_row, np.zeros_like(first_row)], axis=1).reshape(-1)
    num_rows = np.stack([first_count, count - first_count], axis=1).reshape(-1)
    out_pos = np.stack([first_pos, first_pos + first_count], axis=1).reshape(-1)
    keep = num_rows > 0
    return RowRuns(row_start[keep], num_rows[keep], out_pos[keep])


def column_byte_pieces(runs: RowRuns, layout: ColumnLayout, remote_base: int, out_addrs: Sequence[int]) -> BytePieces:
    """Every run of every column as a byte range, remote and local.

    Remote: ``remote_base + offsets[c] + row * row_bytes[c]``. Local:
    ``out_addrs[c] + out_pos * row_bytes[c]``. Columns of zero-byte rows add nothing.
    """
    if len(out_addrs) != len(layout.offsets) or len(layout.row_bytes) != len(layout.offsets):
        raise ValueError("layout offsets, row_bytes and out_addrs need one entry per column")
    row_bytes = np.asarray(layout.row_bytes, dtype=_I64)
    live = row_bytes > 0
    row_bytes = row_bytes[live][:, None]
    remote_col = (np.asarray(layout.offsets, dtype=_I64)[live] + _I64(remote_base))[:, None]
    local_col = np.asarray(out_addrs, dtype=_I64)[live][:, None]
    remote = remote_col + runs.row_start[None, :] * row_bytes
    local = local_col + runs.out_pos[None, :] * row_bytes
    length = runs.num_rows[None, :] * row_bytes
    return BytePieces(remote.reshape(-1), local.reshape(-1), length.reshape(-1))


def coalesce_pieces(pieces: BytePieces) -> BytePieces:
    """Merge pieces whose remote AND local ranges both follow on: one copy instead of many.

    Local ranges do not overlap, so in local-address order a piece can only
    follow on from its predecessor; one pass over the sorted arrays finds all.
    """
    if pieces.length.size == 0:
        return pieces
    order = np.argsort(pieces.local_addr, kind="stable")
    remote, local, length = pieces.remote_addr[order], pieces.local_addr[order], pieces.length[order]
    joins = (local[1:] == local[:-1] + length[:-1]) & (remote[1:] == remote[:-1] + length[:-1])
    heads = np.flatnonzero(np.concatenate([[True], ~joins]))
    return BytePieces(remote[heads], local[heads], np.add.reduceat(length, heads))


def _split_at_message_boundaries(
    run_offset: np.ndarray, length: np.ndarray, max_msg_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut pieces where their remote run crosses a multiple of ``max_msg_bytes``.

    Returns (index of the source piece, start offset inside the run, length)
    of each chunk; a chunk never crosses a boundary, so chunks in the same
    ``offset // max_msg_bytes`` window of one run fit one WR.
    """
    first_window = run_offset // max_msg_bytes
    last_window = (run_offset + length - 1) // max_msg_bytes
    chunks_per_piece = last_window - first_window + 1
    source = np.repeat(np.arange(length.size, dtype=_I64), chunks_per_piece)
    chunk_index = np.arange(source.size, dtype=_I64) - np.repeat(
        np.cumsum(chunks_per_piece) - chunks_per_piece, chunks_per_piece
    )
    window = first_window[source] + chunk_index
    start = np.maximum(run_offset[source], window * max_msg_bytes)
    stop = np.minimum(run_offset[source] + length[source], (window + 1) * max_msg_bytes)
    return source, start, stop - start


def pack_work_requests(pieces: BytePieces, max_sge: int, max_msg_bytes: int) -> WorkRequests:
    """Group remote-contiguous pieces into WRs of at most ``max_sge`` SGEs and ``max_msg_bytes``.

    Pieces sorted by remote address form runs of contiguous remote bytes; a
    run is read by consecutive WRs, each one remote range scattered into the
    pieces' local ranges (the SGEs). Long pieces are split across WRs.
    """
    if max_sge < 1:
        raise ValueError(f"max_sge must be at least 1, got {max_sge}")
    if not 1 <= max_msg_bytes <= MAX_MSG_BYTES_LIMIT:
        raise ValueError(f"max_msg_bytes must be in [1, {MAX_MSG_BYTES_LIMIT}], got {max_msg_bytes}")
    if pieces.length.size == 0:
        return WorkRequests(*(_empty() for _ in range(7)))

    order = np.lexsort((pieces.local_addr, pieces.remote_addr))
    remote, local, length = pieces.remote_addr[order], pieces.local_addr[order], pieces.length[order]
    run_head = np.concatenate([[True], remote[1:] != remote[:-1] + length[:-1]])
    run_id = np.cumsum(run_head) - 1
    run_base = remote[run_head][run_id]

    source, start, chunk_len = _split_at_message_boundaries(remote - run_base, length, max_msg_bytes)
    chunk_run = run_id[source]
    chunk_window = start // max_msg_bytes
    sge_remote = run_base[source] + start
    sge_local = local[source] + (start - (remote[source] - run_base[source]))

    # A WR holds consecutive chunks of one (run, window) group, at most max_sge of them.
    group_head = np.concatenate([[True], (chunk_run[1:] != chunk_run[:-1]) | (chunk_window[1:] != chunk_window[:-1])])
    group_first = np.flatnonzero(group_head)
    group_size = np.diff(np.append(group_first, source.size))
    index_in_group = np.arange(source.size, dtype=_I64) - np.repeat(group_first, group_size)
    wr_head = index_in_group % max_sge == 0
    wr_first = np.flatnonzero(wr_head)
    wr_num_sge = np.diff(np.append(wr_first, source.size)).astype(_I64)
    return WorkRequests(
        wr_remote_addr=sge_remote[wr_first],
        wr_length=np.add.reduceat(chunk_len, wr_first).astype(_I64),
        wr_sge_begin=wr_first.astype(_I64),
        wr_num_sge=wr_num_sge,
        sge_local_addr=sge_local,
        sge_length=chunk_len,
        sge_wr=(np.cumsum(wr_head) - 1).astype(_I64),
    )


def plan_reads(
    request: Windows, layout: ColumnLayout, remote_base: int, out_addrs: Sequence[int], max_sge: int, max_msg_bytes: int
) -> WorkRequests:
    """All WRs that read ``request`` from the segment at ``remote_base`` into ``out_addrs``.

    ``out_addrs[c]`` is the local address of output position 0 of column ``c``;
    positions are ``row_bytes[c]`` apart. Padding positions get no bytes.
    """
    runs = window_row_runs(request, layout.capacity)
    pieces = column_byte_pieces(runs, layout, remote_base, out_addrs)
    return pack_work_requests(coalesce_pieces(pieces), max_sge, max_msg_bytes)


def region_end_of(layout: ColumnLayout) -> int:
    """Bytes from the segment start that the layout's columns span (what must be registered)."""
    ends = [off + layout.capacity * rb for off, rb in zip(layout.offsets, layout.row_bytes) if rb > 0]
    return max(ends, default=0)


def valid_positions(request: Windows) -> torch.Tensor:
    """Output positions (``w * window_len + p``) that a read fills, ascending, int64."""
    begin = request.valid_begin.reshape(-1, 1).to(torch.int64)
    end = request.valid_end.reshape(-1, 1).to(torch.int64)
    p = torch.arange(request.window_len, dtype=torch.int64).reshape(1, -1)
    return torch.nonzero(((p >= begin) & (p < end)).reshape(-1)).reshape(-1)
