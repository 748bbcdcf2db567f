"""Gather: rows or windows of every column into a batch, in one extension call.

Rows are windows of length one, so both go through the same kernel: a CPU
loop of memcpys, or (for CUDA outputs) one CUDA kernel that reads pinned host
or device memory in place.
"""
from __future__ import annotations

import torch

from gear_torchrl._ext import _C


def _empty_like_rows(columns: list[torch.Tensor], num_rows: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty((num_rows, *c.shape[1:]), dtype=c.dtype, device=device) for c in columns]


def gather_rows(columns: list[torch.Tensor], rows: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """``[c[rows] for c in columns]``; ``rows`` must already be in range."""
    out = _empty_like_rows(columns, rows.numel(), device)
    _C.gather(columns, out, rows)
    return out


def gather_windows(
    columns: list[torch.Tensor],
    starts: torch.Tensor,
    seq_len: int,
    device: torch.device,
    valid_begin: torch.Tensor | None = None,
    valid_end: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Windows of ``seq_len`` ring rows from ``starts``, padded outside ``[valid_begin, valid_end)``.

    Returns the flat ``[num_windows * seq_len, ...]`` columns and the validity mask.
    """
    out = _empty_like_rows(columns, starts.numel() * seq_len, device)
    mask = torch.empty(starts.numel() * seq_len, dtype=torch.bool, device=device)
    _C.gather(columns, out, starts, valid_begin, valid_end, seq_len, mask)
    return out, mask
