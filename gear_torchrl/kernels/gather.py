"""Gather: rows or windows of every column into a batch, in one kernel call.

Rows are windows of length one, so both go through the same kernel: a CPU
loop of memcpys, or (for CUDA outputs) one CUDA kernel that reads pinned host
or device memory in place. The CUDA kernel comes from the extension when it
was built with CUDA, else the same source is compiled at run time by CuPy.
This module is the only place that chooses.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from gear_torchrl.kernels import _C, cupy_kernels

# Tests set this to run the CuPy path on a machine whose extension has CUDA.
_FORCE_CUPY = os.environ.get("GEAR_TORCHRL_FORCE_CUPY") == "1"


def cuda_unavailable_reason() -> str | None:
    """None when CUDA gathers can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if _C.built_with_cuda() and not _FORCE_CUPY:
        return None
    reason = cupy_kernels.unavailable_reason()
    if reason is None:
        return None
    return (
        f"the extension was built without its CUDA part and the CuPy fallback cannot run: {reason}. "
        "Rebuild with a CUDA torch and nvcc (GEAR_TORCHRL_CUDA=ON) or install CuPy"
    )


def _use_cupy() -> bool:
    return _FORCE_CUPY or not _C.built_with_cuda()


class HotRows(NamedTuple):
    """Copies of some rows in GPU memory: row ``r`` sits in slot ``r % len(owner)`` when ``owner`` says so."""

    columns: list[torch.Tensor]  # [slots, *step_shape] per column, on the outputs' device
    owner: torch.Tensor  # int64 [slots]: the row each slot holds, -1 for none


def _launch(
    columns, out, starts, valid_begin=None, valid_end=None, window_len=1, mask=None, hot: HotRows | None = None
) -> None:
    hot_columns, hot_owner = ([], None) if hot is None else hot
    if out[0].is_cuda and _use_cupy():
        cupy_kernels.gather(columns, out, starts, valid_begin, valid_end, window_len, mask, hot_columns, hot_owner)
    else:
        _C.gather(columns, out, starts, valid_begin, valid_end, window_len, mask, hot_columns, hot_owner)


def _empty_like_rows(columns: list[torch.Tensor], num_rows: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty((num_rows, *c.shape[1:]), dtype=c.dtype, device=device) for c in columns]


def gather_rows(
    columns: list[torch.Tensor], rows: torch.Tensor, device: torch.device, hot: HotRows | None = None
) -> list[torch.Tensor]:
    """``[c[rows] for c in columns]`` on ``device``; ``rows`` must already be in range."""
    out = _empty_like_rows(columns, rows.numel(), device)
    _launch(columns, out, rows, hot=hot)
    return out


def gather_windows(
    columns: list[torch.Tensor],
    starts: torch.Tensor,
    window_len: int,
    device: torch.device,
    valid_begin: torch.Tensor | None = None,
    valid_end: torch.Tensor | None = None,
    out: list[torch.Tensor] | None = None,
    hot: HotRows | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Windows of ``window_len`` ring rows from ``starts``, padded outside ``[valid_begin, valid_end)``.

    Returns the flat ``[num_windows * window_len, ...]`` columns (``out`` when given:
    contiguous tensors of that shape) and the validity mask.
    """
    if out is None:
        out = _empty_like_rows(columns, starts.numel() * window_len, device)
    mask = torch.empty(starts.numel() * window_len, dtype=torch.bool, device=device)
    _launch(columns, out, starts, valid_begin, valid_end, window_len, mask, hot)
    return out, mask


def host_register(tensor: torch.Tensor) -> None:
    """Pin and map a CPU tensor's memory in place so CUDA gathers read it with zero copy."""
    (cupy_kernels.host_register if _use_cupy() else _C.cuda_host_register)(tensor)


def host_unregister(tensor: torch.Tensor) -> None:
    (cupy_kernels.host_unregister if _use_cupy() else _C.cuda_host_unregister)(tensor)
